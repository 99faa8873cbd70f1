"""Load and abuse, one run: what the hardening issue asks to report outside CI.

(a) N clients x M requests each (default 16 x 10,000) against a small MLP through tritonclient
    on the unix socket, a quarter of the clients with inputs and outputs in system shared
    memory: errors by status, p50/p99 per request, the daemon tree's RSS before and after,
    and shared-memory objects left in /dev/shm after the daemon stops.
(b) ServerLive and ServerReady p50/p99 while that load runs, and again while 16
    RepositoryModelLoad calls wait on a model that is still building (they filled the
    handler threads before: ServerLive took 4.9 s).

`python tests/bench/bench_load.py [--clients 16] [--requests 10000] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.append(str(Path(__file__).resolve().parents[1]))


OUT_AT = 4096  # a shared-memory client's output offset in its region (input at 0)


def rss_mib(pid: int) -> float:
    """RSS of a process and its children (the workers), MiB."""
    total = 0
    pids = [pid] + [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                    and _parent(p) == pid]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def client_loop(target: str, x: Any, expected: Any, n: int, use_shm: bool, codes: Counter,
                times: list[float], lock: threading.Lock, errors: list[str]) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url=target)
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    outs = None
    handle = None
    key = ""
    if use_shm:
        key = f"/loadtest-{os.getpid()}-{threading.get_ident()}"
        handle = shm.create_shared_memory_region(key[1:], key, OUT_AT + expected.nbytes)
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory(key[1:], key, OUT_AT + expected.nbytes)
        inp.set_shared_memory(key[1:], x.nbytes)
        out = grpcclient.InferRequestedOutput("output0")
        out.set_shared_memory(key[1:], expected.nbytes, offset=OUT_AT)
        outs = [out]
    else:
        inp.set_data_from_numpy(x)
    local: list[float] = []
    local_codes: Counter = Counter()
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            result = client.infer("mlp", [inp], outputs=outs)
            local.append((time.perf_counter() - t0) * 1e3)
            got = (shm.get_contents_as_numpy(handle, np.float32, list(expected.shape),
                                             offset=OUT_AT)
                   if use_shm else result.as_numpy("output0"))
            if not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
                local_codes["WRONG"] += 1
            else:
                local_codes["OK"] += 1
        except InferenceServerException as e:
            local_codes[str(e.status())] += 1
            if len(errors) < 5:
                errors.append(str(e))
    if handle is not None:  # by name: every client here is the same uid, one namespace
        client.unregister_system_shared_memory(key[1:])
        shm.destroy_shared_memory_region(handle)
    client.close()
    with lock:
        codes.update(local_codes)
        times.extend(local)


def probe_health(target: str, stop: threading.Event, out: list[float]) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=target)
    while not stop.is_set():
        t0 = time.perf_counter()
        client.is_server_live()
        client.is_server_ready()
        out.append((time.perf_counter() - t0) * 1e3 / 2)
        time.sleep(0.01)
    client.close()


def main(clients: int, requests: int) -> dict[str, Any]:  # noqa: PLR0915 - a bench script: the steps it prints
    import torch
    import tritonclient.grpc as grpcclient
    from daemons import DaemonProcess, daemon_config

    from cuvild.client import Client, samples

    result: dict[str, Any] = {"clients": clients, "requests_per_client": requests}
    with tempfile.TemporaryDirectory(prefix="cuvil-load-") as tmp:
        home = Path(tmp)
        daemon = DaemonProcess(home, daemon_config(home, home / "state", home)).start()
        try:
            torch.manual_seed(0)
            mlp = samples.MLP(width=16, depth=2).eval()
            x = torch.randn(1, 16)
            with torch.inference_mode():
                expected = mlp(x).numpy()
            with Client(daemon.target) as c:
                c.load("mlp", mlp, (x,))
                while c.status()["models"][0]["state"] == "loading":
                    time.sleep(0.2)
            pid = daemon.proc.pid
            before = set(os.listdir("/dev/shm"))
            result["rss_before_mib"] = round(rss_mib(pid), 1)
            codes: Counter = Counter()
            times: list[float] = []
            errors: list[str] = []
            lock = threading.Lock()
            health: list[float] = []
            stop = threading.Event()
            prober = threading.Thread(target=probe_health, args=(daemon.target, stop, health))
            prober.start()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=client_loop, args=(
                daemon.target, x.numpy(), expected, requests, i % 4 == 0, codes, times, lock,
                errors)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            stop.set()
            prober.join()
            result["load"] = {
                "codes": dict(codes), "first_errors": errors, "wall_s": round(wall, 1),
                "throughput_rps": round(sum(codes.values()) / wall),
                "p50_ms": round(statistics.median(times), 2), "p99_ms": round(pct(times, .99), 2),
                "health_p50_ms": round(statistics.median(health), 2),
                "health_p99_ms": round(pct(health, .99), 2)}
            result["rss_after_mib"] = round(rss_mib(pid), 1)
            # (b) health while 16 model loads wait on a model that is building
            with Client(daemon.target) as c:
                c.load("slow", samples.MLP(width=64, depth=4).eval(), (torch.randn(1, 64),),
                       wait=False)  # still building while the loads below wait on it
            triton = grpcclient.InferenceServerClient(url=daemon.target)
            outcome: Counter = Counter()

            def load() -> None:
                try:
                    triton.load_model("slow")
                    outcome["OK"] += 1
                except Exception as e:  # noqa: BLE001
                    outcome[type(e).__name__ + ":" + str(getattr(e, "status", lambda: "")())] += 1

            loaders = [threading.Thread(target=load) for _ in range(16)]
            health2: list[float] = []
            stop2 = threading.Event()
            prober = threading.Thread(target=probe_health, args=(daemon.target, stop2, health2))
            prober.start()
            for t in loaders:
                t.start()
            for t in loaders:
                t.join()
            stop2.set()
            prober.join()
            triton.close()
            result["health_under_loads"] = {
                "load_model_calls": dict(outcome),
                "p50_ms": round(statistics.median(health2), 2),
                "p99_ms": round(pct(health2, .99), 2), "probes": len(health2)}
            leftover_during = sorted(set(os.listdir("/dev/shm")) - before)
        finally:
            daemon.stop()
            daemon.close()
        result["client_objects_left_during_run"] = leftover_during
        result["segments_left_after_stop"] = sorted(
            n for n in os.listdir("/dev/shm") if n.startswith(f"cuvil-{pid}-"))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = main(args.clients, args.requests)
    print(json.dumps(out, indent=None if args.json else 2))
