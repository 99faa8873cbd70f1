"""Start-up, in one run (`make bench` runs it):

- daemon readiness (cold: devices measured; warm: cached profile), and the measured CPU
  profile next to what a plain torch loop gives;
- per reference model (resnet18, bert4): the cold build (upload to READY) against the compile
  time of the fastest single candidate, the time from `Client.load` returning to the first
  correct result, a restart's time to serve it again (process start to model READY, from its
  load record), and the daemon tree's memory (PSS, shared pages counted once) serving it,
  after the cold load and after the restart, against one process running it eagerly;
- resnet18 exported with a dynamic batch: a restart's time to READY and to the first result
  of each batch size built before (its buckets, restored from their load records)."""

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


def torch_loop(threads: int, bf16: bool) -> dict[str, float | None]:
    """Plain torch loops; bf16 only where the profile measured it (emulated bf16 on a CPU
    without it takes minutes here and says nothing)."""
    import torch

    torch.set_num_threads(threads)
    out: dict[str, float | None] = {"bf16_gflops": None}
    dtypes = (("fp32", torch.float32), ("bf16", torch.bfloat16))
    for label, dtype in dtypes if bf16 else dtypes[:1]:
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


def pss_mib(pids: list[int]) -> float:
    """Proportional set size of these processes together (shared pages counted once)."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total / 1024


def tree(pid: int) -> list[int]:
    """A process and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            children = (task / "children").read_text().split()
            todo += [int(c) for c in children]
    return out


EAGER = """
import sys, torch
from cuvild.client.samples import reference
torch.set_num_threads({threads})
model, x = reference("{name}")
with torch.no_grad():
    for _ in range(20):
        model(*x)
rollup = open("/proc/self/smaps_rollup").read().splitlines()
print(sum(int(l.split()[1]) for l in rollup if l.startswith("Pss:")) / 1024)
"""


def one_device(root: Path) -> tuple[Path, dict[str, Any]]:
    """A work directory under `root`, and the config of a daemon on one CPU device."""
    work = root / "w"
    work.mkdir()
    return work, daemon_config(work, root / "state", root,
                               devices={"cpu": {"cores": None}, "emulated": []})


def model_startup(name: str, runs: int = 20) -> dict[str, Any]:  # noqa: PLR0915 - a bench script: the steps it prints
    import subprocess

    import torch

    from cuvild.client.samples import reference

    model, x = reference(name)
    with torch.no_grad():
        expected = model(*x)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as tmp:
        root = Path(tmp)
        work, config = one_device(root)
        daemon = DaemonProcess(work, config).start()
        try:
            with Client(daemon.target) as client:
                t0 = time.perf_counter()
                loaded = client.load(name, model, x)
                out["cold_load_s"] = time.perf_counter() - t0
                out["cold_build_s"] = loaded["model"]["load_s"]
                t0 = time.perf_counter()
                (got,) = client.infer(name, x[0]).values()
                torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
                out["load_return_to_first_result_s"] = time.perf_counter() - t0
                measured = client.plan(name)["measured"]
                winners = {m["runtime"] for m in measured.values()}
                out["winner"] = "+".join(sorted(winners))
                out["winner_compile_s"] = sum(
                    c["compile_s"] for m in measured.values() for c in m["candidates"]
                    if c["runtime"] == m["runtime"] and c["status"] == "ok")
                out["candidates"] = {c["runtime"]: (c["status"], round(c["compile_s"], 2))
                                     for m in measured.values() for c in m["candidates"]}
                for _ in range(runs):
                    client.infer(name, x[0])
                out["pss_after_cold_load_mib"] = pss_mib(tree(daemon.proc.pid))
            daemon.stop()
            again = DaemonProcess(work, config)
            t0 = time.perf_counter()
            again.start()
            out["restart_daemon_ready_s"] = time.perf_counter() - t0
            with Client(again.target) as client:
                client.wait_ready(name, timeout=300)
                out["restart_to_model_ready_s"] = time.perf_counter() - t0
                (got,) = client.infer(name, x[0]).values()
                torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
                out["restart_to_first_result_s"] = time.perf_counter() - t0
                (summary,) = client.models()
                out["restart_warm"] = summary["warm"]
                out["restart_loads"] = client.stats(interval=0.01)["loads"]
                for _ in range(runs):
                    client.infer(name, x[0])
                out["pss_after_restart_mib"] = pss_mib(tree(again.proc.pid))
                out["pss_after_restart_daemon_mib"] = pss_mib([again.proc.pid])
            again.stop()
            # the same cold build with the search restricted to the winner: what a user of
            # that one runtime would wait for
            single = root / "single"
            single.mkdir()
            config = daemon_config(single, root / "state1", root,
                                   devices={"cpu": {"cores": None}, "emulated": []},
                                   engine={"runtimes": {"cpu": sorted(winners)}})
            one = DaemonProcess(single, config).start()
            try:
                with Client(one.target) as client:
                    out["single_runtime_build_s"] = client.load(name, model, x)["model"]["load_s"]
                one.stop()
            finally:
                one.close()
        finally:
            daemon.close()
    eager = subprocess.run([sys.executable, "-c", EAGER.format(
        name=name, threads=len(os.sched_getaffinity(0)))], capture_output=True, text=True,
        check=True, cwd=Path(__file__).resolve().parents[2])
    out["pss_eager_mib"] = float(eager.stdout.strip().splitlines()[-1])
    out["pss_ratio_cold"] = out["pss_after_cold_load_mib"] / out["pss_eager_mib"]
    out["pss_ratio_restart"] = out["pss_after_restart_mib"] / out["pss_eager_mib"]
    out["cold_build_vs_single_runtime"] = out["cold_build_s"] / out["single_runtime_build_s"]
    out["cold_build_vs_winner_compile"] = out["cold_build_s"] / max(out["winner_compile_s"],
                                                                    1e-9)
    return out


