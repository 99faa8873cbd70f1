"""Several sequences' steps in one run (runtimes/torch_eager.py `run_batch`, the pool of
runtimes/state.py): a language model's decode steps of sequences at different positions
give what each gives alone (a step's weights packed for one row, the batch's for several),
whichever rows they hold; rows are reused and the pool goes with its last sequence; a step
below fp32 batches on its fp32 twin where that is faster (what the precision search checked
is one row's kernel at bf16 and fp16); the worker groups doorbells of one such part
(cuvild/workers/sessions.py `batches`)."""

from __future__ import annotations

import logging
import os

import lm_models
import pytest
import torch
from test_torch_lowered import one_part

from cuvild.workers.sessions import batches
from partitioner.profile import DeviceProfile
from runtimes import state, torch_eager
from runtimes.base import CompileSpec
from runtimes.torch_eager import TorchExecutable, TorchRuntime, prepared

CPU = DeviceProfile(id="cpu0", kind="cpu", cores=[0], features=["f16c"])
TOKENS = [[5, 9, 17, 3, 8], [42, 7, 1, 99, 13], [11, 12, 13, 14, 15], [60, 50, 40, 30, 20]]


@pytest.fixture(scope="module")
def part() -> torch.fx.GraphModule:
    return one_part(lm_models.export(lm_models.lm("llama")))


def step(position: int, token: int) -> list[torch.Tensor]:
    return [torch.tensor([position]), torch.tensor([[token]])]


def test_sequences_stepping_together_get_what_each_gets_alone(
        part: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_eager, "RECENT_S", 3600.0)  # (every step counts as recent)
    # built for a decode step's inputs: its linears' weights packed for one row, packed
    # again for several where steps run together
    together = TorchExecutable(prepared(part, None, step(0, 1)), None)
    alone = TorchExecutable(part, None)
    assert together.batches and together.module.meta[torch_eager.ONE_ROW]
    slots = [11, 12, 13, 14]
    try:
        # sequence 14 starts two steps late: the batch holds sequences at different positions
        for t in range(len(TOKENS[0])):
            stepping = [k for k in range(4) if k < 3 or t >= 2]
            got = together.run_batch([slots[k] for k in stepping],
                                     [step(t - 2 * (k == 3), TOKENS[k][t - 2 * (k == 3)])
                                      for k in stepping], "together")
            for k, outs in zip(stepping, got, strict=True):
                alone.use(slots[k], "alone")
                (want,) = alone.run(step(t - 2 * (k == 3), TOKENS[k][t - 2 * (k == 3)]))
                torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)
        assert together.together.runs >= len(TOKENS[0])  # (one run a step: rows 0..3)
        # a sequence in the middle ends: the others' rows are 0, 2, 3 (runs 0 and 2..3)
        state.drop_sequence("together", 12)
        state.drop_sequence("alone", 12)
        runs_before = together.together.runs
        kept = [11, 13, 14]
        got = together.run_batch(kept, [step(5, 1), step(5, 2), step(3, 3)], "together")
        assert together.together.runs == runs_before + 1  # rows 2..3 shared a run
        runs, steps = together.together.runs, together.together.steps  # as `cuvilctl
        # partition` says it
        assert f"{steps} steps of several sequences in {runs} runs " in together.describe()
        for slot, ins, outs in zip(kept, [step(5, 1), step(5, 2), step(3, 3)], got,
                                   strict=True):
            alone.use(slot, "alone")
            torch.testing.assert_close(outs[0], alone.run(ins)[0], rtol=1e-5, atol=1e-5)
        # a new sequence takes the free row, from the initial state
        (new,) = together.run_batch([15], [step(0, 5)], "together")
        alone.use(16, "alone")
        torch.testing.assert_close(new[0], alone.run(step(0, 5))[0], rtol=1e-5, atol=1e-5)
        assert state.holds("together", 15) and together.expected() == 4
    finally:
        state.drop_scope("together")
        state.drop_scope("alone")
    assert not state.holds("together", 11) and together.expected() == 0


