"""Bells (cuvild/run/bells.py): the parts of a model, one part or several, on worker
processes or threads, are rung through their records in shared memory (the engine's one way
to run a part), and every promise of the request path holds: eager's outputs whatever the
inputs are (raw bytes, tensors, client regions read in place by a process, through their
descriptors by a thread), each caller its own rows, a retry on a worker that died, a deadline
that frees the block only once the late part is done, nothing left behind on unload."""

from __future__ import annotations

import mmap
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch
from engine_helpers import (
    CLOSE,
    client_region,
    close_all,
    device,
    eager,
    hang_under_a_patient_request,
    prepare,
    shrink,
)

from cuvild.client.samples import MLP
from cuvild.core.arena import SHM_DIR, Arena
from cuvild.core.errors import BadRegion, RunTimeout
from cuvild.engine.engine import Engine
from protos.orders import RawTensor, TensorRef
from protos.shared import STATS, bell_bytes


def served(tmp_path, devices: list[str], threads: bool = False):  # noqa: ANN201
    """An MLP in two parts, cpu0 then npu0, or one part on npu0: (engine, loaded, model)."""
    arena = Arena(f"{os.getpid()}-bells")
    engine = Engine([device("cpu0"), device("npu0")], tmp_path / "cache", arena,
                    max_in_flight=4,
                    workers="thread" if threads else "process")
    torch.manual_seed(0)
    model = MLP(width=64, depth=2).eval()
    loaded = prepare(engine, tmp_path, "mlp", model, (torch.randn(3, 64),), devices)
    assert [r.device for r in loaded.routes] == devices
    return engine, loaded, model, arena


LAYOUTS = {"split": ["cpu0", "npu0"], "one-part": ["npu0"]}


@pytest.fixture(params=list(LAYOUTS))
def split(tmp_path, request):
    """Each part on a worker process (the tests that stop or kill one)."""
    engine, loaded, model, arena = served(tmp_path, LAYOUTS[request.param])
    yield engine, loaded, model
    close_all([(engine, arena)])


@pytest.fixture(params=[(k, w) for w in ("process", "thread") for k in LAYOUTS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def workers(tmp_path, request):
    """Each part on a worker process, or on a worker thread (`engine.workers: thread`)."""
    layout, kind = request.param
    engine, loaded, model, arena = served(tmp_path, LAYOUTS[layout], kind == "thread")
    yield engine, loaded, model
    close_all([(engine, arena)])


def raw(engine: Engine, loaded, x: torch.Tensor, **kwargs) -> torch.Tensor:  # noqa: ANN001
    (data,) = engine.runner.run_raw(
        loaded, [RawTensor(x.numpy().tobytes(), "float32", tuple(x.shape))], **kwargs)
    return torch.from_numpy(np.frombuffer(data, np.float32).reshape(x.shape).copy())


def idle_sets(engine: Engine) -> int:
    return sum(len(v) for v in engine.runner.bells.idle().values())


def test_parts_are_rung_for_raw_inputs_tensors_and_client_regions(workers):
    """Client regions are named in the record; a worker process maps them, a thread reads
    and writes them through their descriptors."""
    engine, loaded, model = workers
    before = [len(r.measured_ms) for r in loaded.routes]
    for _ in range(3):
        x = torch.randn(3, 64)
        torch.testing.assert_close(raw(engine, loaded, x), eager(model, x), **CLOSE)
        y = torch.randn(3, 64)
        torch.testing.assert_close(engine.infer("mlp", (y,))[0], eager(model, y), **CLOSE)
    assert idle_sets(engine) == 1  # one set of bells, a bell per part, taken six times
    assert [len(r.measured_ms) - b for r, b in zip(loaded.routes, before,
                                                   strict=True)] == [6] * len(loaded.routes)
    assert engine.arena.in_use() == 0

    with client_region(engine) as (region, inp, out_ref):
        out = {loaded.outputs[0]: out_ref}
        x = torch.randn(3, 64)
        region.buf[:x.numel() * 4] = x.numpy().tobytes()
        assert engine.runner.run_raw(loaded, [inp], out) == [None]
        got = np.frombuffer(region.buf, np.float32)[3 * 64:].reshape(3, 64).copy()
        torch.testing.assert_close(torch.from_numpy(got), eager(model, x), **CLOSE)
        shrink(region, 64)  # under the next request
        with pytest.raises(BadRegion, match="is 64 bytes now"):
            engine.runner.run_raw(loaded, [inp], out)
    x = torch.randn(3, 64)  # a bad region is not a lost worker: the same bells serve on
    torch.testing.assert_close(raw(engine, loaded, x), eager(model, x), **CLOSE)
    assert idle_sets(engine) == 1 and engine.arena.in_use() == 0


class Sum(torch.nn.Module):
    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.stack(xs).sum(0) * 2


@pytest.mark.parametrize("threads", [False, True], ids=["process", "thread"])
def test_a_record_holds_every_tensor_of_its_part_at_the_longest_names(tmp_path, threads):
    """13 inputs and the output in a client's object named 240 bytes long: more than a
    page of record, which used to send the part as a pickled order instead."""
    arena = Arena(f"{os.getpid()}-bells")
    engine = Engine([device("npu0")], tmp_path / "cache", arena,
                    workers="thread" if threads else "process")
    try:
        xs = tuple(torch.randn(3, 8) for _ in range(13))
        loaded = prepare(engine, tmp_path, "sum", Sum().eval(), xs, ["npu0"])
        assert bell_bytes(14) > mmap.PAGESIZE
        each = 3 * 8 * 4
        region = shared_memory.SharedMemory(name=f"cuvil-test-{os.getpid()}-".ljust(240, "x"),
                                            create=True, size=14 * each)
        inode = os.stat(SHM_DIR / region.name).st_ino
        try:
            for i, x in enumerate(xs):
                region.buf[i * each:(i + 1) * each] = x.numpy().tobytes()
            refs = [TensorRef(region.name, i * each, "float32", (3, 8), inode) for i in range(14)]
            assert engine.runner.run(loaded, refs[:13], {loaded.outputs[0]: refs[13]}) == [None]
            got = np.frombuffer(region.buf, np.float32)[13 * 24:].reshape(3, 8).copy()
            torch.testing.assert_close(torch.from_numpy(got), Sum()(*xs), **CLOSE)
            ((bell,),) = [list(bells.values()) for bells in engine.runner.bells.idle()["sum"]]
            assert STATS.unpack_from(bell.stats)[0] == 1  # its worker ran it, rung
            assert engine.arena.in_use() == 0
        finally:
            region.close()
            region.unlink()
            engine.builder.forget_segments([(region.name, inode)])
    finally:
        close_all([(engine, arena)])


def test_a_traced_request_is_rung_and_gets_its_timeline(workers):
    engine, loaded, model = workers
    timeline: list = []
    x = torch.randn(3, 64)
    (out,) = engine.runner.run(loaded, [x], timeline=timeline)
    torch.testing.assert_close(out, eager(model, x), **CLOSE)
    assert [route.id for route, _, _ in timeline] == [r.id for r in loaded.routes]
    assert all(dispatched <= replied for _, dispatched, replied in timeline)


def test_concurrent_requests_each_get_their_own_rows(workers):
    engine, loaded, model = workers
    inputs = [torch.randn(3, 64) for _ in range(60)]
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda x: raw(engine, loaded, x), inputs))
    for x, out in zip(inputs, outs, strict=True):
        torch.testing.assert_close(out, eager(model, x), **CLOSE)
    assert 1 <= idle_sets(engine) <= 4  # at most the requests in flight
    assert engine.arena.in_use() == 0


