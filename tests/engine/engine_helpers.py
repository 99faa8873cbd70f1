"""What the engine tests share: emulated devices on this host's cores, and a model prepared
with a fixed plan (contiguous chunks of the graph, one per device)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

import cuvild
from cuvild.core.arena import SHM_DIR, Arena
from cuvild.engine.engine import Engine
from cuvild.intake.summary import summarize
from partitioner.plan import Part, Plan
from partitioner.profile import DeviceProfile
from protos.orders import TensorRef

CORES = sorted(os.sched_getaffinity(0))
CLOSE = {"rtol": 1e-4, "atol": 1e-5}  # outputs against torch eager


def eager(model, *inputs):  # noqa: ANN001, ANN201
    with torch.no_grad():
        return model(*inputs)


def device(dev_id: str) -> DeviceProfile:
    """cpu0 on the first core; npuN emulated (torch) on the last."""
    if dev_id.startswith("cpu"):
        return DeviceProfile(id=dev_id, kind="cpu", cores=CORES[:1], runtimes=["torch"])
    return DeviceProfile(id=dev_id, kind="npu", emulated=True, cores=CORES[-1:],
                         runtimes=["torch"])


def chunked_plan(ep, devices: list[str]) -> Plan:  # noqa: ANN001
    """Contiguous chunks of the graph, one per device: always an acyclic plan."""
    nodes = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    k = len(devices)
    parts = [Part(f"p{i}", dev, "", "fp32", nodes[i * len(nodes) // k:(i + 1) * len(nodes) // k],
                  0.0) for i, dev in enumerate(devices)]
    return Plan(parts=parts, cuts=[], predicted_ms=0.0, peak_bytes={})


def prepare(engine: Engine, tmp: Path, name: str, model, inputs, devices: list[str],  # noqa: ANN001
            dynamic_shapes=None):  # noqa: ANN001, ANN201
    ep = cuvild.export(model, inputs, dynamic_shapes=dynamic_shapes)
    path = tmp / f"{name}.pt2"
    torch.export.save(ep, path)
    return engine.prepare(name, name, "1", path, summarize(ep)["inputs"],
                          plan=chunked_plan(ep, devices))


def close_all(made: list[tuple[Engine, Arena]]) -> None:
    """Close the engines and arenas a test made, waking any worker it left stopped."""
    for engine, arena in made:
        for handle in engine.workers.values():
            if not handle.threaded and handle.process.pid:
                try:
                    os.kill(handle.process.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        engine.close()
        arena.close()


def hang_under_a_patient_request(engine: Engine, device: str, send: Callable[[], object],
                                 says: str) -> None:
    """Stop `device`'s worker under a request that gives the engine its whole run_timeout_s
    (1 s here): RunTimeout saying `says` and that the worker is being restarted."""
    from cuvild.core.errors import RunTimeout

    engine.runner.run_timeout_s = 1.0
    os.kill(engine.workers[device].process.pid, signal.SIGSTOP)
    with pytest.raises(RunTimeout, match=f"{says}.* stopped and is being restarted"):
        send()  # no deadline of its own: patient
    engine.runner.run_timeout_s = 60.0  # (the restart rebuilds its parts: seconds)


@contextlib.contextmanager
def client_region(engine: Engine, rows: int = 3, width: int = 64) -> Iterator[
        tuple[shared_memory.SharedMemory, TensorRef, TensorRef]]:
    """A client's object holding a float32 (rows, width) input, then room for the output of
    that shape: (the object, the input's ref, the output's ref); removed, and forgotten by
    the engine's workers, after."""
    nbytes = rows * width * 4
    region = shared_memory.SharedMemory(create=True, size=2 * nbytes)
    inode = os.stat(SHM_DIR / region.name).st_ino
    try:
        yield (region, TensorRef(region.name, 0, "float32", (rows, width), inode),
               TensorRef(region.name, nbytes, "float32", (rows, width), inode))
    finally:
        region.close()
        region.unlink()
        engine.builder.forget_segments([(region.name, inode)])


def shrink(region: shared_memory.SharedMemory, nbytes: int) -> None:
    """Shrink a client's object under the daemon (its next request must fail alone)."""
    fd = os.open(SHM_DIR / region.name, os.O_RDWR)
    os.ftruncate(fd, nbytes)
    os.close(fd)
