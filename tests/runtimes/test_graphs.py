"""CUDA graphs for static-shape GPU parts (runtimes/graphs.py), what runs without CUDA: the
static buffers and the copies around a replay (a plain function stands in for the graph),
the fallback of a part that is not on a CUDA device, the config key, and the plan's word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cuvild.config import parse
from cuvild.load.precision import runtime_notes
from cuvild.workers.sessions import run_into
from protos.orders import Built
from runtimes import graphs

CPU = torch.device("cpu")


def part(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.relu(x @ w), x.sum(dim=1)


def test_a_replay_reads_the_static_inputs_and_writes_into_the_places() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 4)
    graphed = graphs.Graphed(part, [w], [torch.randn(2, 8)], CPU, torch.float32,
                             torch.float32, capture=graphs.plain_capture)
    for _ in range(3):  # every run sees its own inputs, not the capture's
        x = torch.randn(2, 8)
        places = [torch.full((2, 4), -1.0), torch.full((2,), -1.0)]
        outs = graphed.run([x], places)
        assert [o.data_ptr() for o in outs] == [p.data_ptr() for p in places]
        torch.testing.assert_close(places[0], torch.relu(x @ w))
        torch.testing.assert_close(places[1], x.sum(dim=1))
    fresh = graphed.run([x])  # no places: fresh host tensors, not the graph's own buffers
    assert fresh[0].data_ptr() not in {o.data_ptr() for o in graphed.captured.outputs}
    torch.testing.assert_close(fresh[0], torch.relu(x @ w))
    with pytest.raises(ValueError, match="shapes are fixed"):
        graphed.run([torch.randn(3, 8)])
    with pytest.raises(ValueError, match="takes 1 inputs, got 2"):
        graphed.run([x, x])


def test_a_lower_precision_graph_casts_inside_and_answers_in_the_callers_dtype() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 4).to(torch.bfloat16)
    graphed = graphs.Graphed(part, [w], [torch.randn(2, 8)], CPU, torch.bfloat16,
                             torch.float32, capture=graphs.plain_capture)
    assert graphed.static[0].dtype == torch.bfloat16
    x = torch.randn(2, 8)
    out, total = graphed.run([x], [np.zeros((2, 4), np.float32), None])  # (not tensors)
    assert out.dtype == torch.float32 and total.dtype == torch.float32
    torch.testing.assert_close(out, torch.relu(x @ w.float()), rtol=2e-2, atol=2e-2)


def test_a_part_off_cuda_runs_as_before_and_says_nothing() -> None:
    from runtimes.triton import InductorExecutable

    exe = InductorExecutable(lambda x: x * 2, CPU, "fp32", torch.float32)
    assert exe.graph == "" and not exe.want_graph
    x, out = torch.randn(3), torch.empty(3)
    run_into(exe, [x], [out])  # (the worker's path)
    torch.testing.assert_close(out, 2 * x)
    assert exe.graphed is None


def test_the_worker_lets_a_runtime_write_its_outputs_in_place() -> None:
    class WritesInPlace:
        def run_into(self, inputs: list, places: list) -> list:
            places[0].copy_(inputs[0] + 1)
            return places

    place = torch.zeros(4)
    run_into(WritesInPlace(), [torch.ones(4)], [place])
    torch.testing.assert_close(place, torch.full((4,), 2.0))


def test_the_config_key_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse({}).cuda_graphs is True
    assert parse({"devices": {"gpu": {"cuda_graphs": False}}}).cuda_graphs is False
    with pytest.raises(ValueError, match="devices.gpu.cuda_graphs"):
        parse({"devices": {"gpu": {"cuda_graphs": "sometimes"}}})
    monkeypatch.setenv(graphs.ENV, "0")
    assert not graphs.wanted()
    monkeypatch.setenv(graphs.ENV, "1")
    assert graphs.wanted()


def test_the_plan_says_how_each_gpu_part_is_launched() -> None:
    graph, off = ("cuda graph (captured at its first request)",
                  "kernel by kernel (devices.gpu.cuda_graphs is off)")
    routes = [SimpleNamespace(id="p0", device="gpu0", runtime="triton",
                              built=Built("triton", False, graph=graph)),
              SimpleNamespace(id="p1", device="gpu0", runtime="triton",
                              built=Built("triton", False, graph=off)),
              SimpleNamespace(id="p2", device="cpu0", runtime="openvino",
                              built=Built("openvino", False))]
    assert runtime_notes(routes) == [
        "p0 on gpu0 runs as a cuda graph (captured at its first request)",
        "p1 on gpu0 runs kernel by kernel (devices.gpu.cuda_graphs is off)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the real thing")
def test_the_lease_script_dry_runs_section_by_section(tmp_path) -> None:
    """tests/gpu/check_gpu.py without CUDA: every section says so, the summary is written,
    and the run fails (exit 1) in seconds, not minutes."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "tests/gpu/check_gpu.py", "--budget", "60"],
                          cwd=root, env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu_summary.json").read_text())
    sections = ("the profile", "host<->device copies", "parts", "daemon", "AOTInductor")
    for name in sections:
        (error,) = [e for e in summary["errors"] if e.startswith(name)]
        assert "no CUDA device" in error, error
    assert summary["environment"]["cuda_available"] is False
