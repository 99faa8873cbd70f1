"""Weights derived from a part's own (lowered to bf16, packed for oneDNN), shared by every build
of the part that runs on them (runtimes/torch_eager.py `prepared`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

# weights derived from a part's own (lowered, packed), by (id of the part's tensor, what):
# the buckets built from one part share them (a language model's five buckets would hold five
# copies of its weights otherwise). Held by the executables that run on them, not here: a
# precision search's losing builds take theirs with them (held here until their part went,
# the 200M Llama's worker kept 1.6 GB of them: its fp32 packings for 1 and 128 rows, its
# plain bf16 copy, beside the mixed chunk and fp16 step it served). Each is keyed by the
# part's own tensor it comes from, through what (a weight lowered, then packed: its bf16
# copy, held by nothing once packed, need not stay for the next bucket to find the packing),
# keeps that tensor alive, and goes with it (whose id another tensor may take then)
_DERIVED: weakref.WeakValueDictionary[tuple[int, str], torch.Tensor] = \
    weakref.WeakValueDictionary()


def derived(weight: torch.Tensor, what: str, make: Callable[[torch.Tensor], torch.Tensor]
            ) -> torch.Tensor:
    root = getattr(weight, "_cuvild_root", weight)  # (a derived one's: the part's own)
    what = f"{weight._cuvild_what}/{what}" if root is not weight else what  # noqa: SLF001
    key = (id(root), what)
    found = _DERIVED.get(key)
    if found is None:
        found = _DERIVED[key] = make(weight.detach())
        found._cuvild_root, found._cuvild_what = root, what  # noqa: SLF001 - (tensors take
        weakref.finalize(root, _DERIVED.pop, key, None)  # attributes)
    return found
