"""`make demo`: start cuvild on the demo layout (CPU + emulated NPU) in a temporary state dir,
show what it measured, and stop it leaving nothing behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cuvild.cli import print_status
from cuvild.client import Client

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 180


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
        proc = subprocess.Popen([sys.executable, "-m", "cuvild", "--config", str(config_path)],
                                cwd=ROOT)
        try:
            wait_ready(target, proc)
            print(f"demo: ready in {time.perf_counter() - t0:.1f} s\n")
            with Client(target) as client:
                print_status(client.status())
            print()
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        print(f"demo: cuvild stopped (exit {code})")
        return code


if __name__ == "__main__":
    sys.exit(main())
