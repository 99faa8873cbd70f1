"""Dynamic batching in the engine (cuvild/engine/batching.py): concurrent requests merged into
one run and split back, each caller getting exactly its rows, on worker processes and threads;
client regions read and written per request; buckets built once; the delay bound; shapes that
differ never merge; failures and deadlines that stay with their request."""

from __future__ import annotations

import os
import sys
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

import cuvild
from cuvild.client.samples import MLP
from cuvild.engine.arena import SHM_DIR, Arena
from cuvild.engine.batching import Batching
from cuvild.engine.engine import Engine
from cuvild.engine.errors import BadRegion, RunTimeout
from cuvild.engine.loaded import bucket_stats
from cuvild.engine.orders import RawTensor, TensorRef
from cuvild.intake.summary import summarize
from partitioner.profile import DeviceProfile

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_helpers.py
from engine_helpers import CORES, chunked_plan, close_all, device  # noqa: E402


class Rows(torch.nn.Module):
    """Row-independent: (batch, 16) -> (batch, 16) and (batch, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return h, self.b(h)


class Sequence(torch.nn.Module):
    """(batch, time, 8): two dynamic dims, rows independent."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).cumsum(1)


class Centered(torch.nn.Module):
    """Mixes rows: each row minus the batch's mean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


@pytest.fixture
def make(tmp_path):
    made: list[tuple[Engine, Arena]] = []

    def engine(threads: bool = False) -> Engine:
        arena = Arena(f"{os.getpid()}-bat{len(made)}")
        eng = Engine([device("cpu0"), device("npu0")], tmp_path / "cache", arena,
                     in_process=threads)
        made.append((eng, arena))
        return eng

    yield engine
    close_all(made)
    assert not list(SHM_DIR.glob(f"cuvil-{os.getpid()}-bat*"))


def load(engine: Engine, tmp: Path, name: str, model: torch.nn.Module, example: torch.Tensor,
         dims: dict[int, torch.export.Dim], devices: tuple[str, ...] = ("cpu0",),
         batching: Batching | None = None):  # noqa: ANN201
    ep = cuvild.export(model, (example,), dynamic_shapes=(dims,))
    path = tmp / f"{name}.pt2"
    torch.export.save(ep, path)
    return engine.prepare(name, name, "1", path, summarize(ep)["inputs"],
                          plan=chunked_plan(ep, list(devices)),
                          batching=batching or Batching(8, 20_000))


def at_once(count: int, call) -> list:  # noqa: ANN001
    """`call(i)` on `count` threads released together; results (or exceptions) by i."""
    results: list = [None] * count
    gate = threading.Barrier(count)

    def one(i: int) -> None:
        gate.wait()
        try:
            results[i] = call(i)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def batch_dim(high: int = 64) -> torch.export.Dim:
    return torch.export.Dim("batch", min=1, max=high)


@pytest.mark.parametrize("threads", [False, True], ids=["process", "thread"])
def test_concurrent_requests_get_their_own_rows(make, tmp_path, threads):
    torch.manual_seed(0)
    engine = make(threads)
    model = Rows().eval()
    loaded = load(engine, tmp_path, "rows", model, torch.randn(2, 16), {0: batch_dim()},
                  devices=("cpu0", "npu0"))
    assert loaded.batcher is not None and loaded.unbatched == ""
    xs = [torch.randn(1 + i % 3, 16) for i in range(24)]  # 1 to 3 rows each

    def call(i: int):  # noqa: ANN202
        if i % 2:  # raw bytes, as the protocol gives them
            given = [("float32", tuple(xs[i].shape))]
            model_ = engine.resolve(loaded, given)
            return engine.run(model_, [RawTensor(xs[i].numpy().tobytes(), "float32",
                                                 tuple(xs[i].shape))])
        return engine.infer("rows", (xs[i],))

    for _ in range(2):
        results = at_once(len(xs), call)
        for i, got in enumerate(results):
            assert not isinstance(got, Exception), got
            with torch.no_grad():
                want = model(xs[i])
            for out, ref in zip(got, want, strict=True):
                if isinstance(out, bytes):
                    out = torch.frombuffer(bytearray(out), dtype=torch.float32).view(ref.shape)
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    stats = loaded.batcher.stats()
    assert stats["requests"] == 48
    assert max(stats["sizes"]) > 1, stats  # some requests shared a run
    assert sum(rows * runs for rows, runs in stats["sizes"].items()) == 2 * sum(
        len(x) for x in xs)
    # every batch size was built once and reused: one bucket per size, never built again
    assert engine.counters["built"] == 2 * len(loaded.variants)  # two parts per bucket
    assert engine.arena.in_use() == 0


def test_client_regions_are_read_and_written_per_request(make, tmp_path):
    torch.manual_seed(1)
    engine = make()
    model = Rows().eval()
    loaded = load(engine, tmp_path, "shm", model, torch.randn(2, 16), {0: batch_dim()})
    count = 8
    xs = [torch.randn(1, 16) for _ in range(count)]
    regions = [shared_memory.SharedMemory(create=True, size=4096) for _ in range(count)]
    keys = [(r.name, os.stat(SHM_DIR / r.name).st_ino) for r in regions]
    try:
        def call(i: int):  # noqa: ANN202
            region = regions[i]
            inode = os.stat(SHM_DIR / region.name).st_ino
            region.buf[:64] = xs[i].numpy().tobytes()
            model_ = engine.resolve(loaded, [("float32", (1, 16))])
            inp = TensorRef(region.name, 0, "float32", (1, 16), inode)
            out = {loaded.outputs[0]: TensorRef(region.name, 1024, "float32", (1, 16), inode)}
            return engine.run(model_, [inp], out, raw=True)

        results = at_once(count, call)
        for i, got in enumerate(results):
            assert not isinstance(got, Exception), got
            with torch.no_grad():
                h, y = model(xs[i])
            assert got[0] is None  # written into the region
            written = torch.frombuffer(bytearray(regions[i].buf[1024:1088]),
                                       dtype=torch.float32).view(1, 16)
            torch.testing.assert_close(written, h, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(torch.frombuffer(bytearray(got[1]), dtype=torch.float32)
                                       .view(1, 4), y, rtol=1e-4, atol=1e-5)
        assert max(loaded.batcher.stats()["sizes"]) > 1

        # a region shrunk under its request fails that request alone
        fd = os.open(SHM_DIR / regions[3].name, os.O_RDWR)
        os.ftruncate(fd, 16)
        os.close(fd)
        results = at_once(count, call)
        assert isinstance(results[3], BadRegion), results[3]
        assert all(not isinstance(r, Exception) for i, r in enumerate(results) if i != 3)
    finally:
        for region in regions:
            region.close()
            region.unlink()
    engine.forget_segments(keys)


def test_a_trickle_waits_at_most_the_delay(make, tmp_path):
    """Requests one at a time to an idle model run at once; a trickle faster than the delay
    waits for it, never longer than the delay and the run ahead of it."""
    torch.manual_seed(2)
    engine = make()
    delay = 0.15
    loaded = load(engine, tmp_path, "trickle", Rows().eval(), torch.randn(2, 16),
                  {0: batch_dim()}, batching=Batching(64, int(delay * 1e6)))
    x = torch.randn(1, 16)
    for _ in range(5):  # alone, and apart: never held back
        engine.infer("trickle", (x,))
        time.sleep(delay * 1.5)
    waits = list(loaded.batcher.waits)
    assert max(waits) < delay / 2, waits
    loaded.batcher.waits.clear()
    done: list[float] = []

    def one() -> None:
        t0 = time.monotonic()
        engine.infer("trickle", (x,))
        done.append(time.monotonic() - t0)

    threads = []
    for _ in range(8):  # a request every 30 ms: a batch cannot fill up, the delay ends it
        threads.append(threading.Thread(target=one))
        threads[-1].start()
        time.sleep(0.03)
    for t in threads:
        t.join(60)
    assert len(done) == 8
    runs = [ms for v in loaded.variants.values() for r in v.routes for ms in r.measured_ms]
    bound = delay + max(runs) / 1e3 + 0.25  # the delay, one run ahead, this host's jitter
    assert max(loaded.batcher.waits) < bound, (list(loaded.batcher.waits), bound)
    assert max(loaded.batcher.stats()["sizes"]) > 1


def test_rows_of_different_shapes_never_merge(make, tmp_path):
    torch.manual_seed(3)
    engine = make(threads=True)
    model = Sequence().eval()
    loaded = load(engine, tmp_path, "seq", model, torch.randn(2, 3, 8),
                  {0: batch_dim(), 1: torch.export.Dim("time", min=1, max=16)})
    assert loaded.batcher is not None
    xs = [torch.randn(1, 3 if i % 2 else 5, 8) for i in range(16)]
    results = at_once(len(xs), lambda i: engine.infer("seq", (xs[i],)))
    for x, got in zip(xs, results, strict=True):
        assert not isinstance(got, Exception), got
        with torch.no_grad():
            torch.testing.assert_close(got[0], model(x), rtol=1e-4, atol=1e-5)
    # each bucket is one time length; their rows add up to the requests of that length
    for steps in (3, 5):
        assert all(shapes[0][1] in (3, 5) for shapes in loaded.variants)
        rows = [s[0][0] for s in loaded.variants if s[0][1] == steps]
        assert rows, loaded.variants.keys()


def test_models_whose_rows_mix_or_have_no_batch_are_not_batched(make, tmp_path):
    engine = make(threads=True)
    mixed = load(engine, tmp_path, "mixed", Centered(), torch.randn(2, 8), {0: batch_dim()})
    assert mixed.batcher is None
    assert "rows run together differ" in mixed.unbatched
    x = torch.randn(3, 8)
    torch.testing.assert_close(engine.infer("mixed", (x,))[0], Centered()(x))
    timed = load(engine, tmp_path, "timed", Sequence().eval(), torch.randn(2, 3, 8),
                 {1: torch.export.Dim("time", min=1, max=16)})
    assert timed.batcher is None and "no dynamic first dimension" in timed.unbatched
    off = load(engine, tmp_path, "off", Rows().eval(), torch.randn(2, 16), {0: batch_dim()},
               batching=Batching(1))
    assert off.batcher is None and off.unbatched == ""
    capped = load(engine, tmp_path, "capped", Rows().eval(), torch.randn(2, 16),
                  {0: batch_dim(high=4)}, batching=Batching(8))
    assert capped.batcher.settings.max_batch == 4  # never a batch past the exported range


def test_a_request_past_its_deadline_leaves_the_queue_alone(make, tmp_path):
    engine = make(threads=True)
    loaded = load(engine, tmp_path, "late", Rows().eval(), torch.randn(2, 16),
                  {0: batch_dim()}, batching=Batching(8, 500_000))
    x = torch.randn(1, 16)
    engine.infer("late", (x,))  # builds bucket 1; the model is now busy-looking: no idle rule
    model_ = engine.resolve(loaded, [("float32", (1, 16))])

    def call(i: int):  # noqa: ANN202
        time.sleep(0.05 * i)  # the patient one first: it leads, and waits out the delay
        deadline = time.monotonic() + (60 if i == 0 else 0.1)
        return engine.run(model_, [x], deadline=deadline)

    patient, hasty = at_once(2, call)
    assert isinstance(hasty, RunTimeout) and "batch queue" in str(hasty)
    assert not isinstance(patient, Exception), patient
    torch.testing.assert_close(patient[0], engine.infer("late", (x,))[0])


def test_a_batch_is_planned_at_its_own_size(tmp_path):
    """Each bucket is planned at its shapes: with a slow CPU and a fast accelerator that
    costs 10 ms a call, one row runs on the CPU and a merged batch of 64 on the accelerator;
    both answer like eager, and the plan says which bucket runs where."""
    slow = DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1], runtimes=["torch"],
                         peak_gflops={"fp32": 0.2}, mem_bw_gbs=20.0, link_bw_gbs=10.0,
                         link_latency_us=1.0, launch_us=1.0)
    wide = DeviceProfile(id="npu0", kind="npu", emulated=True, cores=CORES[-1:],
                         runtimes=["torch"], peak_gflops={"fp32": 10000.0},
                         mem_bw_gbs=1000.0, link_bw_gbs=10.0, link_latency_us=1.0,
                         launch_us=10_000.0)
    arena = Arena(f"{os.getpid()}-batplan")
    engine = Engine([slow, wide], tmp_path / "cache", arena)
    try:
        torch.manual_seed(4)
        model = MLP(width=256, depth=2).eval()  # 0.26 MFLOP a row
        ep = cuvild.export(model, (torch.randn(2, 256),), dynamic_shapes=({0: batch_dim()},))
        torch.export.save(ep, tmp_path / "planned.pt2")
        loaded = engine.prepare("planned", "planned", "1", tmp_path / "planned.pt2",
                                summarize(ep)["inputs"], batching=Batching(64, 1000))
        assert {p.device for p in loaded.plan.parts} == {"cpu0"}  # priced at the example's 2
        for rows in (1, 64):
            x = torch.randn(rows, 256)
            (got,) = engine.infer("planned", (x,))
            with torch.no_grad():
                torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
        where = {b["shapes"][0][0]: {p["device"] for p in b["parts"]}
                 for b in bucket_stats(loaded)}
        assert where == {1: {"cpu0"}, 64: {"npu0"}}, where
        assert loaded.variants[((64, 256),)].own_split
        assert not loaded.variants[((1, 256),)].own_split
    finally:
        engine.close()
        arena.close()
