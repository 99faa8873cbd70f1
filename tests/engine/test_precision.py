"""Precision under an error budget, in the engine: the search, its fallbacks and what it
reports (cuvild/load/precision.py). One CPU worker; OpenVINO's int8 via NNCF."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

import cuvild
from cuvild.client.api import save_calibration
from cuvild.client.samples import ResNet18
from cuvild.core.arena import Arena
from cuvild.core.precision import PrecisionPolicy
from cuvild.engine.engine import Engine
from cuvild.intake.summary import summarize
from cuvild.workers.build import SEARCH_SAMPLES
from partitioner.profile import DeviceProfile
from runtimes import select
from runtimes.base import INT8_MIXED, set_error

CORES = sorted(os.sched_getaffinity(0))
INT8_RUNS = ("int8", INT8_MIXED)


def ran(loaded) -> dict[str, float]:
    """The part's precisions built on OpenVINO and their median ms, as last timed in turn
    (cuvild/workers/build.py retime): what the search chose by."""
    return {c["precision"]: c["median_ms"] for c in loaded.routes[0].built.candidates
            if c["runtime"] == "openvino" and c["status"] == "ok"}


def int8_ran_faster(loaded) -> bool:
    """Whether int8 (or its mix) ran faster than fp32 here. OpenVINO's int8 does on CPUs with
    VNNI or AMX, ~0.6x on both host kinds here, but not always: one CI run on an AMX Xeon
    timed it at 1.8 ms against fp32's 0.515 (twice in a row; a busy sibling thread's AMX use
    is one way), and a test that took VNNI for a speed failed there. So these tests hold the
    rule (the fastest precision within the budget serves), and say which way the host went."""
    times = ran(loaded)
    faster = min((times[p] for p in INT8_RUNS if p in times), default=float("inf")) < times["fp32"]
    if not faster:
        print(f"int8 ran no faster than fp32 on this host ({times}): fp32 serves, as it should")
    return faster


CPU = DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1], runtimes=["openvino", "torch"],
                    peak_gflops={"fp32": 100.0}, mem_bw_gbs=20.0, link_bw_gbs=10.0,
                    launch_us=5.0)

pytest.importorskip("nncf", reason="NNCF (int8 post-training quantization) is not installed")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A small ResNet-18 (int8 clearly faster: timing noise cannot flip the choice), its
    archive, calibration inputs and held-out inputs."""
    tmp = tmp_path_factory.mktemp("precision")
    torch.manual_seed(0)
    net = ResNet18(num_classes=10, width=16).eval()  # int8 runs it in ~0.6x the fp32 time
    x = torch.randn(1, 3, 64, 64)
    ep = cuvild.export(net, (x,))
    archive = tmp / "resnet.pt2"
    torch.export.save(ep, archive)
    calibration = tmp / "calibration.npz"
    save_calibration(calibration, ["x"], [torch.randn(1, 3, 64, 64) for _ in range(8)])
    held_out = [torch.randn(1, 3, 64, 64) for _ in range(6)]
    return net, archive, summarize(ep)["inputs"], calibration, held_out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One compile cache for the module: a build another test made is loaded, not redone."""
    return tmp_path_factory.mktemp("precision-cache")


@pytest.fixture
def engine(cache_dir):
    arena = Arena(f"{os.getpid()}-prec")
    eng = Engine([CPU], cache_dir, arena)
    yield eng
    eng.close()
    arena.close()


def load(engine, model, name, policy):
    net, archive, specs, _, _ = model
    return engine.prepare(name, name, "1", archive, specs, policy=policy)


def held_out_error(engine, model, name):
    net, *_, held = model
    with torch.no_grad():  # the budget's metric: over the set (runtimes/base.py set_error)
        return set_error([engine.infer(name, (x,)) for x in held], [[net(x)] for x in held])


def test_a_loose_budget_runs_int8_and_stays_within_it_on_held_out_inputs(engine, model):
    calibration = str(model[3])
    loaded = load(engine, model, "loose", PrecisionPolicy("auto", 0.25, calibration, "t1"))
    (part,) = loaded.plan.parts
    int8 = next(c for c in loaded.routes[0].built.candidates
                if (c["precision"], c["runtime"]) == ("int8", "openvino"))
    assert int8["status"] == "ok" and 0 < int8["rel_error"] <= 0.25, int8  # built, within it
    if int8_ran_faster(loaded):
        # int8, or int8 with a few groups NNCF kept fp32 (INT8_MIXED): where both are built
        # they run within noise of each other, and timed in turn either may be the faster
        assert part.precision in INT8_RUNS and part.runtime == "openvino", loaded.plan.notes
        assert 0 < part.error <= 0.25
        assert any(f"runs {part.precision} on openvino" in n for n in loaded.accuracy.notes), \
            loaded.accuracy.notes
    else:
        assert part.precision == "fp32", loaded.plan.notes
        assert any(n.startswith("p0 stays fp32: no lower precision ran faster")
                   for n in loaded.accuracy.notes), loaded.accuracy.notes
    acc = loaded.accuracy
    assert acc.policy == "auto" and acc.calibrated and acc.inputs == 8
    assert acc.chosen.error <= 0.25 and acc.fp32.error < 1e-4
    assert acc.chosen.top1 is not None and acc.fp32.top1 == 1.0
    assert held_out_error(engine, model, "loose") <= 0.25


def test_a_budget_of_1e_2_serves_within_it_on_held_out_inputs(model, cache_dir, monkeypatch):
    """int8 alone is ~3.7e-2 off here: the search builds int8+fp32 too, NNCF's accuracy
    control putting the ops that cost the most back to fp32 until the part holds half the
    budget; the model serves within the budget on held-out inputs, whichever variant ran
    fastest (timing decides, so either may). On any CPU: a build slower than fp32 is
    measured all the same here (runtimes/select.py SLOWER; the worker a thread of this
    process, so that it sees it), where before this test skipped when int8 once ran slower
    than fp32 on a busy host (0.5 vs 0.3 ms); and the mix is built whatever int8 alone
    measured against fp32 (cuvild/workers/build.py `_no_faster`)."""
    from cuvild.workers import build

    monkeypatch.setattr(select, "SLOWER", float("inf"))
    monkeypatch.setattr(build, "_no_faster", lambda *_: "")
    arena = Arena(f"{os.getpid()}-tight")
    engine = Engine([CPU], cache_dir, arena, workers="thread")
    try:
        tight(engine, model)
    finally:
        engine.close()
        arena.close()


def tight(engine, model):
    calibration = str(model[3])
    loaded = load(engine, model, "tight", PrecisionPolicy("auto", 1e-2, calibration, "t1"))
    tried = {c["precision"]: c for c in loaded.routes[0].built.candidates
             if c["runtime"] == "openvino"}
    assert tried["int8"]["rel_error"] > 1e-2, tried["int8"]  # (else nothing to back off)
    assert tried["int8+fp32"]["status"] == "ok", tried["int8+fp32"]
    assert tried["int8+fp32"]["rel_error"] <= 1e-2  # (it aims at half, on half of them)
    # the plan says which ops NNCF kept fp32
    assert re.match(r"int8 except \d+ of \d+ matmuls/convolutions kept fp32",
                    tried["int8+fp32"]["reason"]), tried["int8+fp32"]
    assert loaded.accuracy.chosen.error <= 1e-2
    assert held_out_error(engine, model, "tight") <= 1e-2


def test_a_budget_of_1e_6_falls_back_to_fp32_and_says_why(engine, model):
    calibration = str(model[3])
    loaded = load(engine, model, "exact", PrecisionPolicy("auto", 1e-6, calibration, "t1"))
    (part,) = loaded.plan.parts
    assert part.precision == "fp32" and loaded.accuracy.chosen.error < 1e-6
    # why: int8 measured and backed off end to end, already over the part's bound, or (on a
    # CPU whose int8 is no faster) not kept for speed
    why = [n for n in loaded.accuracy.notes if n.startswith(("p0 int8 refused", "p0 stays"))]
    assert why and any(s in why[0] for s in ("> 1e-06", "int8 error", "not faster")), \
        loaded.accuracy.notes
    assert [v for v in loaded.routes[0].variants] == ["fp32"]  # no int8 build is kept


def test_int8_is_tried_only_with_calibration_inputs(engine, model):
    loaded = load(engine, model, "uncalibrated", PrecisionPolicy("auto", 0.25))
    assert loaded.plan.parts[0].precision == "fp32"
    assert not [c for c in loaded.routes[0].built.candidates if c["precision"] == "int8"]
    assert "int8 not tried: no calibration inputs were given" in loaded.accuracy.notes
    assert not loaded.accuracy.calibrated and loaded.accuracy.inputs == SEARCH_SAMPLES


def test_fp32_models_are_checked_end_to_end_too(engine, model):
    loaded = load(engine, model, "plain", None)
    acc = loaded.accuracy
    assert acc.policy == "fp32" and acc.max_error is None and acc.chosen.error < 1e-4
    assert loaded.plan.parts[0].error < 1e-4 and acc.eager_ms > 0


def test_a_restart_reuses_the_decision_without_searching(engine, model):
    calibration = str(model[3])
    policy = PrecisionPolicy("auto", 0.25, calibration, "t1")
    first = load(engine, model, "again", policy)
    again = Engine([CPU], engine.builder.cache_dir, engine.arena)
    try:
        second = again.prepare("again", "again", "1", model[1], model[2], policy=policy)
    finally:
        again.close()
    chosen = first.plan.parts[0].precision
    assert chosen in (INT8_RUNS if int8_ran_faster(first) else ("fp32",)), first.plan.notes
    assert second.plan.parts[0].precision == chosen
    assert [v for v in second.routes[0].variants] == [chosen]  # built only what was chosen
    assert second.accuracy.fp32.error == first.accuracy.fp32.error  # the recorded report


def test_the_precisions_of_a_search_are_timed_again_in_turn():
    """Each precision was timed right after its own build: a burst of other work on the host
    during int8's made fp32 look faster (0.433 vs 0.314 ms). The build times them again in
    turn, for the search and for the reports."""
    import time
    from dataclasses import asdict

    from cuvild.workers.build import retime
    from runtimes.select import BuiltPart, Candidate

    class Sleeps:
        def __init__(self, s):
            self.s = s

        def run(self, inputs):
            time.sleep(self.s)

    built, tried = {}, []
    for precision, runtime, seconds, timed_at_build in (("fp32", "openvino", 0.004, 3.0),
                                                        ("int8", "openvino", 0.001, 9.0)):
        c = Candidate(runtime, "ok", median_ms=timed_at_build, precision=precision)
        built[precision] = BuiltPart(runtime, Sleeps(seconds), [c])
        tried.append(asdict(c))
    retime(built, tried, [torch.zeros(1)])
    fp32, int8 = (built[p].candidates[0].median_ms for p in ("fp32", "int8"))
    assert 0.9 < int8 < 3.5 < fp32 < 9.0  # (sleep's own overshoot allowed)
    assert [c["median_ms"] for c in tried] == [fp32, int8]


def test_calibration_file_layout(tmp_path):
    path = tmp_path / "c.npz"
    save_calibration(path, ["a", "b"], [(torch.ones(2), np.zeros(3)), (torch.zeros(2),
                                                                       np.ones(3))])
    with np.load(path) as data:
        assert data["a"].shape == (2, 2) and data["b"].shape == (2, 3)
    with pytest.raises(ValueError, match="2 input"):
        save_calibration(path, ["a", "b"], [torch.ones(2)])


def test_why_a_lower_precision_was_not_kept_gives_both_figures_and_its_clock():
    """The demo once said "int8 ran 0.01 ms on onnxruntime, not faster" of a part whose fp32
    ran 0.013 ms: only the loser, rounded. Both figures now, to the digit that tells them
    apart, with the clock they come from; a mix not tried on purpose is said to be so, not to
    have failed to build (issue 48)."""
    from types import SimpleNamespace

    from cuvild.load.precision import _why_not

    def variant(ms: float, runtime: str) -> SimpleNamespace:
        return SimpleNamespace(median_ms=ms, runtime=runtime)

    route = SimpleNamespace(precision="fp32", variants={
        "fp32": variant(0.0131, "openvino"), "int8": variant(0.0144, "onnxruntime")},
        built=SimpleNamespace(candidates=[
            {"precision": "fp32", "runtime": "openvino", "status": "ok", "reason": ""},
            {"precision": "int8", "runtime": "onnxruntime", "status": "ok", "reason": ""},
            {"precision": "int8+fp32", "runtime": "mixed", "status": "skipped",
             "reason": "int8 holds the budget already"},
            # slower than fp32 at build, its error not measured (runtimes/select.py SLOWER)
            {"precision": "bf16", "runtime": "openvino", "status": "skipped", "median_ms": 0.05,
             "reason": "0.05 ms a run against 0.0131 ms at fp32: not faster, its error not "
                       "measured"},
            {"precision": "bf16", "runtime": "llvm-cpu", "status": "unavailable",
             "reason": "not installed"},
            {"precision": "bf16+fp32", "runtime": "mixed", "status": "skipped",
             "reason": "not built: bf16 alone ran 0.05 ms at best against 0.0131 ms at fp32; "
                       "a mix of bf16 and fp32 is no faster"}]))
    why = _why_not(route)
    assert "int8 ran 0.0144 ms on onnxruntime vs 0.0131 ms at fp32 on openvino" in why, why
    assert "runtime call alone" in why
    assert "int8+fp32 not tried: int8 holds the budget already" in why
    assert "bf16 ran 0.05 ms on openvino vs 0.0131 ms at fp32 on openvino, not faster" in why
    assert "did not build" not in why
    # the mix's own reason repeats bf16's figures, said just before: the demo's note said each
    # twice for int8 and bf16 ("bf16 alone ran 0.0982 ms at best against 0.0226 ms at fp32")
    assert "bf16+fp32 not tried: bf16 alone was no faster" in why and why.count("0.05 ms") == 1
