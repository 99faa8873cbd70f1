"""What one call and each kernel of a compiled part cost, timed through the runtime's own
`run` (host tensors in and out, as a worker calls it): the cost model's prior for a part of
any kernel count (partitioner/corrections.py `prior`), measured at profiling time instead of
taken from an eager op's queueing rate (on the lent H200 `torch.add` queued at 11 us while
inductor's parts cost ~48 us a kernel).

Two parts of the same shape are compiled, one of 1 and one of `KERNELS` Linear + ReLU layers
(each layer one node of a kernel class: a matmul, its epilogue fused), each timed (the
median of 200 calls) the way a worker runs them (`run_into`: as a CUDA graph where on):
kernel = (t(KERNELS) - t(1)) / (KERNELS - 1), call = t(1) - kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

KERNELS = 20
WIDTH = 64


def probe_part(layers: int) -> tuple[Any, list[Any]]:
    """A GraphModule of `layers` Linear + ReLU layers (flat, as a split's parts are) and its
    example input."""
    import torch
    from torch import nn

    from partitioner.split import split_program

    torch.manual_seed(0)
    body = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH),
                                                              nn.ReLU()))).eval()
    x = torch.randn(1, WIDTH)
    ep = torch.export.export(body, (x,))
    (part,) = split_program(ep, {n.name: "p0" for n in ep.graph.nodes
                                 if n.op == "call_function"}).parts
    return part.module, [x]


def compiled_call_us(compile: Callable[[Any, Sequence[Any]], Any],
                     timer: Callable[[Callable[[], Any]], float],
                     kernels: int = KERNELS) -> dict[str, float]:
    """{"call_us", "kernel_us"} of parts built by `compile(part, example_inputs)` (an
    Executable: its run is timed by `timer`, the median us of a call: benchmarks.py's)."""
    times = {layers: timer(_as_served(compile, layers)) for layers in (1, kernels)}
    kernel = max((times[kernels] - times[1]) / (kernels - 1), 0.0)
    return {"call_us": round(max(times[1] - kernel, 0.0), 2), "kernel_us": round(kernel, 2)}


def _as_served(compile: Callable[[Any, Sequence[Any]], Any], layers: int) -> Callable[[], Any]:
    """One run of the probe part the way a worker runs it: into the places (a CUDA graph
    where those are on), where the executable can."""
    part, inputs = probe_part(layers)
    executable = compile(part, inputs)
    places = [o.clone() for o in executable.run(inputs)]
    into = getattr(executable, "run_into", None)
    if into is None:
        return lambda: executable.run(inputs)
    return lambda: into(inputs, places)
