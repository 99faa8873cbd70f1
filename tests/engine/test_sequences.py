"""A stateful model's sequences (cuvild/run/sequences.py) and generation on them
(cuvild/run/generate.py): tiny random-weight language models of eight families
(tests/models/lm_models.py), exported as a user would (transformers' static-cache export),
generate greedily token for token as transformers' own `generate`; sequences keep their own
state; a sequence that is unknown, ended, idle too long, over the model's context or whose
worker died answers a clear error and leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import lm_models
import numpy as np
import pytest
import torch
from engine_helpers import CORES

from cuvild.core.arena import Arena
from cuvild.core.errors import RunTimeout
from cuvild.core.layout import BadInput
from cuvild.core.loaded import LoadedModel, Out, bucket_stats
from cuvild.engine.engine import Engine
from cuvild.intake.summary import summarize
from cuvild.load.buckets import last_logits
from cuvild.run.generate import Sampling, generate
from cuvild.run.sequences import Live, SequenceError, TooManySequences
from partitioner.plan import plan_model
from partitioner.profile import DeviceProfile

CPU = DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1],
                    runtimes=["openvino", "onnxruntime", "torch"], peak_gflops={"fp32": 50.0},
                    mem_bw_gbs=10.0, link_bw_gbs=10.0)
PROMPT = [5, 17, 42, 99]


def served(tmp_path: Path, family: str, workers: str = "thread", dynamic: bool = False,
           **options: object) -> tuple[Engine, Arena, LoadedModel, object]:
    hf = lm_models.lm(family)
    ep = lm_models.export(hf, dynamic=dynamic)
    archive = tmp_path / f"{family}.pt2"
    torch.export.save(ep, archive)
    arena = Arena(f"{os.getpid()}-seq-{family}")
    engine = Engine([CPU], tmp_path / "cache", arena, workers=workers, **options)
    key = f"{family}-dyn" if dynamic else family  # (thread workers cache splits by key)
    model = engine.prepare(key, key, "1", archive, summarize(ep)["inputs"])
    return engine, arena, model, hf


def stepper(engine: Engine, model: LoadedModel, live: Live,  # noqa: ANN201
            chunked: LoadedModel | None = None):
    """A step of `model` (`chunked`: a prompt's chunks of more than one token on it)."""
    def step(ids: list[int], position: int) -> np.ndarray:
        inputs = [torch.tensor([ids]), torch.arange(position, position + len(ids))]
        given = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in inputs]
        on = chunked if chunked is not None and len(ids) > 1 else model
        target = engine.runner.resolve(on, given)  # a dynamic model's bucket
        (logits,) = engine.runner.step(target, live, inputs, Out({}))
        return logits.numpy()[0, -1]
    return step


def greedy(engine: Engine, model: LoadedModel, tokens: int = 6) -> list[int]:
    """`tokens` greedy tokens after PROMPT, on a sequence of the model's on cpu0."""
    live = engine.runner.sequences.begin(model.key, "s", ["cpu0"])
    try:
        return list(generate(stepper(engine, model, live), PROMPT, Sampling(max_tokens=tokens),
                             lm_models.CONTEXT))
    finally:
        engine.runner.sequences.end(live)


@pytest.mark.parametrize("family", list(lm_models.FAMILIES))
def test_greedy_generation_equals_transformers_token_for_token(tmp_path: Path,
                                                                family: str) -> None:
    engine, arena, model, hf = served(tmp_path, family)
    try:
        assert model.state is not None and model.state.context == lm_models.CONTEXT
        assert [r.runtime for r in model.routes] == ["torch"]  # the one that keeps state
        assert any(n.startswith("stateful:") for n in model.plan.notes)
        live = engine.runner.sequences.begin(model.key, "s", ["cpu0"])
        got = list(generate(stepper(engine, model, live), PROMPT, Sampling(max_tokens=10),
                            model.state.context))
        engine.runner.sequences.end(live)
        assert got == lm_models.reference(hf, PROMPT, 10)
        assert arena.in_use() == 0
    finally:
        engine.close()
        arena.close()


