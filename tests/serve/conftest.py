"""The daemon the OIP tests run against: one for the session, with three small models loaded
once: an MLP (one part), the demo model (backbone pinned to the emulated NPU: two parts in two
worker processes) and a two-input model (for requests that mix shared memory and raw
inputs); the hardening tests' daemon; and the generation tests' (`lm_daemon`: language
models from a model repository, with an HTTP listener)."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from daemons import DaemonProcess, free_port, own_registry_daemon, suite_config
from generation_helpers import all_ready, lm_repository
from oip_helpers import (
    KEY_PREFIX,
    LIMITS,
    SHM_DIR,
    Env,
    Pair,
    served_model,
    wait_ready,
)

from cuvild.client import Client, samples
from protos import inference_pb2_grpc


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory, state_root: Path,
        sock_dir: Path) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("oip")
    daemon = own_registry_daemon(workdir, state_root, sock_dir)
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


@pytest.fixture(scope="session")
def hardened(tmp_path_factory: pytest.TempPathFactory, state_root: Path,
             sock_dir: Path) -> Iterator[tuple[object, torch.Tensor, torch.Tensor]]:
    """A daemon with small limits (LIMITS), a TCP listener and a tiny MLP "mlp"; yields
    (daemon, x, eager y). The hardening and fuzz tests share it."""
    workdir = tmp_path_factory.mktemp("hard")
    port = _free_port()
    config = suite_config(workdir, workdir / "state", sock_dir, limits=LIMITS,
                           shm={"max_regions_per_caller": 4},
                           listen={"tcp": f"127.0.0.1:{port}", "insecure_loopback": True})
    daemon = DaemonProcess(workdir, config, profiles=state_root).start()
    daemon.tcp = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    torch.manual_seed(0)
    mlp = samples.MLP(width=16, depth=2).eval()
    x = torch.randn(2, 16)
    with torch.inference_mode():
        y = mlp(x)
    try:
        with Client(daemon.target) as client:
            client.load("mlp", mlp, (x,))
            _wait_ready(client, "mlp")
        yield daemon, x, y
    finally:
        daemon.stop()
        daemon.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(client: Client, name: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {m["name"]: m["state"] for m in client.status()["models"]}
        if states.get(name, "loading") != "loading":
            assert states[name] == "ready", states
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} not ready in {timeout} s")


@pytest.fixture(scope="session")
def lm_served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The generation tests' model repository (generation_helpers.lm_repository) and the
    transformers models in it."""
    root = tmp_path_factory.mktemp("lm-repo")
    return {"root": root, "hf": lm_repository(root)}


@pytest.fixture(scope="session")
def lm_daemon(tmp_path_factory: pytest.TempPathFactory, state_root: Path, sock_dir: Path,
              shared_cache: Path, lm_served: dict[str, Any]) -> Iterator[DaemonProcess]:
    """One daemon for test_generation.py and test_openai_generation.py (one worker runs both:
    tests/conftest.py SAME_WORKER), serving `lm_served`'s repository, an HTTP listener at
    its `http`: its four models build once."""
    http = f"127.0.0.1:{free_port()}"
    torch_too = {"cpu": ["openvino", "torch"], "npu": ["openvino", "torch"]}
    workdir = tmp_path_factory.mktemp("generation")
    config = suite_config(workdir, workdir / "state", sock_dir, cache_dir=str(shared_cache),
                          model_repository=str(lm_served["root"]),
                          engine={"runtimes": torch_too},
                          listen={"http": http, "insecure_loopback": True})
    d = DaemonProcess(workdir, config, profiles=state_root).start()
    d.http = http  # type: ignore[attr-defined]
    try:
        all_ready(d.target, ("gpt2", "llama", "chunked", "bytes"))
        yield d
    finally:
        d.close()
