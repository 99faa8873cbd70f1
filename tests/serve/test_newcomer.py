"""What a new user meets first (issue 48): an input of the wrong dtype is refused on every
client path naming both dtypes, never answered from reinterpreted bytes; the client's
errors are typed; a dynamic dimension without a maximum loads and serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from oip_helpers import Env
from tritonclient.utils import InferenceServerException

from cuvild.client import (
    AlreadyExists,
    Client,
    CuvildError,
    InvalidArgument,
    NotFound,
    Unavailable,
    samples,
)

# Same-size dtypes (int32 for float32) are the dangerous ones: bytes that fit, numbers that
# do not. float64 is numpy's default.
WRONG = {"int32": lambda x: x.to(torch.int32), "float64": lambda x: x.double(),
         "numpy float64": lambda x: x.numpy().astype(np.float64),
         "numpy int32": lambda x: x.numpy().astype(np.int32)}


@pytest.mark.parametrize("mode", ["raw", "shm", "fast"])
def test_a_wrong_dtype_is_refused_naming_both(env: Env, mode: str) -> None:
    served = env.models["mlp"]
    x = torch.from_numpy(served.inputs[0])
    with Client(env.daemon.target, fast=mode == "fast") as client:
        for what, convert in WRONG.items():
            with pytest.raises(InvalidArgument) as err:
                client.infer("mlp", convert(x), shm=mode == "shm")
            assert err.value.code == "INVALID_ARGUMENT"
            assert "model mlp takes float32" in str(err.value), (what, err.value)
            assert "astype(np.float32)" in str(err.value)
        y = client.infer("mlp", x, shm=mode == "shm")["output0"]
        np.testing.assert_allclose(np.asarray(y), served.expected, rtol=1e-5, atol=1e-5)


def test_tritonclient_with_a_true_label_is_refused_by_the_daemon(env: Env) -> None:
    """A client that labels its int32 bytes as INT32 (tritonclient checks its own label) meets
    the daemon's check: both dtypes named, over gRPC and HTTP alike."""
    x = env.models["mlp"].inputs[0].astype(np.int32)
    with grpcclient.InferenceServerClient(url=env.daemon.target) as triton:
        tensor = grpcclient.InferInput("x", list(x.shape), "INT32")
        tensor.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as err:
            triton.infer("mlp", [tensor])
    assert "expected dtype float32 (FP32), got int32 (INT32)" in str(err.value)
    with pytest.raises(InferenceServerException):  # tritonclient refuses a label that lies
        grpcclient.InferInput("x", list(x.shape), "FP32").set_data_from_numpy(x)


def test_cuvilctl_infer_refuses_a_wrong_dtype(env: Env, tmp_path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, env.models["mlp"].inputs[0].astype(np.int32))
    done = subprocess.run([sys.executable, "-m", "cuvild.client.cli", "--target",
                           env.daemon.target, "infer", "mlp", "--input", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "int32[2, 64], model mlp takes float32[2, 64]" in done.stderr, done.stderr


def test_client_errors_are_typed_and_say_the_fix(env: Env) -> None:
    served = env.models["mlp"]
    x = torch.from_numpy(served.inputs[0])
    with Client(env.daemon.target) as client:
        with pytest.raises(NotFound, match="unknown model 'nothing'"):
            client.infer("nothing", x)
        with pytest.raises(InvalidArgument, match=r"unknown \['y'\] missing \['x'\]"):
            client.infer("mlp", {"y": x})
        other = samples.MLP(width=64, depth=3).eval()
        with pytest.raises(AlreadyExists, match=r"replace=True"):
            client.load("mlp", other, (x,))
        assert isinstance(CuvildError("NOT_FOUND", "x"), NotFound)
    with Client("unix:///nonexistent/cuvild.sock", timeout=2) as client:
        with pytest.raises(Unavailable, match="cannot reach cuvild at unix:///nonexistent"):
            client.models()


def test_a_dynamic_dimension_without_a_maximum_loads_and_serves(make_daemon) -> None:
    """README's own `Dim("batch")` (no max=), Dim.AUTO and Dim.DYNAMIC: torch bounds them by
    its own infinity, which once failed every load. Dim.DYNAMIC also leaves an attribute on the
    example tensor that torch.export.save pickles: the archive is still accepted."""
    from torch.export import Dim

    torch.manual_seed(0)
    model = samples.MLP(width=16, depth=2).eval()
    daemon = make_daemon()
    with Client(daemon.target) as client:
        for tag, dim in (("named", Dim("batch")), ("auto", Dim.AUTO), ("dyn", Dim.DYNAMIC)):
            client.load(f"mlp-{tag}", model, (torch.randn(2, 16),),
                        dynamic_shapes=({0: dim},),
                        batching={"max_batch": 4} if tag == "named" else None)
            for batch in (2, 5):
                x = torch.randn(batch, 16)
                with torch.inference_mode():
                    want = model(x)
                got = client.infer(f"mlp-{tag}", x)["output0"]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # torch gives Dim.AUTO a minimum of 2; the refusal says so, and how to serve 1
        with pytest.raises(InvalidArgument, match=r"\[2, unbounded\].*Dim\(name, min=1\)"):
            client.infer("mlp-auto", torch.randn(1, 16))
        assert client.infer("mlp-named", torch.randn(1, 16))["output0"].shape == (1, 16)
    # noise: gRPC's fork handlers printed a line as the first upload started the forkserver
    assert "skipping fork() handlers" not in daemon.log()
    assert "device(s) from" not in daemon.log()  # "read from the profile cache" / "measured"


def test_tritonclient_reads_model_config_and_statistics(env: Env) -> None:
    """tritonclient's get_model_config / get_inference_statistics (perf_analyzer's first
    calls) answer in Triton's shape: inputs, outputs, batching; counts and durations."""
    served = env.models["mlp"]
    with grpcclient.InferenceServerClient(url=env.daemon.target) as triton:
        config = triton.get_model_config("mlp", as_json=True)["config"]
        assert config["name"] == "mlp" and config["platform"] == "pytorch_torch_export"
        assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["2", "64"]}]
        assert config["output"][0]["data_type"] == "TYPE_FP32"
        assert config.get("max_batch_size", 0) == 0  # a static batch: nothing merged
        before = triton.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
        tensor = grpcclient.InferInput("x", list(served.inputs[0].shape), "FP32")
        tensor.set_data_from_numpy(served.inputs[0])
        for _ in range(3):
            triton.infer("mlp", [tensor])
        after = triton.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
        every = triton.get_inference_statistics(as_json=True)["model_stats"]
        with pytest.raises(InferenceServerException, match="unknown model"):
            triton.get_model_config("nothing")

    def count(stats, field):
        return int(stats.get("inference_stats", {}).get(field, {}).get("count", 0))

    assert count(after, "success") - count(before, "success") == 3
    assert int(after["inference_stats"]["success"]["ns"]) > 0
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 6  # rows
    assert int(after["last_inference"]) > 0
    assert {s["name"] for s in every} >= {"mlp", "demo", "pair"}