# An NPU that holds almost none of the model: the plan splits it over both devices.
SPLIT = [DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1], runtimes=["torch"],
                       peak_gflops={"fp32": 50.0}, mem_bw_gbs=10.0, link_bw_gbs=10.0),
         DeviceProfile(id="npu0", kind="npu", emulated=True, cores=CORES[-1:],
                       runtimes=["torch"], peak_gflops={"fp32": 50.0}, mem_bw_gbs=20.0,
                       link_bw_gbs=10.0, memory_gb=0.0002)]


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_language_model_split_over_two_devices_generates_as_transformers(
        tmp_path: Path, dynamic: bool) -> None:
    """Split over both devices (~24 parts), its cache's writes where each layer runs, the
    cache's position where it is written (partitioner/split.py), it serves so, through the
    arena and both workers, token for token as transformers: of a dynamic length (its
    prompt in chunks on the twin) and exported for one token a step. (The plan is given,
    so served as planned: the load would time it against one device, cuvild/load/guard.py,
    and serve the CPU alone, 7x faster here.)"""
    hf = lm_models.lm("llama")
    ep = lm_models.export(hf, dynamic=dynamic)
    archive = tmp_path / "llama.pt2"
    torch.export.save(ep, archive)
    arena = Arena(f"{os.getpid()}-seq-split")
    engine = Engine(SPLIT, tmp_path / "cache", arena, workers="thread")
    try:
        model = engine.prepare("split", "split", "1", archive, summarize(ep)["inputs"],
                               plan=plan_model(ep, SPLIT))
        assert model is not None
        assert sorted(model.parts_by_device) == ["cpu0", "npu0"], model.plan.notes
        twin = last_logits(model) if dynamic else None
        prompt = [5, 17, 42, 99, 3, 8, 13, 21, 34, 55]
        live = engine.runner.sequences.begin(model.key, "s", ["cpu0", "npu0"])
        got = list(generate(stepper(engine, model, live, twin), prompt,
                            Sampling(max_tokens=8), lm_models.CONTEXT,
                            chunks=(8, 1) if dynamic else (1,)))
        engine.runner.sequences.end(live)
        assert got == lm_models.reference(hf, prompt, 8)
        engine.builder.unload(model.key)
        assert arena.in_use() == 0
    finally:
        engine.close()
        arena.close()


def test_a_split_that_cannot_keep_the_state_is_served_on_one_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where partitioner/split.py refuses the split planned (a value of the state read by
    another part between its updates in place: its own test builds one), the load serves
    the best single device's plan, which says why (cuvild/load/prepare.py `_one_device`).
    The refusal is made here for any split over two devices."""
    import partitioner.split

    split_program = partitioner.split.split_program

    def refusing(ep: torch.export.ExportedProgram, parts: list) -> object:
        if len(parts) > 1:
            raise ValueError("refused by the test")
        return split_program(ep, parts)

    monkeypatch.setattr(partitioner.split, "split_program", refusing)
    hf = lm_models.lm("llama")
    ep = lm_models.export(hf)
    archive = tmp_path / "llama.pt2"
    torch.export.save(ep, archive)
    arena = Arena(f"{os.getpid()}-seq-one")
    engine = Engine(SPLIT, tmp_path / "cache", arena, workers="thread")
    try:
        model = engine.prepare("one", "one", "1", archive, summarize(ep)["inputs"])
        assert model is not None
        assert sorted(model.parts_by_device) == ["cpu0"]
        (said,) = [n for n in model.plan.notes if "cannot keep the model's state" in n]
        assert "refused by the test" in said and "all on cpu0" in said, said
        assert greedy(engine, model) == lm_models.reference(hf, PROMPT, 6)
    finally:
        engine.close()
        arena.close()


def test_a_dynamic_length_takes_the_prompt_in_chunks_that_share_the_cache(
        tmp_path: Path) -> None:
    """Exported with a dynamic length: the prompt goes in chunks (8 + 1 + 1 for 10 tokens)
    through buckets of their own, and the decode steps through a third; all on one cache
    per sequence, the output still transformers' token for token."""
    engine, arena, model, hf = served(tmp_path, "llama", dynamic=True)
    try:
        assert model.family is not None and model.state is not None
        assert not model.family.replans  # one plan: its buckets run where its state is
        prompt = [5, 17, 42, 99, 3, 8, 13, 21, 34, 55]
        live = engine.runner.sequences.begin(model.key, "s", ["cpu0"])
        got = list(generate(stepper(engine, model, live), prompt, Sampling(max_tokens=8), 64,
                            chunks=(8, 1)))
        engine.runner.sequences.end(live)
        assert got == lm_models.reference(hf, prompt, 8)
        built = sorted(s[0][1] for s in model.family.buckets)
        assert built == [1, 8], built  # input_ids [1, 8] and [1, 1]
        # generation's chunks on the model's twin: logits of the last position alone
        twin = last_logits(model)
        live = engine.runner.sequences.begin(model.key, "t", ["cpu0"])
        got = list(generate(stepper(engine, model, live, twin), prompt,
                            Sampling(max_tokens=8), 64, chunks=(8, 1)))
        engine.runner.sequences.end(live)
        assert got == lm_models.reference(hf, prompt, 8)
        assert twin.family is not None and list(twin.family.buckets) == [((1, 8), (8,))]
        chunk = twin.family.buckets[((1, 8), (8,))]
        assert chunk.slots[chunk.outputs[0]].shape == (1, 1, lm_models.VOCAB)
        assert [b.get("logits") is not None for b in bucket_stats(model)].count(True) == 1
        engine.builder.unload(model.key)  # the twin's buckets go with the model
        assert not [k for k in engine.runner.served.models if k.startswith(model.key)]
        assert arena.in_use() == 0
    finally:
        engine.close()
        arena.close()


