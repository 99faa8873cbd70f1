"""Where a stateful part's sequences keep their state in a worker: one pool per model.

A language model's parts update buffers in place (its KV cache). Every sequence of a model
(its `scope`: the model's key) has a row of the model's pool: each buffer is held once for
all of them, [rows, *shape], and a run of one sequence installs its row's views (nothing
copied). Several sequences whose rows are consecutive run as one batch on a slice of the
pool (runtimes/torch_eager.py `run_batch`): the decode steps of concurrent generations read
the weights once for all. A new sequence takes the lowest free row, from the initial state;
the pool doubles when full (its rows copied once) and goes when its last sequence does.
"""

from __future__ import annotations

import threading

import torch

Layout = tuple[tuple[str, tuple[int, ...], torch.dtype, str], ...]  # (name, shape, dtype, device)
# by model key and the state's layout (thread workers of several engines share this process)
_POOLS: dict[tuple[str, Layout], Pool] = {}
_LOCK = threading.Lock()


class Pool:
    def __init__(self, initial: dict[str, torch.Tensor]) -> None:
        self.initial = initial
        self.tensors = {n: torch.empty((0, *v.shape), dtype=v.dtype, device=v.device)
                        for n, v in initial.items()}  # (where the part runs: a GPU's memory)
        self.rows: dict[int, int] = {}  # slot -> row

    def row(self, slot: int) -> int:
        """Sequence `slot`'s row (a new one from the initial state on its first run)."""
        at = self.rows.get(slot)
        if at is not None:
            return at
        used = set(self.rows.values())
        at = next(r for r in range(len(used) + 1) if r not in used)
        size = next(iter(self.tensors.values())).shape[0]
        if at >= size:
            grown = max(1, 2 * size)
            for name, held in self.tensors.items():
                bigger = torch.empty((grown, *held.shape[1:]), dtype=held.dtype,
                                     device=held.device)
                bigger[:size] = held
                self.tensors[name] = bigger
        for name, held in self.tensors.items():
            held[at].copy_(self.initial[name])
        self.rows[slot] = at
        return at

    def views(self, first: int, count: int = 1) -> dict[str, torch.Tensor]:
        """Each buffer's rows first .. first + count - 1 (count 1: the row itself)."""
        if count == 1:
            return {n: t[first] for n, t in self.tensors.items()}
        return {n: t[first:first + count] for n, t in self.tensors.items()}


def layout_of(initial: dict[str, torch.Tensor]) -> Layout:
    """What a pool is for besides its model: its buffers' names, shapes, dtypes, devices."""
    return tuple(sorted((n, tuple(t.shape), t.dtype, str(t.device))
                        for n, t in initial.items()))


def pool(scope: str, initial: dict[str, torch.Tensor], layout: Layout | None = None) -> Pool:
    """Model `scope`'s pool for state laid out as `initial` (`layout`: its `layout_of`, where
    the caller keeps it)."""
    key = (scope, layout if layout is not None else layout_of(initial))
    with _LOCK:
        found = _POOLS.get(key)
        if found is None:
            found = _POOLS[key] = Pool(initial)
        return found


def drop_sequence(scope: str, slot: int) -> None:
    """Sequence `slot` of model `scope` ended: its row is free (the pool goes with the last)."""
    with _LOCK:
        for key, found in [(k, p) for k, p in _POOLS.items() if k[0] == scope]:
            found.rows.pop(slot, None)
            if not found.rows:
                del _POOLS[key]


def copy_sequence(scope: str, source: int, slot: int, length: int = 0) -> None:
    """Sequence `slot` of model `scope` starts from sequence `source`'s state, in each pool
    that holds it: its row a copy of the source's (between runs: the worker's lock). With
    `length`, the state is cut back to its first `length` positions, as transformers'
    `StaticLayer.crop` does: its written counts (the 0-d integer buffers) set to `length`
    (transformers' export sets them from `cache_position` at each call too), the positions
    after it left to be written over (a static KV cache; the load checks the model's state
    is nothing else: cuvild/core/loaded.py State.croppable). A source held
    by none of the model's pools here is an error (the copy would start from nothing); a
    worker without any (its parts keep no state) has nothing to copy."""
    with _LOCK:
        pools = [p for k, p in _POOLS.items() if k[0] == scope]
        found = [p for p in pools if source in p.rows]
    if pools and not found:
        raise KeyError(f"model {scope}: sequence slot {source} holds no state here")
    for held in found:
        at = held.row(slot)  # (may grow the pool: the source's row is read after)
        for tensor in held.tensors.values():
            tensor[at].copy_(tensor[held.rows[source]])
            if length and tensor.dim() == 1 and not tensor.dtype.is_floating_point:
                tensor[at].fill_(length)


def drop_scope(scope: str) -> None:
    """Model `scope` was unloaded: every sequence's state of it goes."""
    with _LOCK:
        for key in [k for k in _POOLS if k[0] == scope]:
            del _POOLS[key]


def holds(scope: str, slot: int) -> bool:
    """Whether sequence `slot` of model `scope` holds a row here."""
    return any(slot in p.rows for k, p in list(_POOLS.items()) if k[0] == scope)


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows as (first, count) runs of consecutive rows: [3, 0, 1, 5] -> (0, 2), (3, 1),
    (5, 1)."""
    out: list[tuple[int, int]] = []
    for r in sorted(rows):
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out
