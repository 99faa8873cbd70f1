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
    inputs = [[torch.randint(0, lm_models.VOCAB, (1, n), generator=gen), torch.arange(n)]
              for _ in range(count)]
    expected = []
    with torch.no_grad():
        for x in inputs:
            reset(part)
            expected.append([t.clone() for t in part(*x)])
    return inputs, expected


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


def test_a_language_models_mix_is_offered_only_with_mixed_prompt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.sequences.mixed_prompt (off by default): the budget checks a chunk's logits,
    not the cache it writes, and a chunk mixed writes it mostly in bf16 (the 200M Llama's
    greedy tokens as transformers' 100% -> 14%), so a stateful part is offered the mix only
    where the operator asks for it; a static part always."""
    from cuvild.core.precision import PrecisionPolicy
    from cuvild.load import precision
    from partitioner.plan import Part

    part, policy = Part("p0", "cpu0", "", "fp32", [], 1.0), PrecisionPolicy("auto", 1e-2)
    monkeypatch.delenv(precision.MIXED_PROMPT_ENV, raising=False)
    assert "bf16+fp32" in precision.candidates(part, CPU, policy)[0]
    assert "bf16+fp32" not in precision.candidates(part, CPU, policy, stateful=True)[0]
    monkeypatch.setenv(precision.MIXED_PROMPT_ENV, "1")
    assert "bf16+fp32" in precision.candidates(part, CPU, policy, stateful=True)[0]
