"""The shared-memory arena: allocation, cross-process visibility, cleanup, offset planning."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import torch

from cuvild.core.arena import SHM_DIR, Arena, Segment, plan_offsets, reclaim_stale
from cuvild.core.layout import layout


def test_alloc_free_coalesce_and_alignment():
    arena = Arena(f"{os.getpid()}-t1", segment_bytes=1 << 20)
    try:
        blocks = [arena.alloc(n) for n in (1, 100, 4096, 70_000)]
        assert all(b.offset % 64 == 0 for b in blocks)
        assert len({b.segment for b in blocks}) == 1
        ends = sorted((b.offset, b.offset + b.size) for b in blocks)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))  # no overlap
        for b in blocks:
            arena.free(b)
        assert arena.in_use() == 0
        big = arena.alloc(1 << 20)  # the whole segment again: the holes were coalesced
        assert big.offset == 0 and len(arena.segments) == 1
        assert arena.alloc(10).segment != big.segment  # full: a second segment
    finally:
        arena.close()
    assert not list(SHM_DIR.glob(f"cuvil-{os.getpid()}-t1-*"))


def test_segment_mode_lock_and_other_process_sees_writes():
    arena = Arena(f"{os.getpid()}-t2", segment_bytes=1 << 20)
    try:
        block = arena.alloc(4 * 16)
        seg = arena.segments[block.segment]
        assert stat.S_IMODE((SHM_DIR / seg.name).stat().st_mode) == 0o600
        assert seg.locked  # mlock works as root / with LimitMEMLOCK; see the warning otherwise
        t = torch.frombuffer(seg.view(block.offset, 64), dtype=torch.float32)
        t.copy_(torch.arange(16.0))  # written in place, no copy for the reader
        code = (f"from cuvild.core.arena import Segment; import numpy as np; "
                f"s = Segment({seg.name!r}, 0, create=False, lock=False); "
                f"a = s.array({block.offset}, np.float32, (16,)); print(float(a.sum())); "
                f"a[:] = 1")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert float(out.stdout) == sum(range(16))
        assert torch.equal(t, torch.ones(16))  # and the other way round
        del t
    finally:
        arena.close()


def test_reclaim_only_dead_daemons():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = Segment(f"cuvil-{dead_pid}-0", 4096, create=True, lock=False)
    stale.owner = False  # pretend its daemon crashed
    stale.close()
    live = Segment(f"cuvil-{os.getpid()}-9", 4096, create=True, lock=False)
    try:
        removed = reclaim_stale()
        assert f"cuvil-{dead_pid}-0" in removed
        assert (SHM_DIR / live.name).exists()
    finally:
        live.close()


def test_plan_offsets_never_overlap_live_tensors():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        sizes = {f"t{i}": rng.randint(1, 5000) for i in range(n)}
        lifetimes = {}
        for name in sizes:
            first = rng.randint(0, 10)
            lifetimes[name] = (first, first + rng.randint(0, 5))
        offsets, footprint = plan_offsets(sizes, lifetimes)
        assert footprint <= sum(-(-s // 64) * 64 for s in sizes.values())
        names = list(sizes)
        for i, a in enumerate(names):
            assert offsets[a] % 64 == 0 and offsets[a] + sizes[a] <= footprint
            for b in names[i + 1:]:
                (fa, la), (fb, lb) = lifetimes[a], lifetimes[b]
                if not (la < fb or lb < fa):  # alive together: disjoint bytes
                    assert (offsets[a] + sizes[a] <= offsets[b]
                            or offsets[b] + sizes[b] <= offsets[a])


def test_tensors_of_parts_that_may_run_at_once_never_share_bytes():
    """A request runs each part once its inputs are ready (cuvild/run/request.py), so parts
    that do not wait for each other run in any order, or at once: random splits (a part
    reads earlier parts' values), and any two values laid out on the same bytes must be one
    written only after every reader of the other has run (its writer waits for them all).
    (In list order alone, a split's independent branch reused a value's bytes while
    another part read it: a split language model's cache index, read as garbage.)"""
    rng = random.Random(0)
    for _ in range(200):
        parts: list[SimpleNamespace] = []
        values = ["x"]
        for i in range(rng.randint(1, 10)):
            reads = rng.sample(values, rng.randint(1, min(3, len(values))))
            parts.append(SimpleNamespace(inputs=reads, outputs=[f"v{i}"]))
            values.append(f"v{i}")
        split = SimpleNamespace(inputs=["x"], parts=parts, outputs=[values[-1]])
        meta = {n: torch.empty(rng.randint(1, 300)) for n in values}
        slots, _, _ = layout(meta, split)
        waits: dict[str, set[str]] = {"x": set()}  # value -> values its writer waits for
        for part in parts:
            waits[part.outputs[0]] = set(part.inputs).union(*(waits[n] for n in part.inputs))
        readers = {n: [p.outputs[0] for p in parts if n in p.inputs] for n in values}
        for a in values:
            for b in values:
                sa, sb = slots[a], slots[b]
                if a >= b or (sa.offset + sa.nbytes <= sb.offset
                              or sb.offset + sb.nbytes <= sa.offset):
                    continue
                ordered = [(v, w) for v, w in ((a, b), (b, a))
                           if w != "x" and v not in split.outputs and v in waits[w]
                           and all(r in waits[w] for r in readers[v])]
                assert ordered, (a, b, [(p.inputs, p.outputs) for p in parts])


def test_sequential_tensors_share_space():
    offsets, footprint = plan_offsets({"a": 1000, "b": 1000, "c": 1000},
                                      {"a": (0, 1), "b": (1, 2), "c": (2, 3)})
    assert footprint == 2 * 1024  # a and c never live together: peak of two, not three
    assert np.unique(list(offsets.values())).size == 2
