"""Dynamic batching (`make bench`, batching section): resnet18 with a dynamic batch dimension,
served twice by one daemon (one CPU device on every core, process workers): once with
batching off (`max_batch` 1) and once on (the daemon's default engine.batching, or
--max-batch / --max-delay-us). 1, 4 and 16 concurrent client processes send one image per
request back to back through tritonclient (raw contents) for a fixed time
(tests/bench/serving_load.py), off and on taken in turn three times (this host's speed
drifts); each level reports requests per second and p50/p99 over all three, and the ratios
on / off.

Goals on the 2-core dev host (issue 16): at 16 clients >= 1.5x the throughput with p99 <=
1.5x the unbatched p99; at 1 client no loss (p50 <= 1.05x).

Before timing, every batch size 1..max_batch is requested once on the batched model, so the
buckets are built (the first request of each size compiles it) and the timed runs measure
serving, not compiling. The buckets each model ran and the runtime each chose are printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LEVELS = (1, 4, 16)
SECONDS = 12.0  # per level and setting, in ROUNDS runs taken in turn with the other setting
ROUNDS = 3


def cpu_line() -> str:
    """The host's CPU model and its matrix/vector flags that matter here."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor()
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"]
    return (f"{info.get('Model name', '?').strip()}, {os.cpu_count()} CPUs; "
            + " ".join(f for f in wanted if f in flags))


