"""runtimes/attention.py: a language model's attention over the keys some query attends (a
static cache's unwritten tail left out, and not copied to repeat its heads), the same
logits as the program as exported, step after step; attentions it does not recognise run
as exported."""

from __future__ import annotations

import copy

import lm_models
import pytest
import torch
from test_torch_lowered import one_part

from runtimes.attention import KEYS, _attended, attended, keyed
from runtimes.torch_eager import TorchExecutable, drop_scope

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def keys_seen(module: torch.fx.GraphModule, ids: list[int], position: int,
              *more: torch.Tensor) -> list[int]:
    """The key lengths its attentions get on one run (`more`: inputs after the two)."""
    seen: list[int] = []
    hook = torch.fx.Interpreter(module)
    run_node = hook.run_node

    def watch(node: torch.fx.Node) -> object:
        out = run_node(node)
        if node.target is SDPA:
            seen.append(hook.env[node.args[1]].shape[-2])
        return out

    hook.run_node = watch  # type: ignore[method-assign]
    with torch.no_grad():
        hook.run(torch.tensor([position]), torch.tensor([ids]), *more)
    return seen


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # (grouped-query heads, and not)
def test_attention_over_the_written_keys_gives_the_exported_logits(family: str) -> None:
    part = one_part(lm_models.export(lm_models.lm(family)))
    short = attended(part)
    assert short is not part
    assert set(keys_seen(short, [5], 6)) == {7}  # position 6: keys 0..6 of the 64
    assert set(keys_seen(part, [5], 6)) == {lm_models.CONTEXT}
    # grouped-query heads (llama: 4 query heads, 2 key heads) are not copied to repeat them
    attentions = [n for n in short.graph.nodes if n.target is SDPA]
    assert all(n.kwargs.get("enable_gqa", False) == (family == "llama") for n in attentions)
    repeats = [n for n in short.graph.nodes
               if n.target is torch.ops.aten.expand.default and len(n.args[1]) == 5]
    if family == "llama":
        assert not repeats
    exe, ref = TorchExecutable(short, None), TorchExecutable(part, None)
    for position, token in enumerate([5, 17, 42, 99, 3, 8, 13]):
        inputs = [torch.tensor([position]), torch.tensor([[token]])]
        exe.use(1, f"attended-{family}")
        ref.use(1, f"exported-{family}")
        (got,), (want,) = exe.run(inputs), ref.run(inputs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    drop_scope(f"attended-{family}")
    drop_scope(f"exported-{family}")


def test_the_key_count_can_be_an_inputs_length_for_a_compiler() -> None:
    """attended(..., keys=True): the count is a last input's length (what inductor compiles
    as one dynamic size), made by `keyed` from cache_position (at least 2), the same logits;
    a part without cache_position is left as it is."""
    part = one_part(lm_models.export(lm_models.lm("llama")))
    short, counted = attended(part), attended(part, keys=True)
    assert counted.meta[KEYS] == ("position", 0, lm_models.CONTEXT)
    assert [n.name for n in counted.graph.nodes if n.op == "placeholder"][-1] == KEYS
    given = []
    run = keyed(counted, lambda *inputs: given.append(inputs[-1].shape[0]) or counted(*inputs))
    for position, token in enumerate([5, 17, 42, 99]):
        inputs = [torch.tensor([position]), torch.tensor([[token]])]
        with torch.no_grad():  # (the two share the cache: each writes the same at its step)
            (want,), (got,) = short(*inputs), run(*inputs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert given == [2, 2, 3, 4]
    assert set(keys_seen(counted, [5], 6, torch.empty(7))) == {7}
    # a sliding window's mask (Mistral's, 8 keys): the count from the position still holds
    # every key it attends, past the window too
    import transformers as tf

    mistral = tf.MistralForCausalLM(tf.MistralConfig(
        vocab_size=lm_models.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        max_position_embeddings=lm_models.CONTEXT)).eval()
    mistral.generation_config.cache_implementation = "static"
    windowed = one_part(lm_models.export(mistral))
    short, counted = attended(windowed), attended(windowed, keys=True)
    run = keyed(counted, counted)
    for position in range(20):
        inputs = [torch.tensor([position]), torch.tensor([[position % 7 + 3]])]
        with torch.no_grad():
            (exact,), (want,), (got,) = windowed(*inputs), short(*inputs), run(*inputs)
        torch.testing.assert_close(want, exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    named = torch.fx.GraphModule(part, copy.deepcopy(part.graph))
    for node in named.graph.nodes:
        if node.name == "cache_position":
            node.name = "position"
    assert attended(named, keys=True) is named


def test_a_later_part_of_a_split_counts_the_keys_from_its_mask_input() -> None:
    """A split's later part gets its mask made by the first (no cache_position): with
    `keys`, its count is that mask input's last attended key (`keyed`, before the compiled
    call), so it too is compiled over the keys written, not the whole cache; the same
    logits as the part attending as it runs eagerly."""
    from partitioner.split import split_program

    ep = lm_models.export(lm_models.lm("llama"))
    compute = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    half = len(compute) // 2
    split = split_program(ep, [("p0", compute[:half]), ("p1", compute[half:])])
    first, later = (p.module for p in split.parts)
    counted = attended(later, keys=True)
    how, mask, length = counted.meta[KEYS]
    places = [n for n in later.graph.nodes if n.op == "placeholder"]
    assert (how, length) == ("mask", lm_models.CONTEXT)
    assert places[mask].meta["val"].dtype == torch.bool
    short, given = attended(later), []
    run = keyed(counted, lambda *inputs: given.append(inputs[-1].shape[0]) or counted(*inputs))
    for position, token in enumerate([5, 17, 42, 99, 3]):
        with torch.no_grad():
            sent = first(torch.tensor([position]), torch.tensor([[token]]))
            values = dict(zip(split.parts[0].outputs, sent, strict=True))
            inputs = [values[name] for name in split.parts[1].inputs]
            (want,), (got,) = short(*inputs), run(*inputs)  # (the two share the cache)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert given == [2, 2, 3, 4, 5]


def test_a_mask_that_attends_nothing_keeps_every_key() -> None:
    mask = torch.zeros(1, 1, 3, 8, dtype=torch.bool)
    assert _attended(mask) == 8
    mask[0, 0, 1, 4] = True
    assert _attended(mask) == 5


def test_attention_without_a_boolean_mask_runs_as_exported() -> None:
    class Net(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)

    x = torch.randn(1, 2, 4, 8)
    ep = torch.export.export(Net(), (x, x))
    part = one_part(ep)
    assert attended(part) is part
