"""runtimes/masks.py: an attention row whose boolean mask attends no key gives zeros on every
runtime, as torch's does (OpenVINO gave NaN, ONNX Runtime the values' average), and every
other row is what it was."""

from __future__ import annotations

import os

import pytest
import torch
from test_torch_lowered import one_part

from partitioner.profile import DeviceProfile
from runtimes.base import CompileSpec
from runtimes.masks import empty_rows_zeroed

THREADS = min(2, len(os.sched_getaffinity(0)))
CPU = DeviceProfile(id="cpu0", kind="cpu", cores=list(range(THREADS)))


class Attention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def inputs() -> list[torch.Tensor]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()  # causal
    mask[1, :, :, :3] = False  # the second row left-padded by 3: its first 3 queries attend
    return [q, k, v, mask]    # nothing


def part() -> torch.fx.GraphModule:
    return one_part(torch.export.export(Attention(), tuple(inputs())))


def test_the_rewrite_keeps_every_row_that_attends_and_zeroes_the_others() -> None:
    module = part()
    rewritten = empty_rows_zeroed(module)
    assert rewritten is not module
    with torch.no_grad():
        want, got = module(*inputs()), rewritten(*inputs())
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = want[0] if isinstance(want, (tuple, list)) else want
    assert torch.equal(got, want)  # torch's own: zeros there already, the rest bit for bit
    assert torch.equal(got[1, :3], torch.zeros_like(got[1, :3]))
    assert got[1, 3:].abs().min() > 0 and got[0].abs().min() > 0


def test_a_part_without_a_boolean_mask_is_left_as_it_is() -> None:
    class Plain(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    module = one_part(torch.export.export(Plain(), (torch.randn(1, 2, 4, 8),)))
    assert empty_rows_zeroed(module) is module


@pytest.mark.parametrize("name", ["openvino", "onnxruntime"])
def test_a_runtime_gives_an_empty_row_zeros_as_torch_does(name: str) -> None:
    if name == "openvino":
        pytest.importorskip("openvino")
        from runtimes.openvino import OpenVINORuntime as Runtime
    else:
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
        from runtimes.onnxruntime import ONNXRuntime as Runtime
    exe = Runtime().compile(part(), CompileSpec(device=CPU, threads=THREADS,
                                                example_inputs=inputs()))
    (got,) = exe.run(inputs())
    with torch.no_grad():
        want = Attention()(*inputs())
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class PaddedAttention(torch.nn.Module):
    """A decoder's attention as transformers builds its mask: causal, and the batch's padding
    (its `attention_mask` input) masked out: a left-padded row's first queries attend no key."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qkv = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 48)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, n = input_ids.shape
        q, k, v = self.qkv(self.embed(input_ids)).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, 16)


@pytest.mark.parametrize("rewritten", [True, False])
def test_a_build_that_gives_nan_on_a_padded_row_is_not_the_one_chosen(
        rewritten: bool, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A part built at fp32 is checked on the worker's two sample inputs, the second with a
    left-padded row (cuvild/workers/build.py): without the rewrite OpenVINO's NaN there fails
    its build, and torch is taken (checked on the first sample alone, OpenVINO passed)."""
    pytest.importorskip("openvino")
    import runtimes.masks
    from cuvild import export
    from cuvild.intake.summary import summarize
    from cuvild.workers.build import build_model_part
    from protos.orders import Build
    from runtimes.cache import CompileCache

    if not rewritten:  # OpenVINO as it is (it imports the rewrite as it compiles)
        monkeypatch.setattr(runtimes.masks, "empty_rows_zeroed", lambda module: module)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    ep = export(PaddedAttention().eval(), (ids, torch.ones(2, 8, dtype=torch.long)))
    torch.export.save(ep, tmp_path / "m.pt2")
    nodes = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    order = Build(model="m", part="p0", archive=str(tmp_path / "m.pt2"),
                  assignment=[("p0", nodes)], precisions=["fp32"],
                  input_specs=summarize(ep)["inputs"], timeout_s=120, split_key="m",
                  allowed=["openvino", "torch"])
    built, tried = build_model_part(order, CPU, CompileCache(tmp_path / "cache"))
    openvino = next(t for t in tried if t["runtime"] == "openvino")
    if rewritten:  # (which of the two is kept then is the faster: either)
        assert openvino["status"] == "ok" and openvino["rel_error"] < 1e-5
    else:
        assert built["fp32"].runtime == "torch"
        assert openvino["status"] == "failed" and "NaN" in openvino["reason"]
