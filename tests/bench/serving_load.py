"""Concurrent clients for tests/bench/bench_serving.py and bench_batching.py: N client
processes (each its own interpreter, so the clients' own Python does not share one GIL) warm
up, wait for each other at a barrier, then send requests back to back for a fixed time, all
starting at once; the result is the requests completed per second in all and the latency
percentiles over every request.

Paths: "oip" (tritonclient, raw contents, one channel per client), "fast" (the same-host fast
path, `cuvild.client.fast.FastSession`, one session per client).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

WARMUP = 20


def _client(path: str, target: str, model: str, shape: list[int], ready: Any,
            seconds: float, out: Any, warmup: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import numpy as np

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    if path == "fast":
        from cuvild.client.fast import FastSession

        session = FastSession(target.removeprefix("unix://"), model)
        name = session.inputs[0]["name"]

        def once() -> None:
            session.run([x])
    else:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(url=target)
        name = client.get_model_metadata(model).inputs[0].name

        def once() -> None:
            inp = grpcclient.InferInput(name, shape, "FP32")
            inp.set_data_from_numpy(x)
            client.infer(model, [inp])
    for _ in range(warmup):
        once()
    ready.wait()  # every client warm: none is still warming up while the others are timed
    latencies = []
    end = time.time() + seconds
    while True:
        t0 = time.perf_counter()
        once()
        latencies.append((time.perf_counter() - t0) * 1e3)
        if time.time() >= end:
            break
    out.put(latencies)


def load(path: str, target: str, model: str, shape: list[int], clients: int = 16,
         seconds: float = 4.0, warmup: int = WARMUP, keep: bool = False) -> dict[str, Any]:
    """Requests per second and latency over `clients` processes on `path` for `seconds`,
    after `warmup` requests each (keep: every latency too, for `merged`)."""
    import numpy as np

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ready = ctx.Barrier(clients)
    procs = [ctx.Process(target=_client, args=(path, target, model, shape, ready, seconds,
                                               out, warmup), daemon=True)
             for _ in range(clients)]
    for p in procs:
        p.start()
    per_client = [out.get(timeout=600 + seconds) for _ in procs]
    for p in procs:
        p.join(30)
    every = [ms for lat in per_client for ms in lat]
    # Each client stops at its first request past the end: the last ones overrun a little.
    span = max(seconds, max(sum(lat) for lat in per_client) / 1e3)
    return {"clients": clients, "seconds": span, "requests": len(every),
            "per_s": len(every) / span, "p50_ms": statistics.median(every),
            "p99_ms": float(np.percentile(every, 99)), **({"latencies_ms": every} if keep
                                                          else {})}


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of `load` as one: requests over the time of all, percentiles over every
    request."""
    import numpy as np

    every = [ms for run in runs for ms in run["latencies_ms"]]
    span = sum(run["seconds"] for run in runs)
    return {"clients": runs[0]["clients"], "seconds": span, "requests": len(every),
            "per_s": len(every) / span, "p50_ms": statistics.median(every),
            "p99_ms": float(np.percentile(every, 99)), "runs": len(runs)}