def test_a_prompts_chunks_stay_within_engine_max_dim(tmp_path: Path) -> None:
    """engine.max_dim below a chunk's length (16 here) refuses that length (BadInput), so a
    generation's chunks and the warm-up's longest are those it serves: 4 and 1 under 8."""
    from cuvild.load import warmup
    from cuvild.serve.generation import chunks_of

    engine, arena, model, hf = served(tmp_path, "llama", dynamic=True, max_dim=8)
    try:
        phases: list[str] = []
        warmup.warm_up(engine.builder, model, phases.append,
                       compile_step=False)
        assert phases == ["building its decode step", "building its 4-token prompt chunk"]
        chunks = chunks_of(model, model.key, engine.runner.max_dim)
        assert chunks == (4, 1), chunks
        with pytest.raises(BadInput, match="above the largest this server builds"):
            engine.runner.resolve(model, [("int64", (1, 16)), ("int64", (16,))])
        prompt = [5, 17, 42, 99, 3, 8, 13, 21, 34, 55]
        live = engine.runner.sequences.begin(model.key, "s", ["cpu0"])
        got = list(generate(stepper(engine, model, live, last_logits(model)), prompt,
                            Sampling(max_tokens=6), lm_models.CONTEXT, chunks=chunks))
        engine.runner.sequences.end(live)
        assert got == lm_models.reference(hf, prompt, 6)
    finally:
        engine.close()
        arena.close()


@contextlib.contextmanager
def every_place_taken(engine: Engine) -> Iterator[None]:
    """Every place among the requests in flight taken, given back after."""
    places, taken = engine.runner._in_flight, 0  # noqa: SLF001
    while places.acquire(blocking=False):
        taken += 1
    try:
        yield
    finally:
        for _ in range(taken):
            places.release()