def test_a_worker_killed_under_a_bell_is_retried(split):
    engine, loaded, model = split
    raw(engine, loaded, torch.randn(3, 64))
    pid = engine.workers["npu0"].process.pid
    os.kill(pid, signal.SIGSTOP)  # the request is surely in the second part when it dies
    x = torch.randn(3, 64)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(raw, engine, loaded, x)
        time.sleep(0.3)
        assert not pending.done()
        os.kill(pid, signal.SIGKILL)
        torch.testing.assert_close(pending.result(60), eager(model, x), **CLOSE)
    assert engine.workers["npu0"].restarts == 1
    y = torch.randn(3, 64)  # new bells, to the restarted worker
    torch.testing.assert_close(raw(engine, loaded, y), eager(model, y), **CLOSE)
    assert idle_sets(engine) == 1


def test_a_part_past_the_deadline_holds_the_block_until_it_answers(split):
    engine, loaded, model = split
    raw(engine, loaded, torch.randn(3, 64))
    pid = engine.workers["npu0"].process.pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RunTimeout, match=f"part {loaded.routes[-1].id} on npu0"):
        raw(engine, loaded, torch.randn(3, 64), deadline=time.monotonic() + 1.0)
    assert time.monotonic() - t0 < 3.0
    assert idle_sets(engine) == 0  # its late answer would be nobody's
    assert engine.arena.in_use() > 0  # the stopped part may still write the block
    os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while engine.arena.in_use():
        assert time.monotonic() < deadline, "the block was never given back"
        time.sleep(0.02)
    x = torch.randn(3, 64)
    torch.testing.assert_close(raw(engine, loaded, x), eager(model, x), **CLOSE)


def test_unload_ends_the_bells_in_the_workers(workers):
    engine, loaded, _ = workers
    raw(engine, loaded, torch.randn(3, 64))
    (bells,) = engine.runner.bells._idle["mlp"]  # noqa: SLF001 - white-box: the test reads _idle
    engine.builder.unload("mlp")
    assert idle_sets(engine) == 0
    deadline = time.monotonic() + 10
    while not all(b.ended.done() for b in bells.values()):  # the workers let them go
        assert time.monotonic() < deadline, "a worker kept a bell"
        time.sleep(0.02)


def test_a_worker_hung_under_a_patient_request_is_restarted(split):
    engine, loaded, model = split
    raw(engine, loaded, torch.randn(3, 64))
    hang_under_a_patient_request(engine, "npu0", lambda: raw(engine, loaded,
                                                             torch.randn(3, 64)),
                                 f"part {loaded.routes[-1].id}")
    x = torch.randn(3, 64)
    torch.testing.assert_close(raw(engine, loaded, x), eager(model, x), **CLOSE)
    assert engine.workers["npu0"].restarts == 1
    deadline = time.monotonic() + 10
    while engine.arena.in_use():  # the killed part's block is given back
        assert time.monotonic() < deadline, "the block was never given back"
        time.sleep(0.02)
