"""What the OIP tests share: the models served, how to wait for them, small request helpers.
The daemon they run against is the `env` fixture (conftest.py)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from daemons import DaemonProcess
from tritonclient.utils import InferenceServerException

from cuvild.client import Client

READY_TIMEOUT_S = 240.0
# The `hardened` daemon's small limits (conftest.py): the hardening and fuzz tests reach them.
LIMITS = {"rpc_threads": 8, "upload_idle_s": 1.5, "max_connections_per_uid": 16,
          "idle_timeout_s": 3}
SHM_DIR = Path("/dev/shm")
KEY_PREFIX = f"oiptest-{os.getpid()}-"  # this test's own regions: never "cuvil-<pid>-"


class Pair(torch.nn.Module):
    """Two inputs and two outputs: a request may put some in shared memory, others raw."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(a) + b, torch.relu(a) * 2.0


@dataclass
class Served:
    name: str
    inputs: list[np.ndarray]
    expected: np.ndarray  # the first output
    input_names: list[str] = field(default_factory=list)
    output_name: str = ""
    all_expected: list[np.ndarray] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)


@dataclass
class Env:
    daemon: DaemonProcess
    models: dict[str, Served]
    keys: list[str] = field(default_factory=list)  # every shm key this module created


def served_model(name: str, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Served:
    with torch.inference_mode():
        out = model(*inputs)
    outs = [t.numpy().copy() for t in (out if isinstance(out, tuple) else (out,))]
    return Served(name, [t.numpy().copy() for t in inputs], outs[0], all_expected=outs)


def wait_ready(client: Client, names: set[str], daemon: DaemonProcess) -> None:
    """Models prepare in the background: wait until none of them is loading."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = {m["name"]: m["state"] for m in client.status()["models"]}
        if names <= set(states) and not any(states[n] == "loading" for n in names):
            break
        time.sleep(0.2)
    bad = {n: states.get(n) for n in names if states.get(n) != "ready"}
    assert not bad, f"models not ready: {bad}\n{daemon.log()[-4000:]}"


def rel_error(got: np.ndarray, expected: np.ndarray) -> float:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-12))


def raw_infer(triton: grpcclient.InferenceServerClient, served: Served) -> np.ndarray:
    inputs = []
    for name, value in zip(served.input_names, served.inputs, strict=True):
        inp = grpcclient.InferInput(name, list(value.shape), "FP32")
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    result = triton.infer(served.name, inputs,
                          outputs=[grpcclient.InferRequestedOutput(served.output_name)])
    return result.as_numpy(served.output_name)


def refused(call: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value


def status_of(err: InferenceServerException) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.status().removeprefix("StatusCode."))


def one_input(served: Served, name: str | None = None, value: np.ndarray | None = None,
              datatype: str = "FP32") -> grpcclient.InferInput:
    value = served.inputs[0] if value is None else value
    inp = grpcclient.InferInput(name or served.input_names[0], list(value.shape), datatype)
    inp.set_data_from_numpy(value)
    return inp


def shm_input(served: Served, regions: Callable[..., Any]) -> grpcclient.InferInput:
    x = served.inputs[0]
    name, _, handle = regions(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    inp = grpcclient.InferInput(served.input_names[0], list(x.shape), "FP32")
    inp.set_shared_memory(name, x.nbytes)
    return inp


# -- another user on the same host ----------------------------------------------------------
NOBODY = 65534
# Per-thread credential syscalls (glibc's wrappers would change every thread of the process).
SYSCALLS = {"x86_64": (117, 122), "aarch64": (147, 151)}  # setresuid, setfsuid


def connect_as(uid: int, path: str) -> socket.socket:
    """A unix connection whose SO_PEERCRED says `uid`: connect from a thread whose effective
    uid is `uid` (its file-system uid stays root, to reach the socket's private directory)."""
    libc = ctypes.CDLL(None, use_errno=True)
    setresuid, setfsuid = SYSCALLS[os.uname().machine]
    result: dict[str, Any] = {}

    def connect() -> None:
        if libc.syscall(setresuid, -1, uid, -1) != 0:
            result["error"] = OSError(ctypes.get_errno(), "setresuid")
            return
        try:
            libc.syscall(setfsuid, 0)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            result["sock"] = sock
        except OSError as e:
            result["error"] = e
        finally:
            assert libc.syscall(setresuid, -1, 0, -1) == 0

    thread = threading.Thread(target=connect)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["sock"]


def relay(conn: socket.socket, tmp_path: Path) -> str:
    """A gRPC target whose first connection is relayed over `conn`."""
    path = str(tmp_path / "as-other-user.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        client, _ = listener.accept()
        listener.close()
        threading.Thread(target=pump, args=(client, conn), daemon=True).start()
        pump(conn, client)

    threading.Thread(target=serve, daemon=True).start()
    return f"unix:{path}"


AS_OTHER_USER = os.getuid() == 0 and os.uname().machine in SYSCALLS
