"""The prefix cache (cuvild/run/prefixes.py) on an engine's own sequences and workers: a kept
sequence gives a later prompt the tokens it shares with it, whole (the sequence itself) or cut
back (a copy, its written counts set to the cut), and the prompt then generates as
transformers' own `generate` on the whole prompt; kept sequences stay within their budget,
give way at the sequences' cap, and one that ended is never given."""

from __future__ import annotations

from pathlib import Path

import lm_models
import pytest
from test_sequences import served, stepper

from cuvild.core.loaded import LoadedModel
from cuvild.engine.engine import Engine
from cuvild.run.generate import Sampling, generate
from cuvild.run.prefixes import LEAST
from cuvild.run.sequences import Live, SequenceError

FIRST = list(range(3, 23))  # 20 tokens: over LEAST


def run(engine: Engine, model: LoadedModel, live: Live, prompt: list[int], held: int = 0,
        tokens: int = 6) -> list[int]:
    return list(generate(stepper(engine, model, live), prompt, Sampling(max_tokens=tokens),
                         lm_models.CONTEXT, held=held))


def begin(engine: Engine, model: LoadedModel, name: str) -> Live:
    return engine.runner.sequences.begin(model.key, name, ["cpu0"])


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi", "gptneox"])
def test_a_kept_sequence_gives_later_prompts_its_tokens_as_transformers(
        tmp_path: Path, family: str) -> None:
    """A chat's next turn takes the kept sequence itself; another question after the same
    first 18 tokens takes a copy cut back to them (the kept one stays). Both generate what
    transformers does on their whole prompt: the cut's stale positions are written over,
    never read. Four families: rotary, learned positions, partial rotary, parallel
    residual."""
    engine, arena, model, hf = served(tmp_path, family)
    prefixes = engine.runner.prefixes
    try:
        assert model.state is not None and model.state.croppable
        live = begin(engine, model, "a")
        out = run(engine, model, live, FIRST)
        assert prefixes.keep(model, live, FIRST + out[:-1])
        other = FIRST[:18] + [90, 91, 92]
        cut = prefixes.take(model, other, lambda: begin(engine, model, "b"))
        assert cut is not None and cut[0] is not live and cut[1] == 18 and len(prefixes) == 1
        assert run(engine, model, cut[0], other, held=18) == lm_models.reference(hf, other, 6)
        engine.runner.sequences.end(cut[0])
        turn = FIRST + out + [7, 8]
        whole = prefixes.take(model, turn, lambda: begin(engine, model, "c"))
        assert whole == (live, len(FIRST) + 5) and len(prefixes) == 0
        assert run(engine, model, live, turn, held=whole[1]) == lm_models.reference(hf, turn, 6)
        engine.runner.sequences.end(live)
        assert arena.in_use() == 0
    finally:
        engine.close()
        arena.close()


def test_kept_sequences_stay_within_budget_and_cap_and_an_ended_one_is_never_given(
        tmp_path: Path) -> None:
    """Fewer than LEAST shared tokens are a miss; over the budget the least recently used
    ends; at the sequences' cap a kept one ends for a new sequence; one that ended (idle,
    unloaded) is a miss, and a step on it is refused, not run on a fresh state; a model
    whose state cannot be cut back gives whole sequences only."""
    engine, arena, model, hf = served(tmp_path, "llama", max_sequences=3)
    runner = engine.runner
    assert model.state is not None
    runner.prefixes.budget = 2 * model.state.nbytes
    try:
        kept = []
        for i in range(3):
            live = begin(engine, model, f"k{i}")
            prompt = [i + 1, *FIRST]
            out = run(engine, model, live, prompt, tokens=2)
            assert runner.prefixes.keep(model, live, prompt + out[:1])
            kept.append(live)
        assert len(runner.prefixes) == 2 and not runner.sequences.alive(kept[0])
        assert not runner.prefixes.keep(model, begin(engine, model, "short"), FIRST[:LEAST - 1])
        assert runner.prefixes.take(model, [2, *FIRST[:LEAST - 2], 99], lambda: begin(
            engine, model, "x")) is None  # (15 shared)
        begin(engine, model, "new")  # at the cap (3): the least recently used kept one ends
        assert len(runner.sequences) == 3 and not runner.sequences.alive(kept[1])
        runner.sequences.end(kept[2], "ended after 300 s idle")
        assert runner.prefixes.take(model, [3, *FIRST, 50, 51], lambda: begin(
            engine, model, "y")) is None and len(runner.prefixes) == 0
        with pytest.raises(SequenceError, match="ended before this step"):
            run(engine, model, kept[2], [3, *FIRST])
        # no cut where the state is more than a static cache (a sliding window's)
        runner.sequences.drop_model(model.key)
        live = begin(engine, model, "s")
        out = run(engine, model, live, FIRST)
        assert runner.prefixes.keep(model, live, FIRST + out[:-1])
        model.state.croppable = False
        assert runner.prefixes.take(model, FIRST[:18] + [1], lambda: begin(
            engine, model, "z")) is None
        assert runner.prefixes.take(model, FIRST + out, lambda: begin(engine, model, "z")) == (
            live, len(FIRST) + 5)
        runner.sequences.end(live)
    finally:
        engine.close()
        arena.close()
