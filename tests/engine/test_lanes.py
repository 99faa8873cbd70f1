"""Lanes (cuvild/run/lanes.py): a one-part model's requests with raw inputs go to its
worker process through a session of the engine's own, and still meet every promise of the
usual path: eager's outputs, each caller its own rows, a deadline, a retry on a worker that
died, nothing left behind on unload."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

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
from cuvild.engine.arena import Arena
from cuvild.engine.engine import BadRegion, Engine, RunTimeout
from protos.orders import RawTensor


@pytest.fixture
def make_engine(tmp_path):
    made: list[tuple[Engine, Arena]] = []

    def make(**kwargs) -> Engine:
        arena = Arena(f"{os.getpid()}-lanes{len(made)}")
        engine = Engine([device("cpu0"), device("npu0")], tmp_path / "cache", arena, **kwargs)
        made.append((engine, arena))
        return engine

    yield make
    close_all(made)


def served(make_engine, tmp_path, devices=("cpu0",), **kwargs):  # noqa: ANN001, ANN201
    engine = make_engine(**kwargs)
    torch.manual_seed(0)
    model, x = MLP(width=64, depth=2).eval(), torch.randn(3, 64)
    loaded = prepare(engine, tmp_path, "mlp", model, (x,), list(devices))
    return engine, loaded, model


def raw(x: torch.Tensor) -> RawTensor:
    return RawTensor(x.numpy().tobytes(), "float32", tuple(x.shape))


def result(engine: Engine, loaded, x: torch.Tensor, **kwargs) -> torch.Tensor:  # noqa: ANN001
    (data,) = engine.run(loaded, [raw(x)], raw=True, **kwargs)
    return torch.from_numpy(np.frombuffer(data, np.float32).reshape(3, 64).copy())


def lanes(engine: Engine) -> int:
    return sum(len(v) for v in engine.lanes.idle().values())


def test_raw_requests_to_one_part_take_a_lane_and_no_arena_block(make_engine, tmp_path):
    engine, loaded, model = served(make_engine, tmp_path)
    before = len(loaded.routes[0].measured_ms)
    for _ in range(3):
        x = torch.randn(3, 64)
        torch.testing.assert_close(result(engine, loaded, x), eager(model, x), **CLOSE)
        assert engine.arena.in_use() == 0
    assert lanes(engine) == 1  # one lane, taken and given back three times
    assert len(loaded.routes[0].measured_ms) == before + 3  # the worker's run times
    # Tensors (a caller in this process) and several parts take the usual way.
    x = torch.randn(3, 64)
    torch.testing.assert_close(engine.infer("mlp", (x,))[0], eager(model, x), **CLOSE)
    assert lanes(engine) == 1


def test_a_traced_request_takes_a_lane_and_gets_its_timeline(make_engine, tmp_path):
    """Traced, a request takes the path an untraced one takes: the lane, with its ring."""
    engine, loaded, model = served(make_engine, tmp_path)
    timeline: list = []
    x = torch.randn(3, 64)
    torch.testing.assert_close(result(engine, loaded, x, timeline=timeline), eager(model, x),
                               **CLOSE)
    assert lanes(engine) == 1 and engine.arena.in_use() == 0  # a lane, no arena block
    ((route, rung, answered),) = timeline
    assert route is loaded.routes[0] and rung <= answered


def test_client_region_requests_take_a_lane_too(make_engine, tmp_path):
    """Inputs and outputs in a client's region (OIP shared memory) take a lane: the daemon
    reads the inputs into the slot and writes the outputs into the region, mapping neither;
    a region shrunk under its request fails that request alone, and the lane serves on."""
    engine, loaded, model = served(make_engine, tmp_path)
    with client_region(engine) as (region, inp, out_ref):
        out = {loaded.outputs[0]: out_ref}
        for _ in range(3):
            x = torch.randn(3, 64)
            region.buf[:x.numel() * 4] = x.numpy().tobytes()
            assert engine.run(loaded, [inp], out, raw=True) == [None]
            got = np.frombuffer(region.buf, np.float32)[3 * 64:].reshape(3, 64).copy()
            torch.testing.assert_close(torch.from_numpy(got), eager(model, x), **CLOSE)
            assert engine.arena.in_use() == 0
        assert lanes(engine) == 1
        shrink(region, 64)
        with pytest.raises(BadRegion, match="is 64 bytes now"):
            engine.run(loaded, [inp], out, raw=True)
        x = torch.randn(3, 64)
        torch.testing.assert_close(result(engine, loaded, x), eager(model, x), **CLOSE)
        assert lanes(engine) == 1  # the same lane: a bad region is not a lost worker


def test_several_parts_or_a_worker_thread_take_no_lane(make_engine, tmp_path):
    for devices, kwargs in ((("cpu0", "npu0"), {}), (("cpu0",), {"in_process": True})):
        where = tmp_path / str(len(devices))
        where.mkdir()
        engine, loaded, model = served(make_engine, where, devices, **kwargs)
        x = torch.randn(3, 64)
        torch.testing.assert_close(result(engine, loaded, x), eager(model, x), **CLOSE)
        assert lanes(engine) == 0


def test_concurrent_requests_each_get_their_own_rows(make_engine, tmp_path):
    engine, loaded, model = served(make_engine, tmp_path, max_in_flight=4)
    inputs = [torch.randn(3, 64) for _ in range(80)]
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda x: result(engine, loaded, x), inputs))
    for x, out in zip(inputs, outs, strict=True):
        torch.testing.assert_close(out, eager(model, x), **CLOSE)
    assert 1 <= lanes(engine) <= 4  # at most the requests in flight


def test_a_worker_killed_under_a_lane_is_retried_the_usual_way(make_engine, tmp_path):
    engine, loaded, model = served(make_engine, tmp_path)
    result(engine, loaded, torch.randn(3, 64))
    pid = engine.workers["cpu0"].process.pid
    os.kill(pid, signal.SIGSTOP)  # the request is surely in the worker when it dies
    x = torch.randn(3, 64)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(result, engine, loaded, x)
        time.sleep(0.3)
        assert not pending.done()
        os.kill(pid, signal.SIGKILL)
        torch.testing.assert_close(pending.result(60), eager(model, x), **CLOSE)
    assert engine.workers["cpu0"].restarts == 1
    y = torch.randn(3, 64)  # a new lane, to the restarted worker
    torch.testing.assert_close(result(engine, loaded, y), eager(model, y), **CLOSE)
    assert lanes(engine) == 1


def test_a_lane_past_its_deadline_times_out_and_is_dropped(make_engine, tmp_path):
    engine, loaded, model = served(make_engine, tmp_path)
    result(engine, loaded, torch.randn(3, 64))
    pid = engine.workers["cpu0"].process.pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RunTimeout, match="part p0 on cpu0"):
        result(engine, loaded, torch.randn(3, 64), deadline=time.monotonic() + 1.0)
    assert time.monotonic() - t0 < 3.0
    assert lanes(engine) == 0  # its late answer would be nobody's
    os.kill(pid, signal.SIGCONT)
    x = torch.randn(3, 64)
    torch.testing.assert_close(result(engine, loaded, x), eager(model, x), **CLOSE)


def test_unload_ends_the_lanes_and_their_sessions_in_the_worker(make_engine, tmp_path):
    engine, loaded, _ = served(make_engine, tmp_path)
    result(engine, loaded, torch.randn(3, 64))
    (lane,) = engine.lanes.idle()["mlp"]
    engine.unload("mlp")
    assert lanes(engine) == 0
    deadline = time.monotonic() + 10
    while not lane.ended.done():  # the worker saw the lane close and let its part go
        assert time.monotonic() < deadline, "the worker kept the lane's session"
        time.sleep(0.02)


def test_a_worker_hung_under_a_patient_request_is_restarted(make_engine, tmp_path):
    """A request that gave the engine its whole run_timeout_s and got no answer takes the
    worker as hung: it is killed and restarted, and serving goes on."""
    engine, loaded, model = served(make_engine, tmp_path)
    result(engine, loaded, torch.randn(3, 64))
    hang_under_a_patient_request(engine, "cpu0", lambda: result(engine, loaded,
                                                                torch.randn(3, 64)), "part p0")
    x = torch.randn(3, 64)
    torch.testing.assert_close(result(engine, loaded, x), eager(model, x), **CLOSE)
    assert engine.workers["cpu0"].restarts == 1
