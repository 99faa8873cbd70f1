"""Timing helpers of bench_serving.py and bench_runtimes.py: runners timed interleaved, or
alone in turn."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

WARMUP = 10
# Idle time between two timed calls: lets a spinning thread pool (torch's OpenMP) go to sleep
# before the next runner starts, so one runner's pool does not slow the next one's run.
GAP_S = 0.005
BLOCKS, BLOCK_SIZE = 6, 20  # alone in turn: blocks of calls back to back


def stats(samples_ms: list[float]) -> dict[str, float]:
    import numpy as np

    return {"p50_ms": statistics.median(samples_ms),
            "p99_ms": float(np.percentile(samples_ms, 99)), "n": len(samples_ms)}


def interleaved(runners: dict[str, Callable[[], Any]], rounds: int, gap_s: float = GAP_S,
                warmup: int = WARMUP) -> dict[str, list[float]]:
    """The runners in turn, call by call, `rounds` times (ms per call, by runner)."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return samples


def in_blocks(runners: dict[str, Callable[[], Any]], blocks: int = BLOCKS,
              size: int = BLOCK_SIZE) -> dict[str, list[float]]:
    """Each runner alone, `size` calls back to back, the runners in turn `blocks` times: as a
    client's loop runs, with no other runner's threads waking between its calls (they do in
    `interleaved`, and a runtime's spinning pool slows the next runner), and slow drift of
    the host shared out between them."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(blocks):
        for name, run in runners.items():
            time.sleep(GAP_S)
            run()  # (its first call after another runner's is not a loop's)
            for _ in range(size):
                t0 = time.perf_counter()
                run()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return samples


def rel_error(got: Any, expected: Any) -> float:
    import numpy as np

    got, expected = np.asarray(got), np.asarray(expected)
    error = float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-12))
    return error if error == error else float("inf")  # NaN: inf, which max() keeps
