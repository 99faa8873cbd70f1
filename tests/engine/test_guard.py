"""Never worse than the best single device, by measurement (cuvild/load/guard.py): a split
the cost model prices a little faster than one device is timed against that device's plan
at load, and the faster one is served; a language model's at its warm-up, on a generation
of each (cuvild/load/warmup.py `guarded`)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import lm_models
import torch
from engine_helpers import CLOSE, CORES, eager
from test_sequences import stepper

import cuvild
from cuvild.client.samples import MLP
from cuvild.core.arena import Arena
from cuvild.engine.engine import Engine
from cuvild.intake.summary import summarize
from cuvild.load import guard, warmup
from cuvild.run.generate import Sampling, generate
from partitioner.corrections import Corrections, prior
from partitioner.plan import Part, Plan, plan_model
from partitioner.profile import DeviceProfile

# A profile that misprices: the CPU 100x slow at matmuls, the emulated NPU slow at moving
# bytes and the link free, so the planner alternates matmuls (NPU) and activations (CPU)
# over 8 parts, predicted ~1.05x faster than all on the NPU. Both run torch eager on a core
# each: measured, the 7 hand-offs cost more than the split saves.
CPU = DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1], runtimes=["torch"],
                    peak_gflops={"fp32": 100.0}, mem_bw_gbs=100.0, link_bw_gbs=1000.0,
                    efficiency={"matmul": 0.01})
NPU = DeviceProfile(id="npu0", kind="npu", emulated=True, cores=CORES[-1:], runtimes=["torch"],
                    peak_gflops={"fp32": 1000.0}, mem_bw_gbs=10.0, link_bw_gbs=1000.0)


def test_a_mispriced_split_is_timed_and_the_faster_single_device_served(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = MLP(width=64, depth=4).eval(), torch.randn(2, 64)
    ep = cuvild.export(model, (x,))
    split = plan_model(ep, [CPU, NPU])
    single = plan_model(ep, [NPU])
    assert len(split.parts) > 2 and split.predicted_ms < single.predicted_ms  # the mistake
    assert guard.worth_timing(split, single)
    path = tmp_path / "mlp.pt2"
    torch.export.save(ep, path)
    arena = Arena(f"{os.getpid()}-guard")
    engine = Engine([CPU, NPU], tmp_path / "cache", arena, workers="thread")
    try:
        loaded = engine.prepare("mlp", "mlp", "1", path, summarize(ep)["inputs"])
        assert loaded is not None
        assert [(r.id, r.device) for r in loaded.routes] == [("p0", "npu0")]
        (said,) = [n for n in loaded.plan.notes if n.startswith("never worse")]
        assert "split vs" in said and "serving all on npu0" in said, said
        assert "mlp~one" not in engine.runner.served.models  # the second build is gone
        torch.testing.assert_close(engine.infer("mlp", (x,))[0], eager(model, x), **CLOSE)
    finally:
        engine.close()
        arena.close()


def test_a_lesson_that_moves_the_heaviest_part_is_timed_before_it_is_served(
        tmp_path: Path) -> None:
    """The profile alone puts the MLP on the NPU (10x the CPU's peak); a lesson another model
    taught says a call there costs 50 ms, so the learned plan moves it to the CPU. The load
    builds both, times them in turn and serves the faster; the plan gives both figures. Both
    plans' parts teach the cost model what they measured: the one not served too (else the
    lesson that misplaced it would misplace the next model again)."""
    cpu = DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1], runtimes=["torch"],
                        peak_gflops={"fp32": 100.0}, mem_bw_gbs=100.0, link_bw_gbs=1000.0)
    npu = DeviceProfile(id="npu0", kind="npu", emulated=True, cores=CORES[-1:],
                        runtimes=["torch"], peak_gflops={"fp32": 1000.0}, mem_bw_gbs=1000.0,
                        link_bw_gbs=1000.0)
    lesson = Corrections()
    lesson.observe("npu0", "torch", {}, 0, prior(npu), 50.0, "another model")
    path = tmp_path / "corrections" / "host.json"
    path.parent.mkdir()
    path.write_text(json.dumps(lesson.to_dict()))
    torch.manual_seed(0)
    model, x = MLP(width=64, depth=4).eval(), torch.randn(2, 64)
    ep = cuvild.export(model, (x,))
    assert guard.heaviest(plan_model(ep, [cpu, npu])) == "npu0"
    assert guard.heaviest(plan_model(ep, [cpu, npu], corrections=lesson)) == "cpu0"
    archive = tmp_path / "mlp.pt2"
    torch.export.save(ep, archive)
    arena = Arena(f"{os.getpid()}-lesson")
    engine = Engine([cpu, npu], tmp_path / "cache", arena, workers="thread",
                    corrections_path=path)
    try:
        loaded = engine.prepare("mlp", "mlp", "1", archive, summarize(ep)["inputs"])
        (said,) = [n for n in loaded.plan.notes if n.startswith("never worse")]
        found = re.search(r"([\d.]+) ms as learned \(cpu0\) vs ([\d.]+) ms of the profile "
                          r"alone \(npu0\)", said)
        assert found, said
        learned_ms, alone_ms = map(float, found.groups())
        faster = "cpu0" if learned_ms <= alone_ms else "npu0"
        assert {r.device for r in loaded.routes} == {faster}, said
        assert "mlp~one" not in engine.runner.served.models
        torch.testing.assert_close(engine.infer("mlp", (x,))[0], eager(model, x), **CLOSE)
        deadline = time.monotonic() + 30  # (lessons are learned on their own thread)
        while taught(engine, "mlp") != {"cpu0", "npu0"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert taught(engine, "mlp") == {"cpu0", "npu0"}
    finally:
        engine.close()
        arena.close()


def taught(engine: Engine, model: str) -> set[str]:
    """The devices whose corrections learned from a part of `model`."""
    learned = engine.builder.corrections.snapshot()
    return ({k.split("/")[0] for k, o in learned.overheads.items() if model in o.models}
            | {k.split("/")[0] for k in learned.entries})


def test_only_a_split_predicted_less_than_gain_faster_is_timed() -> None:
    def plan(ms: float, devices: list[str]) -> Plan:
        parts = [Part(f"p{i}", d, "", "fp32", [], ms) for i, d in enumerate(devices)]
        return Plan(parts=parts, cuts=[], predicted_ms=ms, peak_bytes={})

    one = plan(10.0, ["cpu0"])
    assert guard.worth_timing(plan(8.0, ["cpu0", "npu0"]), one)
    assert not guard.worth_timing(plan(10.0 / guard.GAIN, ["cpu0", "npu0"]), one)
    assert not guard.worth_timing(plan(9.0, ["npu0"]), one)  # no split: nothing to guard
    assert not guard.worth_timing(plan(9.0, ["cpu0", "npu0"]), None)


def test_a_language_models_split_is_timed_at_its_warm_up_and_the_faster_served(
        tmp_path: Path) -> None:
    """The mispriced profile above splits a tiny dynamic-length Llama into ~20 parts over the
    two devices, a whole generation predicted ~1.4x faster than all on the NPU. Its buckets
    are built at its warm-up, so the guard runs there: the plan all on one device is built
    and warmed up beside it, a generation of each timed in turn, the faster served under the
    model's key (the other dropped); the plan says both figures, and generation gives
    transformers' tokens."""
    hf = lm_models.lm("llama")
    ep = lm_models.export(hf, dynamic=True)
    split = plan_model(ep, [CPU, NPU])
    single = guard.single_plan(ep, [CPU, NPU], lambda program, one: plan_model(program, one))
    assert len({p.device for p in split.parts}) == 2 and guard.worth_timing(split, single)
    archive = tmp_path / "llama.pt2"
    torch.export.save(ep, archive)
    specs = summarize(ep)["inputs"]
    arena = Arena(f"{os.getpid()}-lm-guard")
    engine = Engine([CPU, NPU], tmp_path / "cache", arena, workers="thread")

    def load(key: str, plan: Plan, keep_record: bool) -> object:
        return engine.prepare(key, "llama", "1", archive, specs, plan=plan,
                              keep_record=keep_record)

    try:
        model = engine.prepare("llama", "llama", "1", archive, specs)
        assert model is not None and model.family is not None
        assert model.family.alternative is not None  # timed at its warm-up, not before
        assert len(model.parts_by_device) == 2
        done = warmup.warm_up(engine.builder, model, lambda _: None)
        assert not any("eager" in said for said in done), done  # (settled after)
        phases: list[str] = []
        served, compiled = warmup.guarded(engine.builder, model, load, phases.append)
        assert phases[0] == "timing the plan all on npu0 against the one split", phases
        # the decode step of the plan served alone is settled, once timed (the other's never)
        assert phases[-1] == "compiling its decode step", phases
        assert compiled and "compile_steps is off" in compiled[-1], compiled
        (said,) = [n for n in served.plan.notes if n.startswith(guard.LABEL)]
        found = re.search(r"measured a generation ([\d.]+) ms split vs ([\d.]+) ms all on "
                          r"npu0; serving (split|all on npu0)", said)
        assert found, said
        split_ms, alone_ms, kept = found.groups()
        assert kept == ("split" if float(split_ms) <= float(alone_ms) else "all on npu0")
        assert (len(served.parts_by_device) == 2) == (kept == "split"), said
        assert served.family is not None and served.family.alternative is None
        assert "llama~one" not in engine.runner.served.models
        assert engine.runner.served.models["llama"] is served
        assert len(engine.runner.sequences) == 0  # (the timed generations' sequences ended)
        live = engine.runner.sequences.begin("llama", "s", sorted(served.parts_by_device))
        prompt = [5, 17, 42, 99]
        got = list(generate(stepper(engine, served, live, warmup.last_logits(served)), prompt,
                            Sampling(max_tokens=6), lm_models.CONTEXT))
        engine.runner.sequences.end(live)
        assert got == lm_models.reference(hf, prompt, 6)
    finally:
        engine.close()
        arena.close()
