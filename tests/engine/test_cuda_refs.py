"""Clients' CUDA regions read and written by the workers (cuvild/workers/cudamem.py), not staged
through the daemon's host memory (issue 50, 5). No GPU here: the handle's opener is one over
host memory, so what runs is everything but the CUDA calls: the name the daemon gives a
region, the request's references through the bells, a part that is not on a GPU copying its
input out once and its output in once, a part on a GPU (the worker said to be one) reading and
writing the region in place, the handle opened once per worker and closed when the region is
unregistered. The CUDA calls themselves run in the lease script (tests/gpu/check_daemon.py
`cuda_shm`)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from engine_helpers import CLOSE, device, eager, prepare

from cuvild.client.samples import MLP
from cuvild.core.arena import Arena
from cuvild.engine.engine import Engine
from cuvild.workers import cudamem
from cuvild.workers.clientmem import RegionGone
from protos.orders import TensorRef

HANDLE = bytes(range(64))


class HostMemory:
    """An opener over host memory, as open_ipc is over a client's device memory."""

    def __init__(self, size: int) -> None:
        self.memory = torch.zeros(size, dtype=torch.uint8)
        self.opened: list[tuple[int, bytes]] = []
        self.closed = 0

    def __call__(self, device_id: int, raw_handle: bytes):  # noqa: ANN204
        self.opened.append((device_id, raw_handle))
        return self.memory, self.close

    def close(self) -> None:
        self.closed += 1

    def at(self, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        n = 4 * torch.Size(shape).numel()
        return self.memory[offset:offset + n].view(torch.float32).view(shape)


def refuse(device_id: int, raw_handle: bytes):  # noqa: ANN201
    raise OSError("no such handle")


def test_a_regions_name_carries_its_device_and_handle() -> None:
    name = cudamem.name(3, HANDLE)
    assert cudamem.is_cuda(name) and not cudamem.is_cuda("cuvil-1-0")
    assert cudamem.parse(name) == (3, HANDLE)
    assert len(name.encode()) <= 255  # (a bell's name: NAME_MAX)
    for bad in (cudamem.PREFIX + "0:abcd", cudamem.PREFIX + "x:" + HANDLE.hex()):
        with pytest.raises(ValueError, match="not a CUDA region's name"):
            cudamem.parse(bad)


def test_objects_open_once_check_bounds_and_close_when_forgotten() -> None:
    host = HostMemory(64)
    objects = cudamem.CudaObjects(open_handle=host)
    name = cudamem.name(0, HANDLE)
    objects.write(torch.arange(4.0), name, 16, "float32", (4,))
    torch.testing.assert_close(host.at(16, (4,)), torch.arange(4.0))
    got = objects.read(name, 16, "float32", (2, 2))
    torch.testing.assert_close(got, torch.arange(4.0).view(2, 2))
    got += 1  # a copy: the region is untouched
    torch.testing.assert_close(host.at(16, (4,)), torch.arange(4.0))
    with pytest.raises(RegionGone, match="offset 56 \\+ 16 bytes is outside its 64 bytes"):
        objects.tensor(name, 56, "float32", (4,))
    with pytest.raises(RegionGone, match="did not open here: OSError: no such handle"):
        cudamem.CudaObjects(open_handle=refuse).tensor(name, 0, "float32", (4,))
    assert host.opened == [(0, HANDLE)]  # once, whatever the uses
    objects.forget({name, "cuvil-1-0"})
    assert host.closed == 1 and not objects.open


@pytest.fixture
def engine(tmp_path):  # noqa: ANN001, ANN201
    arena = Arena(f"{os.getpid()}-cudaref")
    made = Engine([device("cpu0")], tmp_path / "cache", arena, workers="thread")
    yield made
    made.close()
    arena.close()


@pytest.mark.parametrize("on_gpu", [False, True], ids=["copied", "in-place"])
def test_a_request_in_a_cuda_region_is_read_and_answered_there(engine, tmp_path,  # noqa: ANN001
                                                               on_gpu: bool) -> None:
    torch.manual_seed(0)
    model, x = MLP(width=16, depth=2).eval(), torch.randn(3, 16)
    loaded = prepare(engine, tmp_path, "mlp", model, (x,), ["cpu0"])
    host = HostMemory(1024)
    worker = engine.workers["cpu0"].worker
    worker.cuda, worker.on_gpu = cudamem.CudaObjects(open_handle=host), on_gpu
    name = cudamem.name(0, HANDLE)
    host.at(0, (3, 16))[:] = x
    src, dst = (TensorRef(name, 0, "float32", (3, 16)),
                TensorRef(name, 512, "float32", tuple(eager(model, x).shape)))
    for _ in range(2):
        assert engine.runner.run(loaded, [src], {loaded.outputs[0]: dst}) == [None]
        torch.testing.assert_close(host.at(512, dst.shape), eager(model, x), **CLOSE)
        host.at(512, dst.shape).zero_()
    assert host.opened == [(0, HANDLE)]
    assert engine.arena.in_use() == 0
    engine.builder.forget_segments([(name, 0)])  # the region unregistered (no reply awaited)
    deadline = time.monotonic() + 10
    while host.closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host.closed == 1 and not worker.cuda.open
