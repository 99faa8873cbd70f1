"""The daemon the OIP tests run against: one for the session, with three small models loaded
once: an MLP (one part), the demo model (backbone pinned to the emulated NPU: two parts in two
worker processes) and a two-input model (for requests that mix shared memory and raw
inputs)."""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm

from cuvild.client import Client, samples
from protos import inference_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/serve: oip_helpers.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: daemons.py
from daemons import DaemonProcess, daemon_config  # noqa: E402
from oip_helpers import KEY_PREFIX, SHM_DIR, Env, Pair, served_model, wait_ready  # noqa: E402


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory, state_root: Path,
        sock_dir: Path) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("oip")
    state_dir = workdir / "state"  # its own registry; the session's device profiles
    if (state_root / "profiles").exists():
        shutil.copytree(state_root / "profiles", state_dir / "profiles")
    daemon = DaemonProcess(workdir, daemon_config(workdir, state_dir, sock_dir)).start()
    if not (state_root / "profiles").exists() and (state_dir / "profiles").exists():
        shutil.copytree(state_dir / "profiles", state_root / "profiles")
    torch.manual_seed(0)
    mlp = samples.MLP(width=64, depth=2).eval()
    demo, demo_inputs = samples.reference("demo")
    pair = Pair().eval()
    wanted = {
        "mlp": (mlp, (torch.randn(2, 64),)),
        "demo": (demo, demo_inputs),
        "pair": (pair, (torch.randn(2, 8), torch.randn(2, 4))),
    }
    models = {}
    try:
        with Client(daemon.target) as client:
            for name, (model, inputs) in wanted.items():
                summary = client.load(name, model, inputs)["model"]
                models[name] = served = served_model(name, model, inputs)
                served.input_names = [t["name"] for t in summary["inputs"]]
                served.output_names = [t["name"] for t in summary["outputs"]]
                served.output_name = served.output_names[0]
            wait_ready(client, set(wanted), daemon)
        yield Env(daemon, models)
    finally:
        daemon.close()
        for path in SHM_DIR.glob(f"{KEY_PREFIX}*"):  # only if a test failed midway
            path.unlink(missing_ok=True)


@pytest.fixture
def triton(env: Env) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(url=env.daemon.target)
    yield client
    client.close()


@pytest.fixture
def stub(env: Env) -> Iterator[inference_pb2_grpc.GRPCInferenceServiceStub]:
    """Our generated stub, for requests tritonclient never builds (typed, malformed)."""
    with grpc.insecure_channel(env.daemon.target) as channel:
        yield inference_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture
def regions(env: Env, triton: grpcclient.InferenceServerClient) -> Iterator[Callable[..., Any]]:
    """Factory: regions(nbytes, register=True) -> (region name, key, handle); cleaned up after."""
    made: list[tuple[str, Any, bool]] = []

    def make(nbytes: int, register: bool = True) -> tuple[str, str, Any]:
        name = f"r{uuid.uuid4().hex[:8]}"
        key = f"/{KEY_PREFIX}{name}"
        handle = shm.create_shared_memory_region(name, key, nbytes)
        env.keys.append(key)
        if register:
            triton.register_system_shared_memory(name, key, nbytes)
        made.append((name, handle, register))
        return name, key, handle

    yield make
    registered = {r["name"] for r in
                  triton.get_system_shared_memory_status(as_json=True).get("regions", {}).values()}
    for name, handle, _ in made:
        if name in registered:
            triton.unregister_system_shared_memory(name)
        shm.destroy_shared_memory_region(handle)