# -- notes that misled, noise (no daemon) -------------------------------------------------------
def test_notes_say_what_they_mean() -> None:
    """compare's WHY marks a cut; stats names requests for no model plainly (it showed a row
    named ':'); a dynamic-shape model's parts say the runtimes their buckets chose and the time
    measured at the shapes served last (they said no runtime and no time)."""
    from cuvild.client.cli import clip, measured_cell
    from cuvild.serve.control import by_bucket
    from cuvild.serve.metrics import Metrics

    assert clip("x" * 80, 60) == "x" * 57 + "..." and clip("short", 60) == "short"
    metrics = Metrics()
    metrics.failed("", "", "NOT_FOUND", 0.001)
    assert set(metrics.snapshot()["models"]) == {""}  # cuvilctl: "(unknown models)"
    top = {"p0": {"device": "cpu0", "runtime": "", "predicted_ms": 0.1, "measured_ms": None}}
    buckets = [{"shapes": [[1, 16]], "parts": [{"id": "p0", "runtime": "openvino",
                                                "measured_ms": 0.2}]},
               {"shapes": [[3, 16]], "parts": [{"id": "p0", "runtime": "onnxruntime",
                                                "measured_ms": 0.15}]}]
    shown = by_bucket(top, buckets)["p0"]
    assert shown["runtime"] == "onnxruntime/openvino"
    assert measured_cell(shown) == "0.15 at 3x16"
    assert by_bucket(top, [])["p0"]["runtime"] == "per input shape, once served"


def test_make_bench_runs_one_section() -> None:
    import runpy

    bench = runpy.run_path(str(Path(__file__).parents[1] / "bench" / "run.py"))
    assert bench["chosen"](["serving", "bench_models.py"]) == ["bench_serving.py",
                                                               "bench_models.py"]
    assert bench["chosen"]([]) == bench["SECTIONS"]
    with pytest.raises(SystemExit, match="unknown section"):
        bench["chosen"](["nothing"])


def test_onnxscript_folding_warnings_are_not_ours_to_show() -> None:
    import logging

    import runtimes.onnxruntime  # noqa: F401 - sets the level

    assert logging.getLogger("onnxscript.optimizer._constant_folding").level == logging.ERROR


@pytest.mark.parametrize("depth", [450, 1200])
def test_a_spec_nested_past_the_interpreters_depth_gives_the_dict(depth: int) -> None:
    """An output spec hundreds of tuples deep (it passes intake) once raised RecursionError
    in Client.infer's rebuilding; the client answers with the dict by name instead (issue 49)."""
    import json
    import sys

    import transformers.modeling_outputs  # noqa: F401 - registers the root type

    from cuvild.client.trees import container_spec, rebuild

    leaf = '{"type": null, "context": null, "children_spec": []}'
    deep = ('{"type": "builtins.tuple", "context": "null", "children_spec": [' * depth + leaf
            + "]}" * depth)
    spec = ('[1, {"type": "transformers.modeling_outputs.BaseModelOutput", "context": '
            + json.dumps(json.dumps(["last_hidden_state"])) + ', "children_spec": [' + deep
            + "]}]")
    outputs = {"last_hidden_state.0": torch.ones(1)}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300 + depth // 4)  # a deep caller's stack: Client.infer's
    try:
        got = rebuild(container_spec(spec), list(outputs), outputs)
    finally:
        sys.setrecursionlimit(limit)
    assert got is outputs or type(got).__name__ == "BaseModelOutput"


class Gated(torch.nn.Module):
    """A gate computed under `torch.no_grad()`, as PhiMoE's router is."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            gate = h.abs().amax(-1, keepdim=True) > 0.5
        return self.b(h * gate)


def test_a_model_with_a_no_grad_region_serves(env: Env) -> None:
    """torch.export writes `with torch.no_grad():` as a higher-order op over a submodule,
    which every load once handed to a part as an input it could not build ("input submod_1 of
    the part has no tensor metadata": PhiMoE); the loader puts its ops back inline
    (cuvild/intake/grad_regions.py)."""
    torch.manual_seed(0)
    model, x = Gated().eval(), torch.randn(3, 16)
    with Client(env.daemon.target) as client:
        try:
            client.load("gated", model, (x,), precision="fp32")
            got = client.infer("gated", x)["output0"]
        finally:
            client.unload("gated")
    torch.testing.assert_close(got, model(x).detach(), rtol=1e-5, atol=1e-5)
