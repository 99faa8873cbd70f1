"""The torch runtime at bf16 and fp16 (runtimes/torch_eager.py `lowered`): the part's weights
held in the lower dtype, cast once, the ops that read them computing at it and handing their
results back as exported; a stateful part's state (a language model's KV cache) kept as
exported, so buckets at different precisions share it. Host-independent: torch's bf16 and
fp16 kernels run on any x86-64 CPU (slowly where it has no units for them); the runtime
offers fp16 only where the profile lists F16C."""

from __future__ import annotations

import gc

import lm_models
import pytest
import torch

from partitioner.profile import DeviceProfile
from partitioner.split import split_program
from runtimes.base import relative_error
from runtimes.torch_eager import TorchExecutable, TorchRuntime, lowered, packs, prepared, state_of

TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 5e-3}


def one_part(ep: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    nodes = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    return split_program(ep, [("p0", nodes)]).parts[0].module


def tensors(module: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    return {str(n.target): getattr(module, str(n.target)) for n in module.graph.nodes
            if n.op == "get_attr"}


def greedy(exe: TorchExecutable, prompt: list[int], new: int, slot: int) -> list[int]:
    """Token by token on sequence `slot` (the part's inputs: cache_position, input_ids)."""
    out, ids = [], list(prompt)
    for pos in range(len(prompt) + new - 1):
        exe.use(slot, "lm")
        (logits,) = exe.run([torch.tensor([pos]), torch.tensor([[ids[pos]]])])
        if pos >= len(prompt) - 1:
            ids.append(int(logits[0, -1].argmax()))
            out.append(ids[-1])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_language_model_part_holds_its_weights_lower_and_its_cache_as_exported(
        dtype: torch.dtype) -> None:
    hf = lm_models.lm("llama")
    part = one_part(lm_models.export(hf))
    before = {k: (v.dtype, v.data_ptr()) for k, v in tensors(part).items()}
    low = lowered(part, dtype)
    state = set(state_of(low))
    assert state and state == set(state_of(part))
    for name, value in tensors(low).items():
        weight = value.is_floating_point() and value.dim() >= 2 and name not in state
        assert value.dtype == (dtype if weight else before[name][0]), name
        if name in state:  # the one state, shared with the part (swapped per sequence)
            assert value.data_ptr() == before[name][1], name
    assert {k: (v.dtype, v.data_ptr()) for k, v in tensors(part).items()} == before
    exe, ref = TorchExecutable(low, dtype), TorchExecutable(part, None)
    (got,) = exe.run([torch.tensor([0]), torch.tensor([[5]])])
    assert got.dtype == torch.float32
    # step by step on a sequence of its own (its cache at fp32 as exported, written from
    # fp16/bf16 results), each step near fp32's on the same tokens
    for pos, token in enumerate([5, 17, 42, 99, 120, 121, 120]):
        x = [torch.tensor([pos]), torch.tensor([[token]])]
        exe.use(7, "lm")
        ref.use(8, "lm")
        (got,), (want,) = exe.run(x), ref.run(x)
        assert relative_error(got, want) < TOLERANCE[dtype], pos
    if dtype == torch.float16:  # close enough for the tiny model's greedy tokens (bf16's
        # 1e-2 flips a step whose two best logits are 0.03 apart in 2.6)
        prompt = [5, 17, 42, 99]
        assert greedy(exe, prompt, 6, slot=9) == lm_models.reference(hf, prompt, 6)


def test_a_stateless_part_at_bf16_matches_eager_within_its_tolerance() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8)).eval()
    x = torch.randn(4, 32)
    ep = torch.export.export(model, (x,))
    low = lowered(one_part(ep), torch.bfloat16)
    assert {v.dtype for k, v in tensors(low).items() if v.dim() >= 2} == {torch.bfloat16}
    assert {v.dtype for k, v in tensors(low).items() if v.dim() == 1} == {torch.float32}
    (got,) = TorchExecutable(low, torch.bfloat16).run([x])
    with torch.no_grad():
        want = model(x)
    assert got.dtype == torch.float32 and relative_error(got, want) < 2e-2


def test_fp16_is_offered_where_the_cpu_has_f16c() -> None:
    rt = TorchRuntime()
    plain = DeviceProfile(id="cpu0", kind="cpu", features=["avx2"])
    f16c = DeviceProfile(id="cpu0", kind="cpu", features=["avx2", "f16c"])
    assert not rt.can_target(plain, "fp16") and rt.can_target(f16c, "fp16")
    assert rt.can_target(plain, "bf16")


@pytest.mark.skipif(not packs(None), reason="torch here has no oneDNN (mkldnn) CPU backend")
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_linears_run_on_packed_weights_shared_by_the_parts_buckets(
        dtype: torch.dtype | None) -> None:
    if dtype is not None and not packs(dtype):
        pytest.skip("oneDNN here has no bf16 kernels (it needs avx512bw/vl/dq or AMX)")
    hf = lm_models.lm("llama")
    part = one_part(lm_models.export(hf))
    one = prepared(part, dtype)
    gc.collect()  # (what `one` was made through is gone: its packings still shared)
    two = prepared(part, dtype)  # (two buckets of one part)
    linears = [n for n in one.graph.nodes if n.target is torch.ops.aten.linear.default]
    packed = [n for n in one.graph.nodes
              if n.target is torch.ops.mkldnn._linear_pointwise.default]  # noqa: SLF001
    assert packed and not linears
    assert all(tensors(one)[k] is tensors(two)[k] for k in tensors(one) if "packed" in k)
    exe, ref = TorchExecutable(one, dtype), TorchExecutable(part, None)
    for pos, token in enumerate([5, 17, 42, 99]):
        x = [torch.tensor([pos]), torch.tensor([[token]])]
        exe.use(3, "packed")
        ref.use(4, "packed")
        (got,), (want,) = exe.run(x), ref.run(x)
        assert relative_error(got, want) < (1e-5 if dtype is None else TOLERANCE[dtype]), pos
    if dtype is None:
        prompt = [5, 17, 42, 99]
        assert greedy(exe, prompt, 6, slot=5) == lm_models.reference(hf, prompt, 6)


def test_derived_weights_go_with_the_builds_that_run_on_them() -> None:
    """A part's weights lowered (or packed) for one build are shared by its other builds at
    the same precision, and held by them alone: a precision search's losing build takes its
    copies with it while the part, and the winner, stay (runtimes/derived.py _DERIVED)."""
    from runtimes.derived import _DERIVED  # noqa: PLC2701 - what the test is about

    part = one_part(lm_models.export(lm_models.lm("llama")))
    ids = {id(t) for t in tensors(part).values()}
    mine = lambda: [k for k in _DERIVED if k[0] in ids]  # noqa: E731
    winner, loser = prepared(part, None), prepared(part, torch.float16)
    again = prepared(part, torch.float16)  # (another bucket at fp16: the same copies)
    shared = [k for k in tensors(again) if tensors(again)[k].dtype == torch.float16]
    assert shared and all(tensors(again)[k] is tensors(loser)[k] for k in shared)
    assert {what for _, what in mine()} >= {"torch.float16"}
    del loser, again
    gc.collect()
    assert "torch.float16" not in {what for _, what in mine()}, mine()
    assert tensors(winner)  # (the winner keeps what it runs on)