def dynamic_restart(name: str = "resnet18", rows: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    """A model exported with a dynamic batch (what dynamic batching serves): a restart's
    time to serve it again, and each batch size it had built (its buckets' load records)."""
    import torch

    from cuvild.client.samples import reference

    model, (x,) = reference(name)
    with torch.no_grad():
        expected = {n: model(torch.cat([x] * n)) for n in rows}
    dims = ({0: torch.export.Dim("batch", max=16)},)
    out: dict[str, Any] = {"rows": list(rows)}
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as tmp:
        root = Path(tmp)
        work, config = one_device(root)
        for when in ("cold", "restart"):
            daemon = DaemonProcess(work, config)
            t0 = time.perf_counter()
            daemon.start()
            try:
                with Client(daemon.target) as client:
                    if when == "cold":
                        client.load(name, model, (torch.cat([x, x]),), dynamic_shapes=dims)
                    client.wait_ready(name, timeout=600)
                    out[f"{when}_to_model_ready_s"] = time.perf_counter() - t0
                    for n in rows:
                        t1 = time.perf_counter()
                        (got,) = client.infer(name, torch.cat([x] * n)).values()
                        out[f"{when}_first_result_b{n}_s"] = time.perf_counter() - t1
                        torch.testing.assert_close(got, expected[n], rtol=1e-3, atol=1e-3)
                    out[f"{when}_loads"] = client.stats(interval=0.01)["loads"]
                daemon.stop()
            finally:
                daemon.close()
    return out


def main() -> dict[str, Any]:
    models = {name: model_startup(name) for name in ("resnet18", "bert4")}
    dynamic = dynamic_restart()
    ready = readiness()
    prof = ready["cpu_profile"]
    loop = torch_loop(len(os.sched_getaffinity(0)), bool(prof["peak_gflops"].get("bf16")))
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
        "models": models,
        "dynamic": dynamic,
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
            if c[f"profile_{key}_gflops"] is None:
                print(f"  {key} matmul: not measured (the CPU has no native {key})")
                continue
            print(f"  {key} matmul: profile {c[f'profile_{key}_gflops']:.0f} GFLOP/s, "
                  f"torch.matmul 2048^3 loop {c[f'loop_{key}_gflops']:.0f} GFLOP/s")
        print(f"  read bandwidth: profile {c['profile_mem_bw_gbs']:.1f} GB/s, "
              f"torch sum loop {c['loop_read_gbs']:.1f} GB/s")
        for name, m in result["models"].items():
            print(f"{name}: cold build {m['cold_build_s']:.2f} s (tried {m['candidates']}); "
                  f"restricted to the winner ({m['winner']}) {m['single_runtime_build_s']:.2f} s"
                  f" ({m['cold_build_vs_single_runtime']:.2f}x); the winner's compile alone "
                  f"{m['winner_compile_s']:.2f} s ({m['cold_build_vs_winner_compile']:.1f}x); "
                  f"load return -> first result {m['load_return_to_first_result_s']:.3f} s")
            print(f"  restart -> daemon ready {m['restart_daemon_ready_s']:.2f} s, model READY "
                  f"{m['restart_to_model_ready_s']:.2f} s, first result "
                  f"{m['restart_to_first_result_s']:.2f} s (warm {m['restart_warm']}, "
                  f"loads {m['restart_loads']})")
            print(f"  PSS daemon tree: {m['pss_after_cold_load_mib']:.0f} MiB after the cold "
                  f"load ({m['pss_ratio_cold']:.2f}x eager), {m['pss_after_restart_mib']:.0f} "
                  f"MiB after a restart ({m['pss_ratio_restart']:.2f}x); eager process "
                  f"{m['pss_eager_mib']:.0f} MiB")
        d = result["dynamic"]
        firsts = ", ".join(f"batch {n} {d[f'restart_first_result_b{n}_s']:.2f} s (first "
                           f"built in {d[f'cold_first_result_b{n}_s']:.2f} s)" for n in d["rows"])
        print(f"resnet18, dynamic batch: restart -> model READY {d['restart_to_model_ready_s']:.2f}"
              f" s (cold: {d['cold_to_model_ready_s']:.2f} s with its upload); first result "
              f"after it: {firsts}; loads {d['restart_loads']}")
