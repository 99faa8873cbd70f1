"""llvm-cpu (IREE) on the reference models, each compiled as one part: cold compile, warm load
from the saved .vmfb, and median latency next to torch eager (interleaved rounds), 2 threads.

    .venv/bin/python tests/bench/bench_llvm_cpu.py [--models resnet18 bert4 mlp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for a plain run
import torch  # noqa: E402

from cuvild import samples  # noqa: E402
from partitioner.annotate import export  # noqa: E402
from partitioner.profile import DeviceProfile  # noqa: E402
from partitioner.split import split_program  # noqa: E402
from runtimes.base import CompileError, CompileSpec, Executable  # noqa: E402
from runtimes.llvm_cpu import IREERuntime  # noqa: E402

THREADS = 2


def one_part(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
    ep = export(model, inputs)
    nodes = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    return split_program(ep, {name: "all" for name in nodes}).parts[0].module


def interleaved(runners: dict[str, Any], rounds: int) -> dict[str, tuple[float, float, float]]:
    """Median wall, process-CPU and fastest wall ms of each runner, taking turns so host noise
    falls on all of them alike. CPU time shows the work when other jobs share the cores (it
    includes torch's OpenMP spin-waiting; IREE's workers wait passively)."""
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():  # warm-up
        run()
    for _ in range(rounds):
        for name, run in runners.items():
            c0, t0 = time.process_time(), time.perf_counter()
            run()
            wall[name].append((time.perf_counter() - t0) * 1e3)
            cpu[name].append((time.process_time() - c0) * 1e3)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name]), min(wall[name]))
            for name in runners}


def bench(name: str, rounds: int) -> dict[str, Any]:
    model, inputs = samples.reference(name, 1)
    with torch.inference_mode():
        expected = model(*inputs)
    part = one_part(model, inputs)
    spec = CompileSpec(device=DeviceProfile(id="cpu0", kind="cpu"),
                       example_inputs=list(inputs), threads=THREADS)
    row: dict[str, Any] = {"model": f"{name} b1"}
    t0 = time.perf_counter()
    try:
        compiled = IREERuntime().compile(part, spec)
    except CompileError as e:
        return {**row, "error": str(e)}
    row["compile_s"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-iree-") as tmp:
        compiled.save(Path(tmp))
        row["vmfb_mb"] = (Path(tmp) / "module.vmfb").stat().st_size / 2**20
        del compiled
        t0 = time.perf_counter()
        exe: Executable = IREERuntime().load(Path(tmp), spec)
        row["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = exe.run(inputs)[0]
        row["first_run_ms"] = (time.perf_counter() - t0) * 1e3
        row["rel_error"] = ((out - expected).abs().max() / expected.abs().max()).item()

        def eager() -> None:
            with torch.inference_mode():
                model(*inputs)

        medians = interleaved({"eager": eager, "llvm-cpu": lambda: exe.run(inputs)}, rounds)
    row["eager_ms"], row["eager_cpu_ms"], row["eager_min_ms"] = medians["eager"]
    row["iree_ms"], row["iree_cpu_ms"], row["iree_min_ms"] = medians["llvm-cpu"]
    row["ratio"] = row["iree_ms"] / row["eager_ms"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | cold compile s | warm load s | first run ms | eager ms | llvm-cpu ms "
             "[ratio] | CPU ms eager / llvm-cpu | rel error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:200]} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['compile_s']:.1f} | {r['load_s']:.3f} | "
                     f"{r['first_run_ms']:.1f} | {r['eager_ms']:.1f} | {r['iree_ms']:.1f} "
                     f"[{r['ratio']:.2f}] | {r['eager_cpu_ms']:.1f} / {r['iree_cpu_ms']:.1f} | "
                     f"{r['rel_error']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "bert4", "mlp"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    reason = IREERuntime.unavailable()
    if reason:
        sys.exit(f"llvm-cpu unavailable: {reason}")
    torch.set_num_threads(THREADS)
    load_before = os.getloadavg()[0]
    rows = [bench(name, args.rounds) for name in args.models]
    result = {"iree": IREERuntime.version(), "threads": THREADS, "rows": rows,
              "loadavg_1m": [load_before, os.getloadavg()[0]]}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(table(rows))
        print(f"iree {result['iree']}, {THREADS} threads, 1-min load average "
              f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