def test_interleaved_sequences_keep_their_own_state_and_errors_are_clear(
        tmp_path: Path) -> None:
    engine, arena, model, hf = served(tmp_path, "llama")
    seqs = engine.runner.sequences
    try:
        # three generations at once: their decode steps may share runs (the worker batches
        # the steps of a part's sequences that ring together), each its own tokens; a
        # sequence's step takes no place among the requests in flight (the sequences live
        # bound those): here every place is taken, and they run all the same
        prompts, got = [PROMPT, [7, 3], [1, 2, 3, 4, 5, 6]], {}

        def run(k: int) -> None:
            live = seqs.begin(model.key, f"c{k}", ["cpu0"])
            got[k] = list(generate(stepper(engine, model, live), prompts[k],
                                   Sampling(max_tokens=12), 64))
            seqs.end(live)

        with every_place_taken(engine):
            threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            with pytest.raises(RunTimeout, match="no place among the requests in flight"):
                engine.runner.run(model, [torch.tensor([[1]]), torch.tensor([0])],  # not a step
                                  deadline=time.monotonic() + 0.2)
        for k, prompt in enumerate(prompts):
            assert got.get(k) == lm_models.reference(hf, prompt, 12), k
        exe = engine.workers.of("cpu0").worker.parts[(model.key, "p0")]
        print(f"runs of several sequences: {exe.together.runs} ({exe.together.steps} steps)")
        other = [7, 3]
        a, b = seqs.begin(model.key, "a", ["cpu0"]), seqs.begin(model.key, "b", ["cpu0"])
        ga = generate(stepper(engine, model, a), PROMPT, Sampling(max_tokens=6), 64)
        gb = generate(stepper(engine, model, b), other, Sampling(max_tokens=6), 64)
        got_a, got_b = [], []
        for x, y in zip(ga, gb, strict=True):  # step by step, in turn
            got_a.append(x)
            got_b.append(y)
        assert got_a == lm_models.reference(hf, PROMPT, 6)
        assert got_b == lm_models.reference(hf, other, 6)
        seqs.end(a)
        with pytest.raises(SequenceError, match=r"sequence 'a' of model llama: ended"):
            seqs.get(model.key, "a")
        with pytest.raises(SequenceError, match="unknown"):
            seqs.get(model.key, "never")
        with pytest.raises(BadInput, match="the prompt is 64 tokens; the model's context is 64"):
            list(generate(stepper(engine, model, b), list(range(64)), Sampling(), 64))
        seqs.idle_s = 0.05
        time.sleep(0.1)
        with pytest.raises(SequenceError, match=r"ended after 0.05 s idle"):
            seqs.get(model.key, "b")
        assert len(seqs) == 0
        seqs.cap = 1
        seqs.begin(model.key, "c", ["cpu0"])
        with pytest.raises(TooManySequences, match="1 sequences are live"):
            seqs.begin(model.key, "d", ["cpu0"])
        engine.builder.unload(model.key)
        with pytest.raises(SequenceError, match="its model was unloaded"):
            seqs.get(model.key, "c")
        assert arena.in_use() == 0
    finally:
        engine.close()
        arena.close()


def test_a_worker_killed_mid_generation_ends_its_sequence_clearly(tmp_path: Path) -> None:
    engine, arena, model, _ = served(tmp_path, "llama", workers="process")
    seqs = engine.runner.sequences
    try:
        live = seqs.begin(model.key, "s", ["cpu0"])
        step = stepper(engine, model, live)
        step([PROMPT[0]], 0)
        os.kill(engine.workers.of("cpu0").process.pid, signal.SIGKILL)
        with pytest.raises(Exception, match="state") as caught:  # this step, or the next
            step([PROMPT[1]], 1)
            seqs.get(model.key, "s")
        assert "start" in str(caught.value), caught.value
        with pytest.raises(SequenceError, match="state was lost|unknown|ended"):
            seqs.get(model.key, "s")
        # a new sequence on the revived worker generates from the start
        again = seqs.begin(model.key, "t", ["cpu0"])
        deadline = time.monotonic() + 60
        while engine.workers.ready("cpu0") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(generate(stepper(engine, model, again), PROMPT, Sampling(max_tokens=3),
                             64))
        assert arena.in_use() == 0
    finally:
        engine.close()
        arena.close()


def test_the_load_warms_a_language_model_up(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """cuvild/load/warmup.py: a language model's decode step is compiled by inductor and
    timed on a sequence of the warm-up's own before the model is READY (the sequence gone
    after); generation then gives transformers' tokens. (A dynamic length's buckets built
    by the warm-up: tests/serve/test_generation.py.)"""
    from cuvild.load import warmup
    from runtimes import compiled_step

    monkeypatch.setenv(compiled_step.ENV, "1")  # (thread workers: this process's setting)
    engine, arena, model, hf = served(tmp_path, "llama")
    try:
        phases: list[str] = []
        (said,) = warmup.warm_up(engine.builder, model, phases.append)
        assert phases == ["compiling its decode step"], phases
        # compiled, then timed: served compiled, or eager with both times (timing decides)
        assert said.startswith(("decode step compiled by inductor in ",
                                "decode step eager: compiled it ran ")), said
        assert len(engine.runner.sequences) == 0
        assert greedy(engine, model) == lm_models.reference(hf, PROMPT, 6)
    finally:
        engine.close()
        arena.close()
