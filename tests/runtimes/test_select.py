"""`auto`: candidates checked against eager, the fastest kept, and a cached reload compiles
nothing (asserted on the cache, not on time)."""

from __future__ import annotations

import pytest
import torch

import cuvild
from cuvild.client.samples import MLP
from partitioner.profile import DeviceProfile
from partitioner.split import split_program
from runtimes import registry
from runtimes.base import CompileError
from runtimes.cache import CompileCache
from runtimes.select import build_part

CPU = DeviceProfile(id="cpu0", kind="cpu", cores=[0], runtimes=["openvino", "torch"])


def part_and_samples():
    torch.manual_seed(0)
    model, x = MLP(width=64, depth=2).eval(), torch.randn(2, 64)
    ep = cuvild.export(model, (x,))
    split = split_program(ep, {n.name: "p0" for n in ep.graph.nodes if n.op == "call_function"})
    part = split.parts[0]
    calls = []

    def samples():
        calls.append(1)
        with torch.no_grad():
            return [[x]], [[model(x)]]

    return part.module, samples, calls


def test_auto_picks_a_correct_candidate_and_reloads_without_compiling(tmp_path, monkeypatch):
    module, samples, calls = part_and_samples()
    cache = CompileCache(tmp_path)
    first = build_part(module, CPU, "fp32", samples, cache)
    assert {c.runtime for c in first.candidates} == {"openvino", "torch"}
    assert all(c.status == "ok" and c.rel_error <= 1e-4 for c in first.candidates)
    assert first.runtime in ("openvino", "torch") and not first.from_cache
    assert len(list((tmp_path / "choices").glob("*.json"))) == 1  # the choice is recorded

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled on a cached reload")

    ov = registry.runtime_class("openvino")
    monkeypatch.setattr(ov, "compile", no_compile)
    again = build_part(module, CPU, "fp32", samples, cache)
    assert again.from_cache and again.compiled == [] and again.runtime == first.runtime
    assert len(calls) == 1  # sample data was made once, for the first build only


def test_no_runtime_for_the_device_is_a_clear_error(tmp_path):
    module, samples, _ = part_and_samples()
    gpu = DeviceProfile(id="gpu0", kind="gpu", runtimes=["triton"])
    with pytest.raises(CompileError, match="no runtime could build this part for gpu0"):
        build_part(module, gpu, "fp32", samples, CompileCache(tmp_path))
