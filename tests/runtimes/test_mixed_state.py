"""A language model's prompt chunk mixed (runtimes/mixed.py): bf16 but for the groups that
must stay fp32, run by the torch runtime (the one that keeps state): its cache writes keep
the cache's dtype, each weight is cast once at the build, the search's choice is made again
from its record without searching, and a decode step is not mixed (its fp16 halves the
bytes it reads already)."""

from __future__ import annotations

from pathlib import Path

import lm_models
import pytest
import torch

from partitioner.profile import DeviceProfile
from partitioner.split import last_rows, split_program
from runtimes import mixed
from runtimes.base import CompileError, set_error
from runtimes.cache import CompileCache
from runtimes.mixed import CAST
from runtimes.select import build_part
from runtimes.torch_eager import remember_initial, reset

CPU = DeviceProfile(id="cpu0", kind="cpu", cores=[0], runtimes=["torch"],
                    peak_gflops={"fp32": 50.0, "bf16": 100.0}, features=["avx2", "f16c"])


def chunk_and_step() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The tiny Llama (a dynamic length) as one part: its twin (logits of the last position:
    what a prompt chunk runs) and the model."""
    ep = lm_models.export(lm_models.lm("llama"), dynamic=True)
    whole = split_program(ep, [("p0", [n.name for n in ep.graph.nodes
                                       if n.op == "call_function"])])
    twin = last_rows(whole) or whole
    for part in (twin.parts[0], whole.parts[0]):
        remember_initial(part.module)
    return twin.parts[0].module, whole.parts[0].module


def samples(part: torch.fx.GraphModule, n: int, count: int = 4) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(0)
    return samples_of(part, [[torch.randint(0, lm_models.VOCAB, (1, n), generator=gen),
                              torch.arange(n)] for _ in range(count)])


def test_a_prompt_chunk_is_mixed_on_torch_and_made_again_from_its_record(
        tmp_path: Path) -> None:
    chunk, _ = chunk_and_step()
    inputs, expected = samples(chunk, 8)
    cache = CompileCache(tmp_path)
    shapes = [[1, 8], [8]]
    low = build_part(chunk, CPU, "bf16", lambda: (inputs, expected), cache, tolerance=1.0,
                     input_shapes=shapes)
    bf16_error = low.candidates[0].rel_error
    target = bf16_error / 2  # (so that some group must stay fp32)
    built = build_part(chunk, CPU, "bf16+fp32", lambda: (inputs, expected), cache,
                       mix_target=target, input_shapes=shapes)
    (tried,) = built.candidates
    assert built.runtime == "torch" and tried.status == "ok", tried
    assert "groups kept fp32" in tried.reason and tried.rel_error <= target, tried
    module = built.executable.module
    weights = {n: getattr(module, str(n.target)) for n in module.graph.nodes
               if n.op == "get_attr"}
    assert any(w.dtype == torch.bfloat16 for w in weights.values())  # cast once, at the build
    casts = [n for n in module.graph.nodes if n.target is CAST
             and n.args[0].op == "get_attr"]
    assert not casts, casts
    first = built.executable.run(inputs[0])
    assert set_error([first], [expected[0]]) <= target
    # (its cache writes were not lowered: a bf16 value written into the fp32 cache would
    # have failed the run)

    def searched_again() -> tuple[list, list]:
        raise AssertionError("the recorded mix was searched again")

    again = build_part(chunk, CPU, "bf16+fp32", searched_again, cache, mix_target=target,
                       input_shapes=shapes)
    assert again.from_cache and again.runtime == "torch"
    torch.testing.assert_close(again.executable.run(inputs[0]), first, rtol=0, atol=0)


def test_a_decode_step_is_not_mixed(tmp_path: Path) -> None:
    _, step = chunk_and_step()
    inputs, expected = samples(step, 1)
    with pytest.raises(CompileError, match="not tried for a decode step"):
        build_part(step, CPU, "bf16+fp32", lambda: (inputs, expected),
                   CompileCache(tmp_path), mix_target=1e-3, input_shapes=[[1, 1], [1]])


class WritesAhead(torch.nn.Module):
    """A stateful part whose own outputs never read what it writes: a chunk reads the cache
    rows before its first position only (none, from position 0), and its `k` only writes
    the cache: what `k` computes shows in the steps after it, not in the chunk. (`head`
    weighs little: lowered, it holds any budget.)"""

    def __init__(self) -> None:
        super().__init__()
        self.k, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(1, 32, 16))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(1, pos, self.k(x))
        before = (torch.arange(32) < pos[0]).to(x.dtype)[None, :, None]
        return x + 1e-3 * self.head(x) + (before * self.cache).sum(1, keepdim=True)


def writes_ahead() -> torch.fx.GraphModule:
    """WritesAhead exported with a dynamic length, as one part."""
    length = torch.export.Dim("length", min=2, max=16)
    ep = torch.export.export(WritesAhead().eval(), (torch.randn(1, 4, 16), torch.arange(4)),
                             dynamic_shapes=({1: length}, {0: length}))
    gm = split_program(ep, [("p0", [n.name for n in ep.graph.nodes
                                    if n.op == "call_function"])]).parts[0].module
    remember_initial(gm)
    return gm


def test_a_mix_is_held_on_the_state_it_leaves() -> None:
    """A stateful part's mix is checked on the state it leaves (runtimes/mixed.py `After`:
    its last position run again, in fp32, on that state, reads what the chunk wrote): `k`
    lowered leaves the chunk's outputs exactly as fp32's, but not the next step's, so it
    stays fp32; without the state check it was lowered."""
    gm = writes_ahead()
    inputs, expected = samples_of(gm, [[torch.randn(1, 8, 16), torch.arange(8)]
                                       for _ in range(2)])
    folded, groups, spans = mixed.spans_of(gm, "bf16", inputs[0])
    assert set(groups) == {"k", "head"}, groups
    only_k = mixed.lower(folded, spans["k"], "bf16")
    after = mixed.after_runs(folded, inputs)
    assert mixed.error_on(only_k, inputs, expected) == 0.0  # the chunk's own outputs: as fp32's
    assert mixed.error_on(only_k, inputs, expected, after) > 1e-3  # the next step's: not
    _, mix = mixed.choose(gm, "bf16", 1e-3, inputs, expected)
    assert mix.state and mix.kept[0] == "k" and mix.error <= 1e-3, mix.describe()


def test_a_search_stops_running_a_build_once_it_is_over_the_target() -> None:
    """`error_on(..., above=)`: the runs of a build stop at the first input after which its
    error is known to be over `above` (the set's error takes the largest difference on any
    input over the largest value on any: the inputs left can only raise it), and the bound
    returned is over `above` and never over the error of all of them; a build that holds
    runs every input and gives its exact error."""
    gm = writes_ahead()
    gen = torch.Generator().manual_seed(0)
    inputs, expected = samples_of(gm, [[torch.randn(1, 8, 16, generator=gen), torch.arange(8)]
                                       for _ in range(6)])
    folded, _, spans = mixed.spans_of(gm, "bf16", inputs[0])
    only_k = mixed.lower(folded, spans["k"], "bf16")
    after = mixed.after_runs(folded, inputs)
    runs = []
    only_k.register_forward_pre_hook(lambda *_: runs.append(1))
    exact = mixed.error_on(only_k, inputs, expected, after)
    assert len(runs) == 6 and exact > 0  # (1.8e-3 here)
    runs.clear()
    bound = mixed.error_on(only_k, inputs, expected, after, above=exact / 4)
    assert len(runs) == 1 and exact / 4 < bound <= exact  # stopped after the first input
    runs.clear()
    assert mixed.error_on(only_k, inputs, expected, after, above=exact) == exact
    assert len(runs) == 6  # held: every input run


def samples_of(part: torch.fx.GraphModule, inputs: list) -> tuple[list, list]:
    """`inputs`, and the part's outputs on each from its initial state."""
    expected = []
    with torch.no_grad():
        for x in inputs:
            reset(part)
            expected.append([t.clone() for t in part(*x)])
    return inputs, expected


