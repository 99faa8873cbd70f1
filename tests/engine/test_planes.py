"""The planes stay apart: a request of a static-shape model runs no control-plane code on
its thread (no bucket, build, publish or cost-model feedback), and a dynamic-shape model's
bucket miss is built off the request's thread and published as a new snapshot."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from engine_helpers import CLOSE, close_all, device, eager, prepare

from cuvild.client.samples import MLP
from cuvild.core.arena import Arena
from cuvild.engine.engine import Engine
from cuvild.load import buckets, warm
from cuvild.load.builder import Builder
from cuvild.run.request import FEEDBACK_RUNS

CONTROL = [(Builder, "build"), (Builder, "publish"), (Builder, "withdraw"),
           (Builder, "feedback"), (Builder, "choose"), (buckets.Buckets, "miss"),
           (buckets.Buckets, "build"), (buckets.Buckets, "evict"), (buckets, "cold"),
           (buckets, "restored"), (warm, "revive"), (warm, "load_parts")]


@pytest.fixture
def made(tmp_path) -> Iterator[list[tuple[Engine, Arena]]]:
    out: list[tuple[Engine, Arena]] = []
    yield out
    close_all(out)


def watch(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str]]:
    """Count each control-plane call by (function, thread name)."""
    calls: Counter[tuple[str, str]] = Counter()
    for owner, name in CONTROL:
        real = getattr(owner, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[(_name, threading.current_thread().name)] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls


def test_a_static_models_requests_run_no_control_plane_code(made, tmp_path, monkeypatch):
    arena = Arena(f"{os.getpid()}-planes")
    engine = Engine([device("cpu0")], tmp_path / "cache", arena, workers="thread")
    made.append((engine, arena))
    torch.manual_seed(0)
    model, x = MLP(width=32, depth=2).eval(), torch.randn(2, 32)
    prepare(engine, tmp_path, "mlp", model, (x,), ["cpu0"])
    calls = watch(monkeypatch)
    for _ in range(FEEDBACK_RUNS + 5):  # past the runs that teach the cost model
        torch.testing.assert_close(engine.infer("mlp", (x,))[0], eager(model, x), **CLOSE)
    mine = threading.current_thread().name
    assert not [c for c in calls if c[1] == mine], calls  # nothing on the request's thread
    assert set(calls) <= {("feedback", "feedback_0")}, calls  # taught on its own thread


def test_a_bucket_miss_is_built_off_the_requests_thread(made, tmp_path, monkeypatch):
    arena = Arena(f"{os.getpid()}-planes")
    engine = Engine([device("cpu0")], tmp_path / "cache", arena, workers="thread")
    made.append((engine, arena))
    torch.manual_seed(0)
    model = MLP(width=32, depth=2).eval()
    dyn = ({0: torch.export.Dim("batch", min=1, max=64)},)
    loaded = prepare(engine, tmp_path, "dyn", model, (torch.randn(2, 32),), ["cpu0"], dyn)
    calls = watch(monkeypatch)
    engine.runner.miss = engine.buckets.miss  # (wired again: the counted one)
    before = engine.runner.served
    x = torch.randn(3, 32)
    torch.testing.assert_close(engine.infer("dyn", (x,))[0], eager(model, x), **CLOSE)
    mine = threading.current_thread().name
    assert calls[("miss", mine)] == 1  # the one ask
    assert not [c for c in calls if c[1] == mine and c[0] != "miss"], calls
    assert calls[("build", "bucket_0")] >= 1
    after = engine.runner.served
    assert after is not before and "dyn@3-32" in after.models  # a new snapshot
    assert "dyn@3-32" not in before.models  # the old one is never written
    assert after.buckets[("dyn", ((3, 32),))] is loaded.family.buckets[((3, 32),)]
    calls.clear()
    engine.infer("dyn", (x,))  # built: no ask
    assert not calls, calls
