"""Load records (cuvild/load/warm.py): a second engine on the same cache serves the model
again with nothing read from the archive, planned or compiled (asserted on the engine's
counters, not on time), and a record or part that is stale or corrupt is built again and the
model still serves torch eager's results."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import cuvild
from cuvild.client.samples import MLP
from cuvild.core.arena import Arena
from cuvild.core.precision import PrecisionPolicy
from cuvild.engine.engine import Engine
from cuvild.intake import forks
from cuvild.intake.summary import summarize
from cuvild.load import buckets, warm
from partitioner.profile import DeviceProfile

CORES = sorted(os.sched_getaffinity(0))
CPU = DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1], runtimes=["openvino"],
                    peak_gflops={"fp32": 100.0}, mem_bw_gbs=20.0, link_bw_gbs=10.0,
                    launch_us=5.0)
pytest.importorskip("openvino", reason="OpenVINO (the runtime whose builds are cached here) "
                                       "is not installed")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warm")
    torch.manual_seed(0)
    net = MLP(width=64, depth=3).eval()
    x = torch.randn(2, 64)
    ep = cuvild.export(net, (x,))
    archive = tmp / "mlp.pt2"
    torch.export.save(ep, archive)
    with torch.no_grad():
        return net, x, net(x), archive, summarize(ep)["inputs"]


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers spawned, as a restarted daemon's are (it runs no forkserver until an upload:
    cuvild/intake/forks.py), so that what a worker imports shows in its maps."""
    monkeypatch.setattr(forks, "running", lambda: False)


@pytest.fixture
def arena():
    arena = Arena(f"{os.getpid()}-warm")
    yield arena
    arena.close()


def load(cache: Path, arena: Arena, model, policy=None, phases=None):  # noqa: ANN001, ANN201
    """A fresh engine (new worker processes) on `cache`, the model prepared in it."""
    _, _, _, archive, specs = model
    engine = Engine([CPU], cache, arena)
    try:
        loaded = engine.prepare("mlp:1", "mlp", "1", archive, specs, policy=policy,
                                progress=phases.append if phases is not None else None)
    except BaseException:
        engine.close()
        raise
    return engine, loaded


@pytest.fixture(scope="module")
def built(tmp_path_factory, model):  # noqa: ANN001, ANN201
    """A compile cache holding the model's build and load record, made once for the module;
    the tests that start from one take a copy (`copy_of`), not a build of their own."""
    cache = tmp_path_factory.mktemp("warm-cache") / "cache"
    arena = Arena(f"{os.getpid()}-warm-built")
    try:
        engine, _ = load(cache, arena, model)
        engine.close()
    finally:
        arena.close()
    return cache


def copy_of(cache: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(cache, tmp_path / "cache"))


def served_right(engine: Engine, model) -> None:  # noqa: ANN001
    net, x, expected, _, _ = model
    (out,) = engine.infer("mlp:1", (x,))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def record_dir(cache: Path) -> Path:
    (where,) = (cache / "loads").iterdir()
    return where


@pytest.mark.usefixtures("spawned")
def test_a_restart_plans_and_compiles_nothing(tmp_path, arena, model):
    cache = tmp_path / "cache"
    phases: list[str] = []
    engine, first = load(cache, arena, model, phases=phases)
    try:
        assert not first.warm
        # each phase, down to the runtime the worker is trying
        assert phases[:3] == ["reading the archive", "planning", "building part 1 of 1 on cpu0"]
        assert "building part 1 of 1 on cpu0: trying openvino at fp32" in phases, phases
        assert phases[-1] == "checking end to end"
        counters = engine.builder.counters
        assert counters["archive_loads"] == 1 and counters["planned"] == 1
        assert engine.builder.counters["compiled"] == 1 and engine.builder.counters["restored"] == 0
        served_right(engine, model)
    finally:
        engine.close()
    record = json.loads((record_dir(cache) / warm.RECORD).read_text())
    assert [r["runtime"] for r in record["routes"]] == ["openvino"]

    phases.clear()
    engine, second = load(cache, arena, model, phases=phases)
    try:
        assert second.warm and phases == ["restoring from the load record"]
        counters = dict(engine.builder.counters)
        assert counters == {"restored": 1}, counters  # no archive, plan, build or compile
        assert [r.runtime for r in second.routes] == ["openvino"]
        assert second.plan.parts[0].runtime == "openvino"
        assert second.accuracy.chosen.error <= 1e-5
        served_right(engine, model)
        # the worker runs its OpenVINO part on numpy views: torch never loaded there
        maps = Path(f"/proc/{engine.workers['cpu0'].process.pid}/maps").read_text()
        assert "libtorch" not in maps and "openvino" in maps
    finally:
        engine.close()


def test_another_policy_is_another_record(tmp_path, arena, model, built):
    cache = copy_of(built, tmp_path)
    engine, again = load(cache, arena, model, PrecisionPolicy("auto", 0.05))
    try:
        assert not again.warm and engine.builder.counters["planned"] == 1
        served_right(engine, model)
    finally:
        engine.close()
    assert len(list((cache / "loads").iterdir())) == 2