def wait_ready(client: Any, names: set[str], daemon: Any, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {m["name"]: m["state"] for m in client.models()}
        if all(states.get(n, "loading") != "loading" for n in names):
            bad = {n: s for n, s in states.items() if n in names and s != "ready"}
            if bad:
                raise RuntimeError(f"not ready: {bad}\n{daemon.log()[-3000:]}")
            return
        time.sleep(0.5)
    raise TimeoutError(f"{names} not ready in {timeout} s")


def warm(target: str, model: str, max_batch: int) -> None:
    """Request every batch size once, so each bucket is built before the timed runs."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=target)
    name = client.get_model_metadata(model).inputs[0].name
    for n in range(1, max_batch + 1):
        x = np.random.default_rng(n).standard_normal((n, 3, 224, 224)).astype(np.float32)
        inp = grpcclient.InferInput(name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        client.infer(model, [inp], client_timeout=1800)
    client.close()


def ceiling(max_batch: int, rounds: int = 10) -> dict[str, Any]:
    """What batching can gain on this host at most: resnet18 compiled in this process by each
    CPU runtime at batch 1 and at max_batch, timed in turn (no serving at all); the gain is
    max_batch runs of 1 image against one run of max_batch images, timed in turn."""
    import statistics

    import torch
    from bench_runtimes import THREADS, build

    from cuvild.client.samples import ResNet18
    from partitioner.profile import DeviceProfile
    from partitioner.split import split_program
    from runtimes.base import CompileSpec

    torch.manual_seed(0)
    model = ResNet18().eval()
    cpu = DeviceProfile(id="cpu0", kind="cpu", cores=list(range(THREADS)))
    out: dict[str, Any] = {}
    for runtime in ("openvino", "onnxruntime"):
        runners = {}
        for n in (1, max_batch):
            x = torch.randn(n, 3, 224, 224)
            ep = torch.export.export(model, (x,))
            part = split_program(ep, {nd.name: "all" for nd in ep.graph.nodes
                                      if nd.op == "call_function"}).parts[0].module
            spec = CompileSpec(device=cpu, precision="fp32", example_inputs=[x],
                               threads=THREADS)
            try:
                exe, _ = build(runtime, "fp32", part, spec)
            except Exception as e:  # noqa: BLE001 - a runtime this host lacks is reported
                out[runtime] = {"error": f"{type(e).__name__}: {e}"[:200]}
                break
            runners[n] = (exe, x)
        if runtime in out:
            continue
        times: dict[int, list[float]] = {n: [] for n in runners}
        for k in range(rounds + 2):  # batch 1 and batch max_batch in turn: the host drifts
            for n, (exe, x) in runners.items():
                t0 = time.perf_counter()
                exe.run([x])
                if k >= 2:
                    times[n].append((time.perf_counter() - t0) * 1e3 / n)
        per_image: dict[Any, float] = {n: statistics.median(v) for n, v in times.items()}
        per_image["gain"] = per_image[1] / per_image[max_batch]
        out[runtime] = per_image
    return out


def main(max_batch: int, max_delay_us: int, seconds: float) -> dict[str, Any]:
    import torch
    from daemons import DaemonProcess, daemon_config, one_cpu
    from serving_load import load, merged

    import cuvild
    from cuvild.client import Client
    from cuvild.client.samples import ResNet18

    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-batching-") as tmp:
        home = Path(tmp)
        config = daemon_config(home, home / "state", home)
        config["devices"] = one_cpu()
        config["engine"] = {"batching": {"max_batch": max_batch, "max_delay_us": max_delay_us}}
        config["log_level"] = "info"
        daemon = DaemonProcess(home, config)
        daemon.start()
        try:
            with Client(daemon.target, timeout=1800) as control:
                torch.manual_seed(0)
                batch = torch.export.Dim("batch", min=1, max=64)
                archive = home / "resnet18.pt2"
                torch.export.save(cuvild.export(ResNet18().eval(), (torch.randn(2, 3, 224, 224),),
                                                dynamic_shapes=({0: batch},)), archive)
                t0 = time.perf_counter()
                control.load_file("off", archive, batching=False, wait=False)
                control.load_file("on", archive, wait=False)
                wait_ready(control, {"off", "on"}, daemon)
                t1 = time.perf_counter()
                warm(daemon.target, "off", 1)
                warm(daemon.target, "on", max_batch)
                warm_s = time.perf_counter() - t1
                runs: dict[str, list[dict[str, Any]]] = {}
                for clients in LEVELS:  # off and on in turn, ROUNDS times: the host drifts
                    for r in range(ROUNDS):
                        for label in ("off", "on") if r % 2 == 0 else ("on", "off"):
                            runs.setdefault(f"{label} {clients}", []).append(load(
                                "oip", daemon.target, label, [1, 3, 224, 224],
                                clients=clients, seconds=seconds / ROUNDS, warmup=3,
                                keep=True))
                results = {key: merged(each) for key, each in runs.items()}
                served = {m["name"]: m for m in control.models()}
                buckets = {name: control.plan(name)["plan"]["buckets"]
                           for name in ("off", "on")}
        finally:
            daemon.stop()
            daemon.close()
    limit = ceiling(max_batch)  # after the daemon: nothing else runs meanwhile
    return {"cpu": cpu_line(), "max_batch": max_batch, "ceiling": limit,
            "max_delay_us": max_delay_us, "load_s": t1 - t0, "warm_s": warm_s, "results": results,
            "batching": {n: m["batching"] for n, m in served.items()},
            "buckets": {n: {"x".join(map(str, b["shapes"][0])): [
                (p["runtime"], p["measured_ms"]) for p in b["parts"]] for b in bs}
                for n, bs in buckets.items()},
            "total_s": time.perf_counter() - t_start}


def print_table(result: dict[str, Any]) -> None:
    print(f"host: {result['cpu']}")
    print(f"resnet18 fp32, one image per request, tritonclient raw contents; batching on: "
          f"max_batch {result['max_batch']}, max_delay_us {result['max_delay_us']}; "
          f"load {result['load_s']:.0f} s, buckets built in {result['warm_s']:.0f} s")
    print(f"{'clients':>7} {'off req/s':>10} {'on req/s':>9} {'x':>6} | {'off p50':>8} "
          f"{'on p50':>7} {'x':>6} | {'off p99':>8} {'on p99':>7} {'x':>6}")
    r = result["results"]
    for clients in LEVELS:
        off, on = r[f"off {clients}"], r[f"on {clients}"]
        print(f"{clients:>7} {off['per_s']:>10.1f} {on['per_s']:>9.1f} "
              f"{on['per_s'] / off['per_s']:>5.2f}x | {off['p50_ms']:>8.1f} "
              f"{on['p50_ms']:>7.1f} {on['p50_ms'] / off['p50_ms']:>5.2f}x | "
              f"{off['p99_ms']:>8.1f} {on['p99_ms']:>7.1f} "
              f"{on['p99_ms'] / off['p99_ms']:>5.2f}x")
    b = result["batching"]["on"]
    sizes = " ".join(f"{k}x{v}" for k, v in b["sizes"].items())
    print(f"batched runs by rows (all levels): {sizes}; queue wait p50 {b['queue_ms']['p50']} "
          f"ms, p99 {b['queue_ms']['p99']} ms")
    for name, buckets in result["buckets"].items():
        print(f"{name}: " + ", ".join(f"{shape} {runtime} {ms:.1f} ms" if ms else
                                      f"{shape} {runtime}" for shape, parts in buckets.items()
                                      for runtime, ms in parts))
    for runtime, c in result["ceiling"].items():
        if "error" in c:
            print(f"in-process {runtime}: {c['error']}")
            continue
        print(f"in-process {runtime}: {c['1']:.1f} ms an image at batch 1, "
              f"{c[str(result['max_batch'])]:.1f} at batch {result['max_batch']}: batching "
              f"gains at most {c['gain']:.2f}x on this host")
    on16, off16 = r["on 16"], r["off 16"]
    on1, off1 = r["on 1"], r["off 1"]
    print(f"goals: 16 clients throughput {on16['per_s'] / off16['per_s']:.2f}x (>= 1.5), p99 "
          f"{on16['p99_ms'] / off16['p99_ms']:.2f}x (<= 1.5); 1 client p50 "
          f"{on1['p50_ms'] / off1['p50_ms']:.3f}x (<= 1.05)")
    print(f"total {result['total_s']:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-delay-us", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = json.loads(json.dumps(main(args.max_batch, args.max_delay_us, args.seconds)))
    if args.json:
        print(json.dumps(out, indent=1))
    print_table(out)
