"""What the OIP tests share: the models served, how to wait for them, small request helpers.
The daemon they run against is the `env` fixture (conftest.py)."""

from __future__ import annotations

import os
import sys
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
from tritonclient.utils import InferenceServerException

from cuvild.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: daemons.py
from daemons import DaemonProcess  # noqa: E402

READY_TIMEOUT_S = 240.0
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
