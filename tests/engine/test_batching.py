"""Dynamic batching in the engine (cuvild/run/batching.py): concurrent requests merged into
one run and split back, each caller getting exactly its rows, on worker processes and threads;
client regions read and written per request; buckets built once; the delay bound; shapes that
differ never merge; failures and deadlines that stay with their request."""

from __future__ import annotations

import os
import struct
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_helpers import CORES, chunked_plan, close_all, device

import cuvild
from cuvild.client.samples import MLP
from cuvild.core.arena import SHM_DIR, Arena
from cuvild.core.errors import BadRegion, InferError, RunTimeout
from cuvild.core.layout import InputSpec, Slot
from cuvild.core.loaded import Batching, Bucket, Out, bucket_stats
from cuvild.engine.engine import Engine
from cuvild.intake.summary import summarize
from cuvild.run.batching import Batcher
from partitioner.profile import DeviceProfile
from protos.orders import RawTensor, TensorRef


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
                     workers="thread" if threads else "process")
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
            model_ = engine.runner.resolve(loaded, given)
            return engine.runner.run(model_, [RawTensor(xs[i].numpy().tobytes(), "float32",
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
    # two parts per bucket
    assert engine.builder.counters["built"] == 2 * len(loaded.family.buckets)
    assert engine.arena.in_use() == 0


def test_traced_requests_are_batched_and_get_their_batch_parts(make, tmp_path):
    """Traced, a request takes the path an untraced one takes: it is batched, and its
    timeline holds the parts of its batch's run."""
    torch.manual_seed(2)
    engine = make()
    model = Rows().eval()
    loaded = load(engine, tmp_path, "rows", model, torch.randn(2, 16), {0: batch_dim()},
                  devices=("cpu0", "npu0"))
    xs = [torch.randn(1, 16) for _ in range(6)]
    timelines: list[list] = [[] for _ in xs]

    def call(i: int):  # noqa: ANN202
        return engine.runner.run(engine.runner.resolve(loaded, [("float32", (1, 16))]),
                                 [xs[i]], timeline=timelines[i])

    for x, got in zip(xs, at_once(len(xs), call), strict=True):
        assert not isinstance(got, Exception), got
        with torch.no_grad():
            for out, ref in zip(got, model(x), strict=True):
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert max(loaded.batcher.stats()["sizes"]) > 1  # traced requests shared runs
    for timeline in timelines:
        assert [route.id for route, _, _ in timeline] == ["p0", "p1"], timeline
        assert all(sent <= answered for _, sent, answered in timeline)


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
            model_ = engine.runner.resolve(loaded, [("float32", (1, 16))])
            inp = TensorRef(region.name, 0, "float32", (1, 16), inode)
            out = {loaded.outputs[0]: TensorRef(region.name, 1024, "float32", (1, 16), inode)}
            return engine.runner.run_raw(model_, [inp], out)

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
    engine.builder.forget_segments(keys)


def test_a_request_waits_at_most_the_delay_and_the_run_ahead(make, tmp_path):
    """Requests one at a time to an idle model run at once, trickling or back to back from
    one client; clients that overlap wait for each other, never longer than the delay and
    the run ahead of them."""
    torch.manual_seed(2)
    engine = make()
    delay = 0.15
    loaded = load(engine, tmp_path, "trickle", Rows().eval(), torch.randn(2, 16),
                  {0: batch_dim()}, batching=Batching(64, int(delay * 1e6)))
    x = torch.randn(1, 16)
    for k in range(10):  # a trickle, then back to back: nobody else to wait for
        engine.infer("trickle", (x,))
        time.sleep(delay * 1.5 if k < 5 else 0)
    waits = list(loaded.batcher.waits)
    assert max(waits) < delay, waits  # never held for the delay (a loaded host's jitter aside)
    assert loaded.batcher.stats()["sizes"] == {1: 10}
    loaded.batcher.waits.clear()
    done: list[float] = []

    together = threading.Barrier(4)

    def client() -> None:
        together.wait(30)  # (a fast host ran one client's 6 requests before the next began)
        for _ in range(6):
            t0 = time.monotonic()
            engine.infer("trickle", (x,))
            done.append(time.monotonic() - t0)

    threads = []
    for _ in range(4):  # four clients at once: a batch cannot fill up, the delay ends it
        threads.append(threading.Thread(target=client))
        threads[-1].start()
    for t in threads:
        t.join(60)
    assert len(done) == 24
    runs = [ms for v in loaded.family.buckets.values() for r in v.routes for ms in r.measured_ms]
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
        assert all(shapes[0][1] in (3, 5) for shapes in loaded.family.buckets)
        rows = [s[0][0] for s in loaded.family.buckets if s[0][1] == steps]
        assert rows, loaded.family.buckets.keys()


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


class HeldEngine:
    """What a Batcher needs of the runner, with runs that wait for `go` and fail on the
    inputs in `bad`: queue states that real runs pass through too quickly to test."""

    def __init__(self) -> None:
        self.run_timeout_s, self.monitor = 60.0, None
        self.served = SimpleNamespace(  # loaded
            models={"m": SimpleNamespace(key="m", table=held_model(1).table)})
        self.go = threading.Event()
        self.bad: set[bytes] = set()
        self.broken = False  # merged runs fail with an error no engine run raises (a bug)

    def resolve(self, model, given, deadline):  # noqa: ANN001, ANN201
        return held_model(given[0][1][0])  # the bucket of the merged rows

    def execute(self, model, inputs, out, timeline, deadline):  # noqa: ANN001, ANN202
        into = out.into
        self.go.wait(30)
        if self.broken and into is not None:
            raise TypeError("a bug")
        data = [bytes(memoryview(i.data).cast("B")) for i in inputs]
        if any(self.bad & {d[k:k + 8] for k in range(0, len(d), 8)} for d in data):
            raise InferError("the part failed on these inputs")
        for place, d in zip(into or [], data, strict=False):
            place[:] = d
        return [] if into is not None else data


def held_model(rows: int) -> Any:
    """A bucket as the Batcher sees it: one float32 input of `rows` x 2, the output alike."""
    spec = InputSpec("x", "float32", (-1, 2), ((0, 1, 64),))
    return SimpleNamespace(key=f"m@{rows}", bucket=Bucket("m", ((rows, 2),)), table=[spec],
                           inputs=["x"], outputs=["y"], slots={"x": Slot("float32", (rows, 2)),
                                                              "y": Slot("float32", (rows, 2))})


def row(value: float) -> bytes:
    return struct.pack("<2f", value, value)


def held_run(batcher: Batcher, engine: HeldEngine, value: float, seconds: float,
             results: dict[float, Any]) -> None:
    try:
        results[value] = batcher.run(held_model(1),
                                     [RawTensor(row(value), "float32", (1, 2))], Out(raw=True),
                                     time.monotonic() + seconds)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        results[value] = e


def test_a_request_past_its_deadline_leaves_the_queue_alone():
    engine, batcher, results = HeldEngine(), None, {}
    batcher = Batcher("m", Batching(8, 0), engine)
    first = threading.Thread(target=held_run, args=(batcher, engine, 1.0, 60, results))
    first.start()
    time.sleep(0.1)  # its run holds the model: the next ones queue behind it
    hasty = threading.Thread(target=held_run, args=(batcher, engine, 2.0, 0.2, results))
    patient = threading.Thread(target=held_run, args=(batcher, engine, 3.0, 60, results))
    hasty.start()
    patient.start()
    hasty.join(10)
    assert isinstance(results[2.0], RunTimeout) and "batch queue" in str(results[2.0])
    engine.go.set()
    first.join(10)
    patient.join(10)
    assert results[1.0] == [row(1.0)]
    assert results[3.0] == [row(3.0)]  # the hasty one took nobody with it
    assert batcher.stats()["requests"] == 2 and batcher.stats()["queued"] == 0


@pytest.mark.parametrize("broken", [False, True], ids=["failing rows", "a bug"])
def test_a_failed_batch_is_run_again_one_request_at_a_time(broken):
    """A merged run that fails is run again request by request: only the request whose rows
    fail gets the error. An error that is no engine's (a bug) reaches every request of the
    batch: none is answered with nothing."""
    engine, batcher, results = HeldEngine(), None, {}
    batcher = Batcher("m", Batching(8, 0), engine)
    engine.bad, engine.broken = {row(2.0)}, broken
    first = threading.Thread(target=held_run, args=(batcher, engine, 1.0, 60, results))
    first.start()
    time.sleep(0.1)  # held: the next three queue, and then run together
    others = [threading.Thread(target=held_run, args=(batcher, engine, v, 60, results))
              for v in (2.0, 3.0, 4.0)]
    for t in others:
        t.start()
    time.sleep(0.1)
    engine.go.set()
    for t in [first, *others]:
        t.join(10)
    assert results[1.0] == [row(1.0)]  # (alone: no merged run)
    if broken:
        assert all(isinstance(results[v], TypeError) for v in (2.0, 3.0, 4.0)), results
        return
    assert isinstance(results[2.0], InferError) and "failed on these inputs" in str(results[2.0])
    for v in (1.0, 3.0, 4.0):
        assert results[v] == [row(v)], results
    assert batcher.stats()["sizes"][3] == 1  # the three did share a run first


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
        assert loaded.family.buckets[((64, 256),)].bucket.own_split
        assert not loaded.family.buckets[((1, 256),)].bucket.own_split
    finally:
        engine.close()
        arena.close()


class TimedEngine(HeldEngine):
    """Runs that take `run_s` each, whatever their rows."""

    def __init__(self, run_s: float) -> None:
        super().__init__()
        self.run_s = run_s
        self.go.set()

    def execute(self, model, inputs, out, timeline, deadline):  # noqa: ANN001, ANN202
        time.sleep(self.run_s)
        return super().execute(model, inputs, out, timeline, deadline)


def test_a_loop_of_clients_slower_to_come_back_than_the_delay_keeps_its_batches_whole():
    """Four clients, each sending again 3 ms after its answer, against a 1 ms delay and
    200 ms runs: the batch waits for the callers it just answered, and runs all four, where
    it used to run the three that came back in time and then the fourth alone, over and
    over. A request after a quiet spell still runs at once. (The runs are long so that a
    client thread descheduled on a busy host, as under three pytest workers on two cores,
    still comes back within the delay plus one run: with 60 ms runs it once did not.)"""
    engine = TimedEngine(0.2)
    batcher = Batcher("m", Batching(8, 1000), engine)

    def client(k: int) -> None:
        for i in range(6):
            held_run(batcher, engine, k * 10 + i, 60, {})
            time.sleep(0.003)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        # The first client runs alone at once (nobody in flight); the others queue during its
        # run, and the batch after it waits for it until the delay plus a run from the first
        # of them: started 50 ms apart, it has ~48 ms to come back (3 ms apart it had ~1 ms,
        # and on a busy host it once missed it: then {3: 6, 1: 6}, each batch of three
        # answered before the fourth returned, over and over).
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    sizes = batcher.stats()["sizes"]
    assert sum(rows * runs for rows, runs in sizes.items()) == 24
    assert sizes.get(4, 0) >= 4, sizes  # (before: {3: 6, 1: 6} or so)
    time.sleep(0.3)  # past the delay and a run: nobody is coming back
    batcher.waits.clear()
    results: dict[float, Any] = {}
    held_run(batcher, engine, 99.0, 60, results)
    assert results[99.0] == [row(99.0)]
    assert max(batcher.waits) < 0.03, list(batcher.waits)  # not held back for company
