"""`make demo`: the whole path on this host, with nothing left behind.

Starts cuvild with the demo layout (CPU worker on one core, an NPU emulated by OpenVINO's CPU
plugin on the other) in a temporary state dir, loads the built-in DemoNet (a ResNet-style
backbone annotated `@partition(device="npu")`, its head `@partition(device="cpu")`), prints the
plan, runs inference through the Open Inference Protocol with tensors in shared memory and
through the same-host fast path, checks the results against torch eager, compares latency
with eager in the same run; then
loads the same model under `precision="auto"` at two error budgets with calibration inputs
and shows each plan's precisions, latency and error on held-out inputs next to fp32; stops.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cuvild.client import Client
from cuvild.client.tables import devices_table, format_table

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 180
MODEL_TIMEOUT_S = 900
ROUNDS = 20
BUDGETS = (1e-2, 0.2)  # the default budget, and a loose one
CALIBRATION = 16


def wait_ready(target: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"demo: cuvild exited with code {proc.returncode}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise SystemExit(f"demo: cuvild not ready within {READY_TIMEOUT_S} s")


def wait_model(client: Client, name: str) -> dict:
    deadline = time.monotonic() + MODEL_TIMEOUT_S
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        model = next(m for m in client.models() if m["name"] == name)
        if model["state"] != "loading":
            return model
        phase = f": {model['phase']}" if model["phase"] else ""
        line = f"demo: loading ({time.monotonic() - t0:.0f} s){phase}"  # (one 100-column line)
        print(f"\r{line[:100].ljust(100)}", end="", flush=True)
        time.sleep(1)
    raise SystemExit(f"demo: model not ready within {MODEL_TIMEOUT_S} s")


def median_ms(fn, rounds: int = ROUNDS) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run(client: Client) -> int:
    import torch

    from cuvild.client.samples import reference

    status = client.status()
    print(devices_table(status["devices"]), "\n")
    model, (x,) = reference("demo")
    print("demo: uploading DemoNet (backbone annotated @partition(device='npu'), head "
          "@partition(device='cpu'))")
    client.load("demo", model, (x,), wait=False)  # wait_model shows its own progress
    state = wait_model(client, "demo")
    print()
    if state["state"] != "ready":
        print(f"demo: model failed to load: {state['state']}", file=sys.stderr)
        return 1
    plan = client.plan("demo")
    print(plan["explain"], "\n")
    outputs = client.infer("demo", x, shm=True)
    with torch.no_grad():
        expected = model(x)
    got = outputs["output0"]
    error = float((got - expected).abs().max() / expected.abs().max())
    ok = error <= 1e-4
    print(f"demo: output via shared memory vs torch eager: max relative error {error:.1e} "
          f"({'OK' if ok else 'MISMATCH'})")
    fast = Client(client.target, client.timeout, fast=True)  # the same-host fast path
    fast_error = float((fast.infer("demo", x)["output0"] - expected).abs().max()
                       / expected.abs().max())
    ok = ok and fast_error <= 1e-4
    print(f"demo: output via the fast path vs torch eager: max relative error "
          f"{fast_error:.1e} ({'OK' if fast_error <= 1e-4 else 'MISMATCH'})")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rounds = {"cuvild (fast path)": [], "cuvild (OIP, shm)": [], "cuvild (OIP, raw)": [],
              "torch eager": []}
    for _ in range(3):  # interleaved, so drift on a shared host hits all alike
        rounds["cuvild (fast path)"].append(
            median_ms(lambda: fast.infer("demo", x), ROUNDS // 2))
        rounds["cuvild (OIP, shm)"].append(
            median_ms(lambda: client.infer("demo", x, shm=True), ROUNDS // 2))
        rounds["cuvild (OIP, raw)"].append(median_ms(lambda: client.infer("demo", x),
                                                     ROUNDS // 2))
        with torch.no_grad():
            rounds["torch eager"].append(median_ms(lambda: model(x), ROUNDS // 2))
    eager = statistics.median(rounds["torch eager"])
    rows = [[k, f"{statistics.median(v):.2f}", f"{statistics.median(v) / eager:.2f}"]
            for k, v in rounds.items()]
    print(format_table(["PATH", "p50 ms", "vs eager"], rows))
    fast.close()
    measured = client.plan("demo")["measured"]
    print("\n" + format_table(["PART", "DEVICE", "RUNTIME", "PREDICTED ms", "MEASURED ms"],
                              [[p, m["device"], m["runtime"], f"{m['predicted_ms']:.2f}",
                                f"{m['measured_ms']:.2f}" if m["measured_ms"] else "-"]
                               for p, m in measured.items()]))
    return 0 if ok and policies(client, model, x) else 1


def policies(client: Client, model: Any, x: Any) -> bool:
    """DemoNet under precision="auto" next to fp32: each plan's parts, latency through the
    protocol, and error against torch eager on held-out inputs (not the calibration ones)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    calibration = [torch.randn(x.shape, generator=gen) for _ in range(CALIBRATION)]
    held = [torch.randn(x.shape, generator=gen) for _ in range(8)]
    names = {"demo": "fp32"}
    for budget in BUDGETS:
        name = f"demo-auto-{budget:g}"
        print(f"\ndemo: uploading DemoNet again as {name}: precision='auto', max_error="
              f"{budget:g}, {CALIBRATION} calibration inputs")
        client.load(name, model, (x,), precision="auto", max_error=budget,
                    calibration=calibration, wait=False)
        if wait_model(client, name)["state"] != "ready":
            print(f"demo: {name} failed to load", file=sys.stderr)
            return False
        names[name] = f"auto {budget:g}"
    print()
    rows = []
    fp32_ms = None
    for name, label in names.items():
        report = client.compare(name)
        with torch.no_grad():
            pairs = [(client.infer(name, h, shm=True)["output0"], model(h)) for h in held]
        # the budget's metric over the held-out set (docs/PRECISION.md): the largest
        # difference on any of them over the largest value on any of them
        error = float(max((got - want).abs().max() for got, want in pairs)
                      / max(want.abs().max() for _, want in pairs))
        ms = median_ms(lambda n=name: client.infer(n, x, shm=True))
        fp32_ms = fp32_ms or ms
        parts = ", ".join(f"{p['id']} {p['device']}/{p['runtime']}/{p['precision']}"
                          for p in report["parts"])
        rows.append([label, parts, f"{ms:.2f}", f"{ms / fp32_ms:.2f}", f"{error:.1e}"])
        if report["max_error"] and error > report["max_error"]:
            print(f"  {label}: held-out inputs measure {error:.1e}, over the budget the "
                  "calibration inputs were checked on: give more calibration inputs")
        for note in report["notes"]:
            print(f"  {label}: {note}")
    print("\n" + format_table(["POLICY", "PARTS", "p50 ms", "vs fp32", "ERROR (held-out)"],
                              rows))
    print("(`cuvilctl compare NAME` shows every candidate; docs/PRECISION.md the metric)")
    return True