@pytest.mark.parametrize("damage", ["record", "expected", "part"])
def test_a_corrupt_record_or_part_is_built_again(tmp_path, arena, model, built, damage):
    cache = copy_of(built, tmp_path)
    where = record_dir(cache)
    if damage == "record":
        (where / warm.RECORD).write_text('{"format": 1, "plan": ')
    elif damage == "expected":  # outputs that no longer match: the check refuses the record
        with np.load(where / warm.EXPECTED) as data:
            arrays = {k: data[k] + 1.0 for k in data.files}
        np.savez(where / warm.EXPECTED, **arrays)
    else:  # the cached executable's files, garbage
        for entry in (cache / "compiled").iterdir():
            for f in entry.iterdir():
                if f.name != "meta.json":
                    f.write_bytes(b"\0garbage")
    engine, again = load(cache, arena, model)
    try:
        assert not again.warm
        assert engine.builder.counters["planned"] == 1 and engine.builder.counters["built"] == 1
        served_right(engine, model)
    finally:
        engine.close()
    engine, third = load(cache, arena, model)  # and the rebuilt record serves the next start
    try:
        assert third.warm and dict(engine.builder.counters) == {"restored": 1}
        served_right(engine, model)
    finally:
        engine.close()


@pytest.mark.usefixtures("spawned")
def test_a_restart_serves_a_dynamic_model_and_its_buckets_from_their_records(tmp_path, arena,  # noqa: PLR0915 - one restart story, step by step
                                                                            monkeypatch):
    """A dynamic-shape model is served at once after a restart, and each bucket it had built
    is restored on first use (nothing read, planned or compiled); a bucket of new shapes
    reads the archive then, and is built; a bucket whose record no longer checks out is
    built again."""
    torch.manual_seed(0)
    net = MLP(width=32, depth=2).eval()
    ep = cuvild.export(net, (torch.randn(2, 32),),
                       dynamic_shapes=({0: torch.export.Dim("batch", max=16)},))
    archive = tmp_path / "dyn.pt2"
    torch.export.save(ep, archive)
    specs, cache = summarize(ep)["inputs"], tmp_path / "cache"

    def serve(rows: int, engine: Engine) -> None:
        x = torch.randn(rows, 32)
        (out,) = engine.infer("dyn:1", (x,))
        with torch.no_grad():
            torch.testing.assert_close(out, net(x), rtol=1e-4, atol=1e-5)

    engine = Engine([CPU], cache, arena)
    try:
        assert not engine.prepare("dyn:1", "dyn", "1", archive, specs).warm
        for rows in (1, 4):
            serve(rows, engine)
        counters = engine.builder.counters
        assert counters["archive_loads"] == 1 and counters["built"] == 2
    finally:
        engine.close()
    kept = record_dir(cache) / warm.BUCKETS
    assert sorted(p.name for p in kept.iterdir()) == ["1-32", "4-32"]

    with np.load(kept / "4-32" / warm.EXPECTED) as data:  # its outputs no longer match
        arrays = {k: data[k] + 1.0 if k.startswith("o") else data[k] for k in data.files}
    np.savez(kept / "4-32" / warm.EXPECTED, **arrays)
    engine = Engine([CPU], cache, arena)
    try:
        assert engine.prepare("dyn:1", "dyn", "1", archive, specs).warm
        assert dict(engine.builder.counters) == {}  # served with nothing read, planned or built
        serve(1, engine)
        assert dict(engine.builder.counters) == {"restored": 1}
        serve(4, engine)  # its record refused: built again (the archive read for it)
        serve(7, engine)  # new shapes: built
        counters = engine.builder.counters
        assert counters["archive_loads"] == 1 and counters["built"] == 2
        assert engine.builder.counters["compiled"] == 1  # (4 rows: its build was in the cache)
    finally:
        engine.close()
    engine = Engine([CPU], cache, arena)  # and every bucket is served from its record now
    try:
        engine.prepare("dyn:1", "dyn", "1", archive, specs)
        for rows in (1, 4, 7):
            serve(rows, engine)
        assert dict(engine.builder.counters) == {"restored": 3}
        maps = Path(f"/proc/{engine.workers['cpu0'].process.pid}/maps").read_text()
        assert "libtorch" not in maps  # the worker never needed torch
        monkeypatch.setattr(buckets, "RECORDS", 2)  # the last written are kept
        serve(9, engine)
        assert sorted(p.name for p in kept.iterdir()) == ["7-32", "9-32"]
    finally:
        engine.close()


def test_what_a_crash_left_of_records_is_removed_when_old_and_kept_when_young(tmp_path):
    """Load records are written as temporaries, synced, then renamed; a crash can leave
    `.tmp-*` at three levels. A start removes the old ones; a young one may be a write of a
    daemon sharing the cache (a pod on a shared volume), so it stays."""
    loads = tmp_path / "loads"
    old = [loads / ".tmp-abc", loads / "k1" / ".tmp-x1", loads / "k1" / "buckets" / ".tmp-2x8"]
    young = loads / "k2" / ".tmp-y"
    for path in [*old, young]:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.name == ".tmp-abc":
            path.mkdir()
            (path / "record.json").write_text("{")
        else:
            path.write_text("partial")
    kept = loads / "k1" / "record.json"
    kept.write_text("{}")
    hour_ago = os.path.getmtime(kept) - 7200
    for path in old:
        os.utime(path, (hour_ago, hour_ago))
    assert warm.clean(tmp_path) == 3
    assert not any(p.exists() for p in old)
    assert young.exists() and kept.exists()
    assert warm.clean(tmp_path) == 0
