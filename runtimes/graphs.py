"""A static-shape GPU part run as one CUDA graph: its ~40 kernels launched by one replay
instead of one by one from Python (on the lent H200 a resnet18 b1 part cost 2.2 ms, 43
kernels at ~48 us each through inductor's wrapper, against a 0.09 ms roofline).

`Graphed` owns static input buffers on the device (at the compute dtype), the graph captured
over them, and its static outputs (cast back to the caller's dtype inside the graph). A run
copies the inputs into the static buffers without blocking (the host tensors are pinned or
in a CUDA-registered arena segment: DMA), replays, copies each output into the place the
caller gave (an arena view) or a fresh host tensor, and synchronises once.

The capture runs on the thread that first runs the part (the worker's, not the build's),
after warm-up runs on a side stream as torch.cuda.graphs asks; inductor's parts allocate
their intermediates from the graph's private pool. Only static shapes (a dynamic-shape
model's bucket is a part of its own, so each bucket has its graph). `capture` is injectable:
the tests drive the buffers and copies on the CPU with a plain function standing in for a
graph (`replay` calls it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "CUVILD_CUDA_GRAPHS"  # "0": no part runs as a CUDA graph (devices.gpu.cuda_graphs)
WARMUP = 3  # runs on a side stream before the capture (cuBLAS workspaces, autotuning)


def wanted() -> bool:
    """Whether CUDA graphs are on for this process (the daemon sets ENV from its config)."""
    return os.environ.get(ENV, "1") != "0"


class Captured:
    """What `capture` returns: something to `replay`, and the outputs it writes."""

    def __init__(self, replay: Callable[[], Any], outputs: Sequence[torch.Tensor]) -> None:
        self.replay = replay
        self.outputs = list(outputs)


def cuda_capture(step: Callable[[], Sequence[torch.Tensor]], device: torch.device) -> Captured:
    """`step` warmed up on a side stream, then captured into a CUDA graph on this thread."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = step()
    return Captured(graph.replay, outputs)


def plain_capture(step: Callable[[], Sequence[torch.Tensor]], device: torch.device) -> Captured:
    """No graph: `replay` runs the step again (its outputs then are the last step's). For the
    tests of the buffers and copies, on a host without CUDA."""
    held = Captured(lambda: None, step())

    def replay() -> None:
        for kept, new in zip(held.outputs, step(), strict=True):
            kept.copy_(new)
    held.replay = replay
    return held


class Graphed:
    """A compiled function over `weights` + inputs of fixed shapes, run as one graph."""

    def __init__(self, fn: Callable[..., Any], weights: Sequence[torch.Tensor],
                 example_inputs: Sequence[torch.Tensor], device: torch.device,
                 compute: torch.dtype, out_dtype: torch.dtype,
                 capture: Callable[..., Captured] = cuda_capture) -> None:
        self.device = device
        self.static = [torch.empty(t.shape, device=device,
                                   dtype=compute if t.is_floating_point() else t.dtype)
                       for t in example_inputs]
        for buffer, t in zip(self.static, example_inputs, strict=True):
            buffer.copy_(t)

        def step() -> list[torch.Tensor]:
            outs = fn(*weights, *self.static)
            outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
            return [o.to(out_dtype) if o.dtype == compute != out_dtype else o for o in outs]

        self.captured = capture(step, device)

    def run(self, inputs: Sequence[torch.Tensor],
            places: Sequence[Any] | None = None) -> list[torch.Tensor]:
        """Outputs for `inputs`, written into `places` where given (host tensors of the
        outputs' shapes and dtypes: the arena's views), else into fresh host tensors."""
        if len(inputs) != len(self.static):
            raise ValueError(f"the part takes {len(self.static)} inputs, got {len(inputs)}")
        for buffer, t in zip(self.static, inputs, strict=True):
            if tuple(t.shape) != tuple(buffer.shape):
                raise ValueError(f"input shape {tuple(t.shape)} != the graph's "
                                 f"{tuple(buffer.shape)} (a CUDA graph's shapes are fixed)")
            buffer.copy_(t, non_blocking=True)
        self.captured.replay()
        results = []
        for i, out in enumerate(self.captured.outputs):
            place = places[i] if places is not None else None
            if not (isinstance(place, torch.Tensor) and place.shape == out.shape
                    and place.dtype == out.dtype and place.device.type == "cpu"):
                place = torch.empty(out.shape, dtype=out.dtype)
            results.append(place.copy_(out, non_blocking=True))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return results