def main() -> int:
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    with tempfile.TemporaryDirectory(prefix="cuvild-demo-") as tmp:
        config["listen"]["unix"] = f"{tmp}/cuvild.sock"
        config["state_dir"] = f"{tmp}/state"
        config["cache_dir"] = f"{tmp}/cache"
        config_path = Path(tmp) / "cuvild.yaml"
        config_path.write_text(yaml.safe_dump(config))
        target = f"unix://{tmp}/cuvild.sock"
        print(f"demo: starting cuvild (state in {tmp}); the first start measures the devices")
        t0 = time.perf_counter()
        log_path = Path(tmp) / "cuvild.log"  # its own lines would break the demo's progress
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "cuvild", "--config",
                                     str(config_path)], cwd=ROOT, stderr=log_file)
        code = 1
        try:
            wait_ready(target, proc)
            print(f"demo: cuvild ready in {time.perf_counter() - t0:.1f} s (its log: "
                  f"{log_path}, kept while the demo runs)\n")
            with Client(target, timeout=120) as client:
                code = run(client)
        finally:
            proc.send_signal(signal.SIGTERM)
            stopped = proc.wait(60)
            if code or stopped:
                tail = log_path.read_text(errors="replace").splitlines()[-20:]
                print("demo: the end of cuvild's log:\n  " + "\n  ".join(tail),
                      file=sys.stderr)
        left = [p.name for p in Path("/dev/shm").glob(f"cuvil-{proc.pid}-*")]
        print(f"demo: cuvild stopped (exit {stopped}); shared memory left behind: "
              f"{left or 'none'}")
        return code or stopped or (1 if left else 0)


if __name__ == "__main__":
    sys.exit(main())
