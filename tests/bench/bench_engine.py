"""Engine figures, one run: handoff cost per cut, 2-part vs 1-part latency, pipelined
throughput over two single-core devices vs one (emulated NPU on OpenVINO + CPU), and a tiny
two-part MLP (where the hand-off is most of a request) with its parts on worker processes
and on worker threads (`engine.workers: thread`), both rung through bells
(cuvild/run/bells.py), taken in turn."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cuvild  # noqa: E402
from cuvild.client.samples import MLP, reference  # noqa: E402
from cuvild.core.arena import Arena  # noqa: E402
from cuvild.core.loaded import part_stats  # noqa: E402
from cuvild.engine.engine import Engine  # noqa: E402
from cuvild.intake.summary import summarize  # noqa: E402
from partitioner.plan import Part, Plan  # noqa: E402
from partitioner.profile import DeviceProfile  # noqa: E402

CORES = sorted(os.sched_getaffinity(0))
CPU = DeviceProfile(id="cpu0", kind="cpu", cores=CORES[:1],
                    runtimes=["openvino", "onnxruntime", "torch"])
NPU = DeviceProfile(id="npu0", kind="npu", emulated=True, cores=CORES[-1:], runtimes=["openvino"])


def handoff(arena: Arena) -> dict[str, Any]:
    """Producer writes its output into the arena once; the consumer wraps it in place."""
    out = {}
    for label, nbytes in (("1KiB", 1 << 10), ("1MiB", 1 << 20), ("64MiB", 64 << 20)):
        block = arena.alloc(nbytes)
        seg = arena.segments[block.segment]
        src = torch.randn(nbytes // 4)
        dst = torch.frombuffer(seg.view(block.offset, nbytes), dtype=torch.float32)
        reps = max(3, min(2000, (256 << 20) // nbytes))
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        write_s = (time.perf_counter() - t0) / reps
        a, b = np.empty(nbytes, np.uint8), np.ones(nbytes, np.uint8)
        t0 = time.perf_counter()
        for _ in range(reps):
            np.copyto(a, b)
        memcpy_s = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            view = torch.frombuffer(seg.view(block.offset, nbytes), dtype=torch.float32)
        read_s = (time.perf_counter() - t0) / reps
        same = view.data_ptr() == dst.data_ptr()
        del dst, view
        arena.free(block)
        out[label] = {"producer_write_us": write_s * 1e6, "write_gbs": nbytes / write_s / 1e9,
                      "memcpy_gbs": nbytes / memcpy_s / 1e9,
                      "write_vs_memcpy": memcpy_s / write_s,
                      "consumer_read_us": read_s * 1e6, "consumer_copies": 0 if same else 1}
    return out


def chunked(ep: Any, devices: list[str]) -> Plan:
    nodes = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    k = len(devices)
    return Plan(parts=[Part(f"p{i}", d, "", "fp32", nodes[i * len(nodes) // k:
                                                          (i + 1) * len(nodes) // k], 0.0)
                       for i, d in enumerate(devices)], cuts=[], predicted_ms=0.0, peak_bytes={})


def run_load(engine: Engine, key: str, x: torch.Tensor, in_flight: int,
             seconds: float) -> float:
    done = [0]
    stop = time.perf_counter() + seconds

    def client() -> None:
        while time.perf_counter() < stop:
            engine.infer(key, (x,))
            done[0] += 1

    threads = [threading.Thread(target=client) for _ in range(in_flight)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0] / (time.perf_counter() - t0)


def latency(engine: Engine, key: str, x: torch.Tensor, n: int = 20) -> float:
    engine.infer(key, (x,))
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.infer(key, (x,))
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def processes_vs_threads(tmp: Path, path: Path, specs: Any, plan: Plan,
                         y: torch.Tensor) -> dict[str, Any]:
    """The tiny model's p50 latency, and at 4 in flight its throughput, with its parts on
    worker processes and on worker threads, in turn."""
    arenas = {way: Arena(f"{os.getpid()}-bench-{way}") for way in ("processes", "threads")}
    engines = {way: Engine([CPU, NPU], tmp / "cache", arenas[way], max_in_flight=8,
                           workers="thread" if way == "threads" else "process") for way in arenas}
    try:
        for engine in engines.values():
            engine.prepare("tiny", "mlp", "1", path, specs, plan=plan)
        lat: dict[str, list[float]] = {way: [] for way in engines}
        tput: dict[str, list[float]] = {way: [] for way in engines}
        for _ in range(3):
            for way, engine in engines.items():
                lat[way].append(latency(engine, "tiny", y, 400))
                tput[way].append(run_load(engine, "tiny", y, 4, 2.0))
    finally:
        for way, engine in engines.items():
            engine.close()
            arenas[way].close()
    return {"p50_ms": {w: statistics.median(v) for w, v in lat.items()},
            "rps_at_4": {w: statistics.median(v) for w, v in tput.items()}}


def main() -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="cuvil-bench-"))
    arena = Arena(f"{os.getpid()}-bench")
    result: dict[str, Any] = {"handoff": handoff(arena)}
    model, (x,) = reference("resnet18")
    ep = cuvild.export(model, (x,))
    path = tmp / "resnet18.pt2"
    torch.export.save(ep, path)
    specs = summarize(ep)["inputs"]
    engine = Engine([CPU, NPU], tmp / "cache", arena, max_in_flight=8)
    try:
        t0 = time.perf_counter()
        two = engine.prepare("two", "resnet18", "1", path, specs,
                             plan=chunked(ep, ["npu0", "cpu0"]))
        result["prepare_two_parts_s"] = time.perf_counter() - t0
        one = engine.prepare("one", "resnet18", "1", path, specs, plan=chunked(ep, ["npu0"]))
        result["runtimes"] = {"two": [(r.id, r.device, r.runtime) for r in two.routes],
                              "one": [(r.id, r.device, r.runtime) for r in one.routes]}
        with torch.no_grad():
            ref = model(x)
        for key in ("one", "two"):
            err = (engine.infer(key, (x,))[0] - ref).abs().max() / ref.abs().max()
            result[f"{key}_rel_error"] = float(err)
        rounds = {"one": [], "two": []}
        for _ in range(3):  # interleaved
            for key in rounds:
                rounds[key].append(latency(engine, key, x, 10))
        result["latency_ms"] = {k: statistics.median(v) for k, v in rounds.items()}
        result["footprint_bytes"] = {"two": two.footprint, "sum_of_cut_tensors": two.total_bytes}
        tput = {}
        for depth in (1, 2, 4):
            tput[f"one_device_{depth}"] = run_load(engine, "one", x, depth, 4.0)
            tput[f"two_devices_{depth}"] = run_load(engine, "two", x, depth, 4.0)
        result["throughput_rps"] = tput
        result["pipelined_speedup_at_4"] = tput["two_devices_4"] / tput["one_device_4"]
        result["stats"] = part_stats(engine.runner.served.models["two"])
        torch.manual_seed(0)
        mlp, y = MLP(width=16, depth=2).eval(), torch.randn(1, 16)
        mep = cuvild.export(mlp, (y,))
        torch.export.save(mep, tmp / "mlp.pt2")
        result["tiny_two_parts"] = processes_vs_threads(
            tmp, tmp / "mlp.pt2", summarize(mep)["inputs"], chunked(mep, ["npu0", "cpu0"]), y)
    finally:
        engine.close()
        arena.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


if __name__ == "__main__":
    r = main()
    if "--json" in sys.argv:
        print(json.dumps(r, indent=2))
        sys.exit(0)
    print("per-cut handoff (producer writes once into the arena, consumer reads in place):")
    for label, h in r["handoff"].items():
        print(f"  {label:>6}: write {h['producer_write_us']:9.1f} us ({h['write_gbs']:.1f} GB/s,"
              f" {h['write_vs_memcpy']:.2f}x memcpy), consumer wrap {h['consumer_read_us']:.1f} us"
              f", copies into consumer: {h['consumer_copies']}")
    print(f"resnet18 b1 parts: {r['runtimes']}")
    print(f"latency: one part {r['latency_ms']['one']:.1f} ms, two parts "
          f"{r['latency_ms']['two']:.1f} ms (errors {r['one_rel_error']:.1e}, "
          f"{r['two_rel_error']:.1e})")
    print(f"arena per request: {r['footprint_bytes']['two']} bytes (sum of crossing tensors "
          f"{r['footprint_bytes']['sum_of_cut_tensors']})")
    t = r["throughput_rps"]
    for depth in (1, 2, 4):
        print(f"  in flight {depth}: one device {t[f'one_device_{depth}']:.1f} req/s, two "
              f"pipelined devices {t[f'two_devices_{depth}']:.1f} req/s")
    print(f"pipelined speedup at 4 in flight: {r['pipelined_speedup_at_4']:.2f}x")
    t = r["tiny_two_parts"]
    print(f"tiny MLP in two parts, rung on worker processes vs threads, in turn: p50 "
          f"{t['p50_ms']['processes']:.3f} vs {t['p50_ms']['threads']:.3f} ms; at 4 in flight "
          f"{t['rps_at_4']['processes']:.0f} vs {t['rps_at_4']['threads']:.0f} req/s")
