"""runtimes/compiled_step.py: a language model's decode step compiled by inductor from the first
step of a sequence on (in a thread, the steps eager meanwhile), serving only where it holds the
eager step's error and is faster; what it serves gives the eager step's logits step after
step, in two sequences, and to the end of the context with nothing compiled again; a
prompt's chunk, a
part without state, or the setting off compile nothing; a failed compile leaves it eager."""

from __future__ import annotations

import logging

import lm_models
import pytest
import torch
from test_torch_lowered import one_part
from torch._dynamo.utils import counters

from partitioner.profile import DeviceProfile
from runtimes import compiled_step
from runtimes.attention import KEYS
from runtimes.base import CompileSpec
from runtimes.torch_eager import TorchRuntime, drop_scope, remember_initial

CPU = DeviceProfile(id="cpu0", kind="cpu", cores=[0])
TOKENS = [[5, 9, 17, 3], [42, 7, 1, 99]]


@pytest.fixture(scope="module")
def part() -> torch.fx.GraphModule:
    module = one_part(lm_models.export(lm_models.lm("llama")))
    remember_initial(module)
    return module


def step(position: int, token: int) -> list[torch.Tensor]:
    return [torch.tensor([position]), torch.tensor([[token]])]


def build(part: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch, on: str = "1"):  # noqa: ANN201
    monkeypatch.setenv(compiled_step.ENV, on)
    return TorchRuntime().compile(part, CompileSpec(CPU, "fp32", step(0, 1)))


def test_the_decode_step_compiles_at_a_sequences_first_step_and_matches_eager(
        part: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(compiled_step, "FASTER", 1e9)  # (served whatever the timing here)
    tiered, eager = build(part, monkeypatch), build(part, monkeypatch, on="0")
    assert tiered.tier_up is not None and eager.tier_up is None
    # where it stands, as `cuvilctl partition` says it (cuvild/serve/control.py with_steps)
    assert tiered.step == compiled_step.WAITING and eager.step == compiled_step.OFF
    eager.run(step(0, 1))  # (no sequence: runs eagerly, compiles nothing)
    assert tiered.run(step(0, 1)) and tiered.tier_up is not None
    aside = []  # per run, the seconds it spent timing its compiled form (not the step's)
    with caplog.at_level(logging.INFO, logger="runtimes.compiled_step"):
        try:
            for t in range(len(TOKENS[0])):
                for k, tokens in enumerate(TOKENS):
                    tiered.use(k + 1, "tiered")
                    eager.use(k + 1, "eager")
                    (got,), (want,) = tiered.run(step(t, tokens[t])), eager.run(step(t, tokens[t]))
                    aside.append(tiered.aside())
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                    if tiered.compiling is not None and t == 0:  # compiling since step 0
                        tiered.compiling.join(300)
        finally:
            drop_scope("tiered")
            drop_scope("eager")
    assert tiered.tier_up is None
    assert any("serves compiled" in r.getMessage() for r in caplog.records), caplog.text
    # the one run that timed it says so, for its worker to leave out of the step's time
    # (cuvild/workers/sessions.py run_into); read once
    assert sum(a > 0 for a in aside) == 1 and eager.aside() == 0.0, aside
    assert tiered._call is not tiered._plain  # noqa: SLF001 - what single steps run now
    assert tiered.step.startswith("decode step compiled by inductor in ") and \
        " ms a step" in tiered.step, tiered.step
    # it attends the keys written so far, their count one dynamic size: a sequence's later
    # positions run what was compiled, nothing compiled again (runtimes/attention.py)
    assert tiered.module.meta[KEYS] == ("position", 0, lm_models.CONTEXT)
    graphs = counters["stats"]["unique_graphs"]
    try:
        for position, token in enumerate([5, 9, 17, 3, 8, 13, 21, 34, 55, 1, 2, 4] * 5):
            tiered.use(1, "long")
            eager.use(1, "long-eager")
            (got,), (want,) = tiered.run(step(position, token)), eager.run(step(position, token))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        drop_scope("long")
        drop_scope("long-eager")
    assert counters["stats"]["unique_graphs"] == graphs
    # a compiled step that fails (a case its check did not meet): that step again eagerly,
    # and eager from then on
    monkeypatch.setattr(tiered, "_call", lambda *inputs: 1 / 0)
    tiered.use(1, "again")
    eager.use(1, "again-eager")
    (got,), (want,) = tiered.run(step(0, 5)), eager.run(step(0, 5))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert tiered._call is tiered._plain  # noqa: SLF001
    assert tiered.step.startswith("decode step eager: its compiled form failed while serving")
    drop_scope("again")
    drop_scope("again-eager")


def test_only_a_stateful_one_row_step_with_the_setting_on_is_compiled(
        part: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled_step.ENV, "1")
    assert compiled_step.wanted(["cache"], {"linear": 1})
    assert not compiled_step.wanted(["cache"], {"linear": 1, "linear_1": 8})  # a prompt chunk
    assert not compiled_step.wanted([], {"linear": 1})  # no state: no sequence
    monkeypatch.setenv(compiled_step.ENV, "0")
    assert not compiled_step.wanted(["cache"], {"linear": 1})
    chunk = TorchRuntime().compile(part, CompileSpec(CPU, "fp32", [torch.arange(3),
                                                                   torch.tensor([[1, 2, 3]])]))
    assert chunk.tier_up is None


def test_a_failed_compile_leaves_the_step_eager(
        part: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler")

    exe = build(part, monkeypatch)
    monkeypatch.setattr(torch, "compile", refuse)
    with caplog.at_level(logging.INFO, logger="runtimes.compiled_step"):
        exe.use(1, "refused")
        (got,) = exe.run(step(0, 5))
        exe.compiling.join(60)
        exe.use(1, "refused")
        exe.run(step(1, 6))
    drop_scope("refused")
    assert exe._call is exe._plain and torch.isfinite(got).all()  # noqa: SLF001
    assert "stays eager: inductor failed: RuntimeError: no C++ compiler" in caplog.text


def test_a_runs_time_leaves_out_what_the_part_spent_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's run time of a part (what the cost model and `cuvilctl partition` read) is
    the step's: the seconds its executable says it spent timing its compiled form are left
    out (on the 200M Llama the run that timed it measured 398 ms for a 33 ms step)."""
    from cuvild.workers import sessions

    class Timing:
        def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            return [inputs[0] + 1]

        def aside(self) -> float:
            return 0.375

    from types import SimpleNamespace

    clock = iter([10.0, 10.5])  # the run's start and end, as perf_counter reads them
    monkeypatch.setattr(sessions, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    out = torch.zeros(2)
    assert sessions.run_into(Timing(), [torch.ones(2)], [out]) == pytest.approx(0.125)
    assert out.tolist() == [2.0, 2.0]