def test_the_pool_grows_keeps_its_rows_and_goes_with_its_last_sequence() -> None:
    initial = {"cache": torch.zeros(2, 3)}
    held = state.pool("grows", initial)
    rows = [held.row(slot) for slot in (1, 2, 3)]
    assert rows == [0, 1, 2] and held.tensors["cache"].shape[0] == 4
    held.views(1)["cache"].fill_(7.0)
    held.row(4), held.row(5)  # grown again: rows kept
    assert bool((held.views(1)["cache"] == 7).all()) and held.tensors["cache"].shape[0] == 8
    for slot in (1, 2, 3, 4, 5):
        state.drop_sequence("grows", slot)
    assert state.pool("grows", initial) is not held  # (a new one: the last went)
    state.drop_scope("grows")
    assert state.runs([5, 0, 3, 1]) == [(0, 2), (3, 1), (5, 1)]


def test_a_sequence_copied_from_another_starts_from_its_state() -> None:
    """state.copy_sequence (n choices of one prompt): the new slot's row a copy of the
    source's, the pool grown for it where full, each then its own."""
    held = state.pool("copied", {"cache": torch.zeros(2, 3)})
    held.views(held.row(1))["cache"].fill_(5.0)
    state.copy_sequence("copied", 1, 2)  # (the pool grows from 1 row to 2 for it)
    assert bool((held.views(held.row(2))["cache"] == 5).all())
    held.views(held.row(2))["cache"].fill_(9.0)
    assert bool((held.views(held.row(1))["cache"] == 5).all())  # (a copy, not a view)
    state.copy_sequence("other-model", 1, 3)  # (a model with no such sequence here: nothing)
    assert 3 not in held.rows
    state.drop_scope("copied")


def test_a_dynamic_length_part_batches_its_decode_steps() -> None:
    """A part exported with a dynamic length (a bucket of it runs one token a step) reads its
    sizes under vmap as one sequence's step sees them."""
    dynamic = one_part(lm_models.export(lm_models.lm("llama"), dynamic=True))
    together, alone = TorchExecutable(prepared(dynamic, None), None), TorchExecutable(dynamic, None)
    try:
        for t in range(3):
            steps = [[torch.tensor([[TOKENS[k][t]]]), torch.tensor([t])] for k in range(2)]
            got = together.run_batch([1, 2], steps, "dynamic-together")
            for k in range(2):
                alone.use(k + 1, "dynamic-alone")
                torch.testing.assert_close(got[k][0], alone.run(steps[k])[0], rtol=1e-5,
                                           atol=1e-5)
        assert together.together.runs == 3
    finally:
        state.drop_scope("dynamic-together")
        state.drop_scope("dynamic-alone")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_below_fp32_sequences_step_together_on_the_fp32_twin_where_it_pays(
        part: torch.fx.GraphModule, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step below fp32 (as the runtime builds it): several sequences' steps run on
    its fp32 twin (what the budget is measured against: they give what fp32 gives alone)
    while that is faster than their steps alone, and one by one (at the part's precision)
    once it is not; the twin is made at the first batch. Times are set here: which one a
    host measures faster is the host's (runtimes/together.py)."""
    monkeypatch.setattr(torch_eager, "RECENT_S", 3600.0)
    exe = TorchRuntime().compile(part, CompileSpec(CPU, precision, step(0, 1)))
    fp32, low = TorchExecutable(prepared(part, None, step(0, 1)), None), \
        TorchExecutable(prepared(part, torch_eager.DTYPES[precision], step(0, 1)),
                        torch_eager.DTYPES[precision])
    assert exe.batches and exe.together.possible and exe.together._twin is None  # noqa: SLF001
    # the reference: each step as the part runs it, alone at its precision or together at
    # fp32, on one cache (executables of one scope share their sequences' state)
    slots, scope, ref = [1, 2, 3], f"twin-{precision}", f"twin-{precision}-ref"

    def reference(by: TorchExecutable, t: int) -> list[torch.Tensor]:
        outs = []
        for k, slot in enumerate(slots):
            by.use(slot, ref)
            outs += by.run(step(t, TOKENS[k][t]))
        return outs

    try:
        for k, slot in enumerate(slots):  # each sequence's first step alone: timed
            exe.use(slot, scope)
            exe.run(step(0, TOKENS[k][0]))
        reference(low, 0)
        exe.together._alone = 1.0  # noqa: SLF001 - a step alone "takes" 1 s: together pays
        for t in (1, 2, 3):  # (the first run of 3 untimed, the next two timed)
            got = exe.run_batch(slots, [step(t, TOKENS[k][t]) for k in range(3)], scope)
            for outs, want in zip(got, reference(fp32, t), strict=True):
                torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)
        assert exe.together.runs == 3 and exe.together._twin is not None  # noqa: SLF001
        assert "3 together" in exe.describe() and f"beside its {precision}" in exe.describe()
        exe.together._alone = 1e-9  # noqa: SLF001 - now a step alone is the faster
        assert "3 one by one" in exe.describe()
        got = exe.run_batch(slots, [step(4, TOKENS[k][4]) for k in range(3)], scope)
        assert exe.together.runs == 3  # (no batch ran)
        for outs, want in zip(got, reference(low, 4), strict=True):  # at its precision
            torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)
    finally:
        state.drop_scope(scope)
        state.drop_scope(ref)


