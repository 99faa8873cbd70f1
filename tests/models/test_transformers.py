"""Hugging Face transformers models served unchanged: their ModelOutput outputs, keyword
inputs and attention masks (aten.__and__) through the safe intake, named by the model
(`input_ids`, `logits`), through tritonclient and the Python client, matched to torch eager.

One daemon for the file, sharing the session's device profiles and compile cache; test
daemons build with OpenVINO (tests/daemons.py TEST_RUNTIMES). The families are tiny
(tests/models/hf_models.py), so the file takes a minute or two on 2 cores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from daemons import DaemonProcess, suite_config
from hf_models import FAMILIES, build

from cuvild.client import Client
from runtimes.base import relative_error

FP32_TOLERANCE = 1e-4
AUTO_BUDGET = 1e-2


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, state_root: Path, sock_dir: Path,
           shared_cache: Path) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("models")
    config = suite_config(workdir, workdir / "state", sock_dir, cache_dir=str(shared_cache))
    daemon = DaemonProcess(workdir, config, profiles=state_root).start()
    try:
        yield daemon.target
    finally:
        daemon.close()


def tensors(outputs: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in outputs.items() if isinstance(v, torch.Tensor)}


def triton_infer(target: str, name: str, kwargs: dict[str, torch.Tensor],
                 outputs: list[str]) -> dict[str, np.ndarray]:
    client = grpcclient.InferenceServerClient(url=target)
    try:
        inputs = []
        for key, value in kwargs.items():
            x = grpcclient.InferInput(key, list(value.shape),
                                      "INT64" if value.dtype == torch.int64 else "FP32")
            x.set_data_from_numpy(value.numpy())
            inputs.append(x)
        wanted = [grpcclient.InferRequestedOutput(o) for o in outputs]
        result = client.infer(name, inputs, outputs=wanted)
        return {o: result.as_numpy(o) for o in outputs}
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_is_served_unchanged_and_matches_eager(target: str, family: str) -> None:
    """One load a family, under `auto`: the model, its keyword inputs and ModelOutput served
    by their own names (the Python client, the shared-memory path and tritonclient), every
    part at fp32 within FP32_TOLERANCE of eager (the load's own check, before lowering), and
    what it serves within the budget. (An fp32 load of its own, besides, cost the suite a
    build and check of each family again: ~70 s of its 2 cores.)"""
    model, kwargs, ref = build(family)
    expected = tensors(ref)
    name = f"{family}-auto"
    with Client(target) as client:
        summary = client.load(name, model, kwargs=kwargs, precision="auto",
                              max_error=AUTO_BUDGET)["model"]
        assert [i["name"] for i in summary["inputs"]] == list(kwargs)  # forward's names
        assert [o["name"] for o in summary["outputs"]] == list(expected)  # field names
        meta = client.metadata(name)
        assert [i["name"] for i in meta["inputs"]] == list(kwargs)
        assert [o["name"] for o in meta["outputs"]] == list(expected)
        report = client.compare(name)
        assert report["fp32"]["error"] <= FP32_TOLERANCE, report["fp32"]
        assert summary["measured_error"] is not None
        assert summary["measured_error"] <= AUTO_BUDGET
        got = client.infer(name, kwargs)
        assert type(got) is type(ref)  # transformers is imported here: its own ModelOutput
        by_shm = client.infer(name, kwargs, shm=True)
        by_triton = triton_infer(target, name, kwargs, list(expected))
    for key, want in expected.items():
        # the budget holds on the load's check inputs; these are others: a little headroom
        assert relative_error(got[key], want) <= 2 * AUTO_BUDGET, key
        assert torch.equal(by_shm[key], got[key]), key
        assert torch.equal(torch.from_numpy(by_triton[key]), got[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_dynamic_sequence_length_is_served(target: str, family: str) -> None:
    model, kwargs, _ = build(family)
    seq = torch.export.Dim("seq", min=2, max=64)
    name = f"{family}-dynamic"
    with Client(target) as client:
        summary = client.load(name, model, kwargs=kwargs,
                              dynamic_shapes={k: {1: seq} for k in kwargs})["model"]
        assert all(i["shape"] == [2, -1] for i in summary["inputs"])
        for length in (16, 5, 33):
            _, inputs, ref = build(family, seq=length)
            got = client.infer(name, inputs)
            for key, want in tensors(ref).items():
                assert got[key].shape == want.shape
                assert relative_error(got[key], want) <= FP32_TOLERANCE, (key, length)


class WidePool(torch.nn.Module):
    """EfficientNet's head as transformers builds it: an AvgPool whose kernel is wider than
    its input, with ceil_mode (torch averages what the window covers; OpenVINO's CPU plugin
    refuses the shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.pool = torch.nn.AvgPool2d(16, ceil_mode=True)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.conv(pixel_values))).flatten(1))


@pytest.mark.slow
def test_a_part_openvino_refuses_runs_on_another_runtime_and_the_plan_says_why(
        make_daemon: Any) -> None:
    torch.manual_seed(0)
    model, x = WidePool().eval(), torch.randn(2, 3, 4, 4)
    # the suite's devices (their profile measured already); the NPU's OpenVINO refuses it
    # too, and the part is planned again on the CPU
    daemon = make_daemon(engine={"runtimes": {"cpu": ["openvino", "onnxruntime"],
                                              "npu": ["openvino"]}})
    with Client(daemon.target) as client:
        client.load("widepool", model, (x,), precision="fp32")
        plan = client.plan("widepool")["plan"]
        got = client.infer("widepool", x)["output0"]
    assert [p["runtime"] for p in plan["parts"]] == ["onnxruntime"]
    assert any("runs on onnxruntime: openvino failed" in n for n in plan["notes"]), plan["notes"]
    assert relative_error(got, model(x).detach()) <= FP32_TOLERANCE


def test_a_client_that_only_imports_transformers_gets_its_model_output(target: str) -> None:
    """transformers 5 loads its modules lazily: `import transformers` alone registers no
    ModelOutput with pytree. The client imports the one module that defines the output's
    class (transformers' own, by a fixed pattern), so the container comes back, not a dict."""
    import subprocess
    import sys

    model, kwargs, ref = build("bert")
    with Client(target) as client:  # (loaded by the family test, where it ran first)
        client.load("bert-auto", model, kwargs=kwargs, precision="auto", max_error=AUTO_BUDGET)
    shape = list(kwargs["input_ids"].shape)
    code = ("import sys, torch, transformers\n"
            "from cuvild.client import Client\n"
            "assert 'transformers.modeling_outputs' not in sys.modules\n"
            f"ids = torch.zeros({shape}, dtype=torch.int64)\n"
            f"given = {{k: ids if k == 'input_ids' else torch.ones_like(ids) "
            f"for k in {list(kwargs)!r}}}\n"
            f"with Client({target!r}) as c:\n"
            "    out = c.infer('bert-auto', given)\n"
            "print(type(out).__module__, type(out).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [type(ref).__module__, type(ref).__name__]
