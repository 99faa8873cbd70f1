"""Ops of other libraries that an archive may name, defined here as their library defines
them, so that a model exported with that library's defaults loads where it is not
installed (a daemon's image has no transformers).

transformers' mixture-of-experts layers (Mixtral, Qwen2/3-MoE, OLMoE, ...) export their
default experts implementation as `transformers::grouped_mm_fallback`: each expert's rows of
the input (sorted by expert; `offs` the running count of rows per expert) times that
expert's weight, as its own custom op (transformers/integrations/moe.py). Its meaning is
fixed by its schema and its code there; this is the same computation. In a process that
imports transformers' MoE layers (a client, a test that built the model), before ours or
after, transformers' own definition is the one that runs (torch keeps the last, and ours is
made only where none is); cuvild's daemon, forkserver and workers never import transformers,
and run this one.
"""

from __future__ import annotations

import threading

import torch

# (namespace, name) -> its schema, as its library declares it
KNOWN = {("transformers", "grouped_mm_fallback"):
         "(Tensor input, Tensor weight, Tensor offs) -> Tensor"}
_lock = threading.Lock()


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: A002 - the op's own argument names
    """Rows [offs[i-1], offs[i]) of `input` (S, in) times weight[i] (experts, in, out)."""
    output = torch.zeros(input.size(0), weight.size(2), dtype=input.dtype, device=input.device)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(input[start:end], weight[i], out=output[start:end])
        start = end
    return output


def _grouped_mm_shape(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - (as above)
                      offs: torch.Tensor) -> torch.Tensor:
    return input.new_empty(input.size(0), weight.size(2))


def defined(qualname: str) -> bool:
    try:
        torch._C._get_schema(qualname, "")  # noqa: SLF001 - the dispatcher's schema registry
    except RuntimeError:
        return False
    return True


def ensure(namespace: str, name: str) -> bool:
    """Define the op (a KNOWN one) unless this process has it; whether the one it has now
    is declared as KNOWN says (a library's other version may declare it otherwise)."""
    qualname, schema = f"{namespace}::{name}", KNOWN[(namespace, name)]
    with _lock:
        if not defined(qualname):
            torch.library.custom_op(qualname, grouped_mm, mutates_args=(), schema=schema)
            torch.library.register_fake(qualname, _grouped_mm_shape)
    return str(torch._C._get_schema(qualname, "")) == qualname + schema  # noqa: SLF001 - (as above)
