"""oneDNN's packed linear as an op that torch's vmap batches: `cuvild::packed_linear`.

oneDNN's own op (`mkldnn._linear_pointwise`) has no batching rule: under vmap (the decode
steps of several sequences in one run: runtimes/torch_eager.py `run_batch`) it would run once
per sequence, reading every weight once each. This op takes the sequences' rows to one
product. Its batching rule is a kernel at functorch's batched dispatch key, as torch's own
rules are (in C++): unwrap the rows, one product, wrap them again. `torch.library.custom_op`
with `register_vmap` did the same through autograd.Function's machinery: 81 us more a call
than oneDNN's product itself under vmap, this 16 us (a 1024x1024 weight, 4 rows; 2-core EPYC,
torch 2.13): ~6 ms a batched step of the 200M Llama's 85 linears.

Inductor calls it as an opaque kernel (runtimes/compiled_step.py compiles the module with it:
oneDNN's op is not one inductor can take).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import _functorch as functorch

PACKED = torch.ops.mkldnn._linear_pointwise.default  # noqa: SLF001 - oneDNN's linear

_lib = torch.library.Library("cuvild", "DEF")  # noqa: TOR901 - the op needs a batched kernel
_lib.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return PACKED(x, weight, bias, "none", [], "")


def _batched(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The rule under vmap: the rows of every sequence (x's batch dimension) in one product."""
    if functorch.is_batchedtensor(weight) or (bias is not None
                                              and functorch.is_batchedtensor(bias)):
        raise NotImplementedError("a packed weight is the same for every sequence")
    level, dim = functorch.maybe_get_level(x), functorch.maybe_get_bdim(x)
    rows = functorch.get_unwrapped(x).movedim(dim, 0)
    with torch._C._ExcludeDispatchKeyGuard(  # noqa: SLF001 - the plain product below
            torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)):  # noqa: SLF001
        out = torch.ops.cuvild.packed_linear.default(rows, weight, bias)
    return functorch._add_batch_dim(out, 0, level)  # noqa: SLF001


# (a packed weight is an MkldnnCPU tensor, the rows CPU ones: a kernel for any backend)
_lib.impl("packed_linear", _product, "CompositeExplicitAutograd")
_lib.impl("packed_linear", _batched, "FuncTorchBatched")


@torch.library.register_fake("cuvild::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))  # (a packed weight keeps [out, in])


def op() -> Any:
    """The op, for graphs to call."""
    return torch.ops.cuvild.packed_linear.default
