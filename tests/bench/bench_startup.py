"""Daemon readiness (cold: devices measured; warm: cached profile) and the measured CPU
profile next to what a plain torch loop gives, in one run. `make bench` runs it."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The repo root first (tests/runtimes, tests/partitioner must not shadow the packages), tests/
# for daemons.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.append(str(Path(__file__).resolve().parents[1]))
from daemons import DaemonProcess, daemon_config  # noqa: E402

from cuvild.client import Client  # noqa: E402


def readiness(rounds: int = 5) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as tmp:
        root = Path(tmp)
        state = root / "state"
        times, profile = [], None
        for i in range(rounds + 1):
            work = root / f"w{i}"
            work.mkdir()
            config = daemon_config(work, state, root)
            config["devices"] = {"cpu": {"cores": None}}  # the default layout: all cores
            daemon = DaemonProcess(work, config).start()
            if i == 0:
                with Client(daemon.target) as client:
                    profile = client.status()["devices"][0]
            times.append(daemon.ready_s)
            daemon.stop()
            daemon.close()
    return {"cold_s": times[0], "warm_s_median": statistics.median(times[1:]),
            "warm_s_all": times[1:], "cpu_profile": profile}


def torch_loop(threads: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    out = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        n = 2048
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.matmul(a, b)
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        out[f"{label}_gflops"] = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
    x = torch.ones(32 << 20)
    x.sum()
    t0 = time.perf_counter()
    for _ in range(10):
        x.sum()
    out["read_gbs"] = x.numel() * 4 * 10 / (time.perf_counter() - t0) / 1e9
    return out


def main() -> dict[str, Any]:
    ready = readiness()
    loop = torch_loop(len(os.sched_getaffinity(0)))
    prof = ready["cpu_profile"]
    result = {
        "readiness": {k: ready[k] for k in ("cold_s", "warm_s_median", "warm_s_all")},
        "cpu_profile_vs_torch_loop": {
            "profile_fp32_gflops": prof["peak_gflops"].get("fp32"),
            "loop_fp32_gflops": loop["fp32_gflops"],
            "profile_bf16_gflops": prof["peak_gflops"].get("bf16"),
            "loop_bf16_gflops": loop["bf16_gflops"],
            "profile_mem_bw_gbs": prof["mem_bw_gbs"],
            "loop_read_gbs": loop["read_gbs"],
        },
    }
    return result


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))
    else:
        r = result["readiness"]
        print(f"readiness (spawn -> READY=1): cold {r['cold_s']:.2f} s, "
              f"warm median {r['warm_s_median']:.3f} s "
              f"({', '.join(f'{t:.3f}' for t in r['warm_s_all'])})")
        c = result["cpu_profile_vs_torch_loop"]
        print("CPU profile vs plain torch loop (all cores):")
        for key in ("fp32", "bf16"):
            print(f"  {key} matmul: profile {c[f'profile_{key}_gflops']:.0f} GFLOP/s, "
                  f"torch.matmul 2048^3 loop {c[f'loop_{key}_gflops']:.0f} GFLOP/s")
        print(f"  read bandwidth: profile {c['profile_mem_bw_gbs']:.1f} GB/s, "
              f"torch sum loop {c['loop_read_gbs']:.1f} GB/s")