def test_what_pays_is_measured_and_tried_again(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    from runtimes import together
    from runtimes.together import RETRY, Together

    assert Together(True, None, "fp32").pays(2)  # fp32: always
    assert not Together(False, None, "fp16").possible  # no twin: alone
    t = Together(False, lambda: "twin", "fp16")
    assert not t.pays(4)  # a step alone not timed yet
    t.alone(0.016)
    assert t.pays(4) and t.module("own") == "twin"
    t.ran(4, 1.0)  # the first run of 4: untimed (oneDNN makes its kernels)
    t.ran(4, 0.041)  # 41 ms against 4 x 16: pays
    assert t.pays(4)
    t.ran(2, 0.05)
    t.ran(2, 0.05)  # 50 ms against 2 x 16: does not
    assert [t.pays(2) for _ in range(RETRY)].count(True) == 1  # tried again, once in RETRY
    assert t.worth_waiting(4) and not t.worth_waiting(2) and t.worth_waiting(8)  # (untried)
    t.ran(2, 0.02)  # the retry measured faster: its time now, not averaged in
    assert t.pays(2) and "2 together (20.0 ms against 2 x 16.0)" in t.describe()
    # a twin the memory left cannot hold twice over is not made: the steps go one by one
    short = Together(False, lambda: pytest.fail("made"), "fp16", twin_bytes=8 << 30)
    short.alone(0.016)
    monkeypatch.setattr(together, "available", lambda: 12 << 30)
    with caplog.at_level(logging.WARNING, logger=together.__name__):  # whatever root's level
        assert not short.pays(4) and not short.possible
    assert "its fp32 twin would take 8.6 GB, 12.9 GB of memory are left" in caplog.text


def test_the_memory_left_is_read() -> None:
    from runtimes.together import available

    left = available()
    assert left is None or 0 < left <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_the_worker_groups_the_doorbells_of_a_part_that_batches() -> None:
    class Part:
        def __init__(self, batches: bool) -> None:
            self.batches = batches

    lm, other = Part(True), Part(False)
    rung = [(3, (1, lm, 0.0)), (4, (2, other, 0.0)), (5, (3, lm, 0.0)), (6, (4, other, 0.0))]
    assert [fds for fds, _ in batches(rung)] == [[3, 5], [4], [6]]


@pytest.mark.skipif(not torch_eager.packs(None), reason="oneDNN's packed linear is not on this "
                    "host (x86-64 with mkldnn only: runtimes/torch_eager.py packs)")
def test_the_packed_linear_takes_every_sequences_rows_to_one_product() -> None:
    """runtimes/packed_linear.py's batching rule: under vmap (its batch at any dimension), the rows
    of each sequence give what one product of them gives; a weight that differs by sequence
    is refused."""
    from runtimes import packed_linear

    op, gen = packed_linear.op(), torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    packed = torch_eager._REORDER(weight, torch_eager.PACK_ROWS)  # noqa: SLF001
    rows = torch.randn(4, 1, 16, generator=gen)
    want = torch.nn.functional.linear(rows, weight, bias)
    with torch.inference_mode():
        got = torch.func.vmap(lambda x: op(x, packed, bias))(rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the batch at another dimension than the first
        got = torch.func.vmap(lambda x: op(x, packed, bias), in_dims=1)(rows.movedim(0, 1))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with pytest.raises(NotImplementedError, match="same for every sequence"):
            torch.func.vmap(lambda b: op(rows[0], packed, b))(bias.expand(2, 24))
