"""The Open Inference Protocol over HTTP/REST against gRPC, through tritonclient (a `make bench`
section): one daemon with both listeners on loopback, a small MLP and resnet18 (fp32) at batch 1,
interleaved rounds; p50/p99 ms and the error against eager for gRPC, HTTP binary data and HTTP
JSON (a 224x224 image is 150,528 numbers as JSON text)."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from daemons import DaemonProcess, free_port, suite_config  # noqa: E402

from cuvild.client import Client, samples  # noqa: E402

ROUNDS, WARMUP = 300, 20


def measure(name: str, model: torch.nn.Module, x: torch.Tensor, tcp: str, http: str,
            rounds: int) -> None:
    g, h = grpcclient.InferenceServerClient(url=tcp), httpclient.InferenceServerClient(url=http)
    xn = x.numpy()

    def by_grpc() -> np.ndarray:
        given = grpcclient.InferInput("x", list(xn.shape), "FP32")
        given.set_data_from_numpy(xn)
        return g.infer(name, [given]).as_numpy("output0")

    def by_http(binary: bool) -> Callable[[], np.ndarray]:
        def call() -> np.ndarray:
            given = httpclient.InferInput("x", list(xn.shape), "FP32")
            given.set_data_from_numpy(xn, binary_data=binary)
            wanted = [httpclient.InferRequestedOutput("output0", binary_data=binary)]
            return h.infer(name, [given], outputs=wanted).as_numpy("output0")
        return call

    ways = {"grpc (tcp)": by_grpc, "http binary": by_http(True), "http json": by_http(False)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for call in ways.values():
        for _ in range(WARMUP):
            call()
    for _ in range(rounds):
        for way, call in ways.items():
            t0 = time.perf_counter()
            call()
            times[way].append((time.perf_counter() - t0) * 1e3)
    want = model(x).detach().numpy()
    print(f"{name}, batch 1, input {list(x.shape)}, {rounds} interleaved rounds, tritonclient")
    base = statistics.median(times["grpc (tcp)"])
    for way, call in ways.items():
        error = float(np.abs(call() - want).max())
        p50 = statistics.median(times[way])
        print(f"  {way:12s} p50 {p50:8.3f} ms   p99 {np.percentile(times[way], 99):8.3f} ms   "
              f"{p50 / base:5.2f}x gRPC   max error {error:.1e}")
    g.close()
    h.close()


def main() -> None:
    work, sock = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp(dir="/tmp"))
    http, tcp = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = suite_config(work, work / "state", sock, log_level="info",
                          listen={"http": http, "tcp": tcp, "insecure_loopback": True})
    daemon = DaemonProcess(work, config).start()
    try:
        torch.manual_seed(0)
        models = {"mlp": (samples.MLP(width=64, depth=2).eval(), torch.randn(1, 64), ROUNDS)}
        resnet, (image,) = samples.reference("resnet18")
        models["resnet18"] = (resnet, image, ROUNDS // 6)
        with Client(daemon.target) as client:
            for name, (model, x, _) in models.items():
                client.load(name, model, (x,))
        for name, (model, x, rounds) in models.items():
            measure(name, model, x, tcp, http, rounds)
    finally:
        daemon.close()


if __name__ == "__main__":
    main()