def test_a_language_models_mix_is_offered_unless_mixed_prompt_is_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.sequences.mixed_prompt (on by default; the daemon sets the variable its
    workers read): a stateful part on a host device is offered the mix; off, none is (a
    first load under a budget then spends no time searching one); a static part always is."""
    from cuvild.core.precision import PrecisionPolicy
    from cuvild.load import precision
    from partitioner.plan import Part

    part, policy = Part("p0", "cpu0", "", "fp32", [], 1.0), PrecisionPolicy("auto", 1e-2)
    monkeypatch.delenv(precision.MIXED_PROMPT_ENV, raising=False)
    assert "bf16+fp32" in precision.candidates(part, CPU, policy, stateful=True)[0]
    # not on a GPU: its search would run the chunk in torch eager on the host a hundred
    # times, a model sized for the GPU (a static part's mix is settled on its GPU builds)
    gpu = DeviceProfile(id="gpu0", kind="gpu", cores=[0], runtimes=["torch"],
                        peak_gflops={"fp32": 50.0, "bf16": 100.0})
    assert "bf16+fp32" not in precision.candidates(part, gpu, policy, stateful=True)[0]
    assert "bf16+fp32" in precision.candidates(part, gpu, policy)[0]
    monkeypatch.setenv(precision.MIXED_PROMPT_ENV, "0")
    assert "bf16+fp32" not in precision.candidates(part, CPU, policy, stateful=True)[0]
    assert "bf16+fp32" in precision.candidates(part, CPU, policy)[0]
