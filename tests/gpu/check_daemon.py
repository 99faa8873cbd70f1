"""The daemon on a GPU host, as check_gpu.py's last sections: one cuvild with the host's CPU
and GPU, driven the way users drive it (cuvild.client, tritonclient).

The daemon starts from the profile check_gpu.py measured into its state directory
(`seed_profile`). Sections, what decides most first:
- gpu: resnet18 on the GPU (fp32, then bf16 last), end to end through tritonclient and the
  fast path next to its part alone (the plan's measured ms; its notes say whether the part
  runs as a CUDA graph);
- unpinned: the 2048-wide MLP at b16 and a bf16 ResNet-18 loaded with no device asked: where
  they go, each part predicted vs measured;
- split: a model whose backbone is annotated `@partition(device="gpu")` and head
  `@partition(device="cpu")`; its plan, every cut's predicted copy time next to a measured
  copy of as many bytes in the same direction (pinned host memory, CUDA events), the answer
  against eager, and end-to-end p50 next to the parts' measured times;
- demo: that model split, all on the GPU, all on the CPU and as planned unannotated;
- cuda_shm: tritonclient's cuda_shared_memory regions for input and output, registered,
  used, unregistered; the answer against eager; the GPU worker opens the regions itself and
  its part reads and writes them in place (cuvild/workers/cudamem.py: first run on a GPU);
- batching: an MLP with a dynamic batch, 1 client in turn vs 16 clients at once;
- restart: cuvild stopped and started on the same state and cache: time to READY, and each
  model's own restore time.

Each section records its own error and the next one runs. Needs grpcio and tritonclient
(check_gpu.py says how they travel to a machine that lacks them).
"""

from __future__ import annotations

import copy
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 50
CLIENTS = 16


def median_ms(fn: Callable[[], Any], rounds: int = ROUNDS, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return round(statistics.median(samples) * 1e3, 3)


def rel_error(got: Any, want: Any) -> float:
    import torch

    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    return float((got - want).abs().max() / want.abs().max())


def write_config(tmp: Path) -> Path:
    """The daemon's config under `tmp` (its state and cache there too)."""
    import yaml

    try:
        import openvino  # noqa: F401 - only to learn whether to enable its devices
        openvino_present = True
    except ImportError:
        openvino_present = False
    config = {
        "listen": {"unix": str(tmp / "cuvild.sock")},
        "state_dir": str(tmp / "state"), "cache_dir": str(tmp / "cache"),
        "log_level": "info",
        "devices": {"cpu": {"enabled": True}, "gpu": {"enabled": True},
                    "openvino": {"enabled": openvino_present}},
        # Every merged batch size is its own bucket: room for all of them.
        "engine": {"max_buckets": CLIENTS + 2, "compile_timeout_s": 600},
    }
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "cuvild.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def seed_profile(tmp: Path) -> dict[str, Any]:
    """Measure the host's devices as the daemon on `tmp`'s config would, into its state
    directory: the daemon then starts from this profile (no second measurement, no second
    AOTInductor check)."""
    from cuvild.config import load
    from runtimes.profiling.measure import load_or_measure

    cfg = load(write_config(tmp))
    result = load_or_measure(cfg.state_dir, cfg.device_settings(), refresh=True)
    return {"seconds": round(result.seconds, 1), "fingerprint": result.fingerprint,
            "devices": [d.to_dict() for d in result.devices]}


class Daemon:
    """cuvild in a subprocess on the config of `tmp` (write_config); its log goes to $OUT."""

    def __init__(self, tmp: Path, out: Path | None) -> None:
        self.tmp, self.out = tmp, out
        self.config = tmp / "cuvild.yaml"
        if not self.config.exists():
            write_config(tmp)
        self.target = f"unix://{tmp}/cuvild.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> float:
        """Start; seconds until it answers health SERVING."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self.starts += 1
        log = open((self.out or self.tmp) / f"cuvild_{self.starts}.log", "wb")  # noqa: SIM115
        from runtimes.base import child_env

        env = child_env()
        # as a user starts it: not with this process's inductor and Triton cache directories
        # (inductor writes /tmp/torchinductor_<user> into the environment at its first use):
        # they are its cache_dir's, and the restart is timed on what that holds (check_gpu.py
        # points its own compiles there, to warm the first start)
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            env.pop(name, None)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "cuvild", "--config",
                                      str(self.config)], cwd=ROOT, env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.perf_counter() - t0 < 300:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"cuvild exited {self.proc.returncode} at start "
                                       f"(log: cuvild_{self.starts}.log)")
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        return time.perf_counter() - t0
                except grpc.RpcError:
                    time.sleep(0.1)
        raise RuntimeError("cuvild did not answer health within 300 s")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


ACCELERATOR = "gpu"  # `python tests/gpu/check_daemon.py --cpu` dry-runs it all on the CPU


def demo_model(backbone: str | None, head: str | None) -> tuple[Any, tuple[Any, ...]]:
    """The GPU demo: a ResNet-18 backbone (width 64) and an MLP head, each annotated with a
    device (None: left to the planner); the same weights whatever the annotations."""
    import torch
    from torch import nn

    from cuvild.client.samples import ResNet18
    from partitioner.annotate import partition

    def on(device: str | None, module: nn.Module) -> nn.Module:
        return partition(device=device)(module) if device else module

    class GpuDemo(nn.Module):
        def __init__(self, width: int = 64, classes: int = 1000) -> None:
            super().__init__()
            body = ResNet18(num_classes=classes, width=width)
            self.backbone = on(backbone, nn.Sequential(body.stem, body.layers))
            self.head = on(head, nn.Sequential(nn.Linear(8 * width, 1024), nn.GELU(),
                                               nn.Linear(1024, classes)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.backbone(x)
            return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    return GpuDemo().eval(), (torch.randn(1, 3, 224, 224),)


def split_model() -> tuple[Any, tuple[Any, ...]]:
    """The demo split by annotation: backbone on the accelerator, head on the CPU."""
    return demo_model(ACCELERATOR, "cpu")


def measured_copy_ms(nbytes: int, to_device: bool) -> float:
    """One copy of `nbytes` between pinned host memory and the GPU: median of 20, by events."""
    import torch

    host = torch.empty(max(nbytes, 1), dtype=torch.uint8).pin_memory()
    dev = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if to_device:
            dev.copy_(host, non_blocking=True)
        else:
            host.copy_(dev, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return round(statistics.median(times), 4)


def section_split(client: Any, result: dict[str, Any]) -> None:
    import torch

    model, args = split_model()
    t0 = time.perf_counter()
    client.load("split", model, args, precision="fp32", timeout=600)
    result["load_s"] = round(time.perf_counter() - t0, 1)
    plan = client.plan("split")
    result["explain"] = plan["explain"]
    parts = {p["id"]: p for p in plan["plan"]["parts"]}
    result["parts"] = [{k: p[k] for k in ("id", "device", "runtime", "precision",
                                          "predicted_ms")} for p in parts.values()]
    with torch.inference_mode():
        expected = model(*args)
    got = client.infer("split", args[0])["output0"]
    result["error_vs_eager"] = rel_error(got, expected)
    result["e2e_ms"] = median_ms(lambda: client.infer("split", args[0]))
    measured = client.plan("split")["measured"]
    result["parts_measured_ms"] = {p: m.get("measured_ms") for p, m in measured.items()}
    cuts = []
    for c in plan["plan"]["cuts"]:
        src = parts.get(c["src"], {}).get("device", c["src"])
        dst = parts.get(c["dst"], {}).get("device", c["dst"])
        row = {"src": f"{c['src']}({src})", "dst": f"{c['dst']}({dst})", "bytes": c["bytes"],
               "predicted_ms": round(c["predicted_ms"], 4)}
        if ACCELERATOR == "gpu" and str(dst).startswith("gpu") != str(src).startswith("gpu"):
            row["measured_ms"] = measured_copy_ms(c["bytes"], str(dst).startswith("gpu"))
        cuts.append(row)
    result["cuts"] = cuts


def section_gpu(client: Any, fast: Any, result: dict[str, Any],
                precisions: tuple[str, ...]) -> None:
    import numpy as np
    import torch
    import tritonclient.grpc as grpcclient

    from cuvild.client.samples import reference
    from partitioner.annotate import partition

    model, args = reference("resnet18")
    with torch.inference_mode():
        expected = model(*args)
    x = args[0]
    triton = grpcclient.InferenceServerClient(url=client.target)
    for precision in precisions:
        row: dict[str, Any] = {}
        result[precision] = row
        name = f"resnet18_{precision}"
        try:
            # Pinned to the accelerator: this section measures the GPU path end to end, not
            # the placement (on the H200 the cost model put the bf16 model on the CPU, 22.7 ms).
            # fp32 is a load policy; bf16 is asked for in the model, as users annotate it.
            annotated = partition(device=ACCELERATOR,
                                  precision=None if precision == "fp32" else precision)(
                copy.deepcopy(model))
            t0 = time.perf_counter()
            client.load(name, annotated, args, timeout=600,
                        precision="fp32" if precision == "fp32" else None)
            row["load_s"] = round(time.perf_counter() - t0, 1)
            plan = client.plan(name)
            row["parts"] = [(p["id"], p["device"], p["runtime"], p["precision"])
                            for p in plan["plan"]["parts"]]
            row["error_vs_eager"] = rel_error(client.infer(name, x)["output0"], expected)
            meta = client.metadata(name)
            inp = grpcclient.InferInput(meta["inputs"][0]["name"], list(x.shape), "FP32")
            inp.set_data_from_numpy(x.numpy())
            row["tritonclient_ms"] = median_ms(lambda n=name, i=inp: triton.infer(n, [i]))
            row["fast_path_ms"] = median_ms(lambda n=name: fast.infer(n, x))
            measured = client.plan(name)["measured"]
            row["parts_measured_ms"] = {p: m.get("measured_ms") for p, m in measured.items()}
            part_ms = sum(v for v in row["parts_measured_ms"].values() if v)
            if part_ms:
                row["fast_path_over_parts"] = round(row["fast_path_ms"] / part_ms, 3)
                row["tritonclient_over_parts"] = round(row["tritonclient_ms"] / part_ms, 3)
            out = triton.infer(name, [inp]).as_numpy("output0")
            row["tritonclient_error"] = rel_error(np.asarray(out), expected)
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:1500]
    triton.close()


def section_cuda_shm(client: Any, result: dict[str, Any]) -> None:
    import numpy as np
    import torch
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.cuda_shared_memory as cudashm

    from cuvild.client.samples import reference

    name = "resnet18_fp32"
    model, args = reference("resnet18")
    with torch.inference_mode():
        expected = model(*args).numpy()
    x = args[0].numpy()
    triton = grpcclient.InferenceServerClient(url=client.target)
    in_handle = cudashm.create_shared_memory_region("in", x.nbytes, 0)
    out_handle = cudashm.create_shared_memory_region("out", expected.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(in_handle, [x])
        triton.register_cuda_shared_memory("in", cudashm.get_raw_handle(in_handle), 0, x.nbytes)
        triton.register_cuda_shared_memory("out", cudashm.get_raw_handle(out_handle), 0,
                                           expected.nbytes)
        result["status_registered"] = triton.get_cuda_shared_memory_status(as_json=True)
        input_name = client.metadata(name)["inputs"][0]["name"]
        inp = grpcclient.InferInput(input_name, list(x.shape), "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = grpcclient.InferRequestedOutput("output0")
        out.set_shared_memory("out", expected.nbytes)
        response = triton.infer(name, [inp], outputs=[out])
        meta = response.get_output("output0")
        got = cudashm.get_contents_as_numpy(out_handle, np.float32, list(meta.shape))
        result["error_vs_eager"] = rel_error(got, expected)
        result["cuda_shm_ms"] = median_ms(lambda: triton.infer(name, [inp], outputs=[out]))
        bad = grpcclient.InferInput(input_name, list(x.shape), "FP32")
        bad.set_shared_memory("in", x.nbytes, offset=8)
        try:
            triton.infer(name, [bad])
            result["past_the_end"] = "ANSWERED (wrong)"
        except Exception as e:
            result["past_the_end"] = str(e)[:300]
        triton.unregister_cuda_shared_memory("in")
        triton.unregister_cuda_shared_memory("out")
        result["status_after"] = triton.get_cuda_shared_memory_status(as_json=True)
    finally:
        cudashm.destroy_shared_memory_region(in_handle)
        cudashm.destroy_shared_memory_region(out_handle)
        triton.close()


def section_batching(client: Any, result: dict[str, Any]) -> None:
    import torch
    import tritonclient.grpc as grpcclient
    from torch import nn

    from partitioner.annotate import partition

    torch.manual_seed(0)
    width = 2048
    # On the accelerator: batching's gain there is what this measures (the placement put it
    # on the CPU on the H200, after the GPU parts' measured times).
    model = partition(device=ACCELERATOR)(nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
        nn.Linear(width, width))).eval()
    x = torch.randn(1, width)
    batch = torch.export.Dim("batch", min=1, max=64)
    t0 = time.perf_counter()
    # Exported at 2 rows: an example of 1 would specialise the batch to a constant.
    client.load("mlp_b", model, (torch.randn(2, width),), dynamic_shapes=({0: batch},),
                precision="fp32",
                batching={"max_batch": CLIENTS, "max_delay_us": 4000}, timeout=600)
    result["load_s"] = round(time.perf_counter() - t0, 1)
    result["parts"] = [(p["id"], p["device"], p["runtime"])
                       for p in client.plan("mlp_b")["plan"]["parts"]]
    # Build the sizes the measured runs merge into, so no build lands inside them.
    t0 = time.perf_counter()
    for rows in (CLIENTS, CLIENTS // 2, 1):  # what lockstep clients merge into, padded
        client.infer("mlp_b", torch.randn(rows, width))
    result["warm_buckets_s"] = round(time.perf_counter() - t0, 1)
    per_client = 40
    input_name = client.metadata("mlp_b")["inputs"][0]["name"]

    def one_client(barrier: threading.Barrier | None, out: list[float]) -> None:
        triton = grpcclient.InferenceServerClient(url=client.target)
        inp = grpcclient.InferInput(input_name, [1, width], "FP32")
        inp.set_data_from_numpy(x.numpy())
        for _ in range(per_client):
            if barrier is not None:
                barrier.wait()
            t0 = time.perf_counter()
            triton.infer("mlp_b", [inp])
            out.append(time.perf_counter() - t0)
        triton.close()

    alone: list[float] = []
    t0 = time.perf_counter()
    one_client(None, alone)
    result["one_client_rps"] = round(per_client / (time.perf_counter() - t0), 1)
    result["one_client_p50_ms"] = round(statistics.median(alone) * 1e3, 3)
    barrier = threading.Barrier(CLIENTS)
    samples: list[float] = []
    threads = [threading.Thread(target=one_client, args=(barrier, samples))
               for _ in range(CLIENTS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    wall = time.perf_counter() - t0
    result[f"{CLIENTS}_clients_rps"] = round(CLIENTS * per_client / wall, 1)
    result[f"{CLIENTS}_clients_p50_ms"] = round(statistics.median(samples) * 1e3, 3)
    result["throughput_ratio"] = round(result[f"{CLIENTS}_clients_rps"]
                                       / result["one_client_rps"], 2)
    try:
        result["buckets"] = client.plan("mlp_b")["plan"].get("notes", [])[-3:]
    except Exception as e:  # only for the record
        result["buckets"] = str(e)


def section_unpinned(client: Any, fast: Any, result: dict[str, Any]) -> None:
    """The models the H200's daemon put on the CPU, loaded with no device asked: where they
    go, each part predicted vs measured, and end to end."""
    import torch
    from torch import nn

    from cuvild.client.samples import reference
    from partitioner.annotate import partition

    torch.manual_seed(0)
    width = 2048
    mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width),
                        nn.GELU(), nn.Linear(width, width)).eval()
    resnet, args = reference("resnet18")
    models = {"mlp_b16": (mlp, (torch.randn(16, width),)),
              "resnet18_bf16_free": (partition(precision="bf16")(resnet), args)}
    for name, (model, inputs) in models.items():
        row: dict[str, Any] = result.setdefault(name, {})
        try:
            t0 = time.perf_counter()
            client.load(name, model, inputs, timeout=600)
            row["load_s"] = round(time.perf_counter() - t0, 1)
            row["fast_path_ms"] = median_ms(lambda n=name, x=inputs[0]: fast.infer(n, x))
            plan = client.plan(name)
            measured = plan["measured"]
            row["parts"] = [{"id": p["id"], "device": p["device"], "runtime": p["runtime"],
                             "precision": p["precision"], "kernels": p.get("kernels"),
                             "predicted_ms": round(p["predicted_ms"], 3),
                             "measured_ms": (measured.get(p["id"]) or {}).get("measured_ms")}
                            for p in plan["plan"]["parts"]]
            row["notes"] = [n for n in plan["plan"].get("notes", [])
                            if "never worse" in n or "corrections" in n or "graph" in n]
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:1500]


def section_demo(client: Any, fast: Any, result: dict[str, Any]) -> None:
    """The demo model end to end: split by annotation, all on the GPU, all on the CPU, and
    as the planner places it unannotated."""
    import torch

    for label, devices in (("split", (ACCELERATOR, "cpu")), ("gpu_only", (ACCELERATOR,) * 2),
                           ("cpu_only", ("cpu", "cpu")), ("planned", (None, None))):
        row: dict[str, Any] = result.setdefault(label, {})
        try:
            model, args = demo_model(*devices)
            with torch.inference_mode():
                expected = model(*args)
            name = f"demo_{label}"
            client.load(name, model, args, precision="fp32", timeout=600)
            row["error_vs_eager"] = rel_error(fast.infer(name, args[0])["output0"], expected)
            row["fast_path_ms"] = median_ms(lambda n=name, x=args[0]: fast.infer(n, x))
            row["parts"] = [(p["id"], p["device"], round(p["predicted_ms"], 3))
                            for p in client.plan(name)["plan"]["parts"]]
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:1500]
    done = {k: v["fast_path_ms"] for k, v in result.items() if "fast_path_ms" in v}
    if done:
        best = min(done.values())
        result["over_best"] = {k: round(v / best, 3) for k, v in done.items()}


def section_restart(daemon: Daemon, result: dict[str, Any]) -> None:
    from cuvild.client import Client

    result["stop_exit"] = daemon.stop()
    result["health_s"] = round(daemon.start(), 2)
    t0 = time.perf_counter()
    with Client(daemon.target, timeout=60) as client:
        while time.perf_counter() - t0 < 300:
            models = client.models()
            if models and all(m["state"] != "loading" for m in models):
                break
            time.sleep(0.02)
        result["all_ready_s_after_health"] = round(time.perf_counter() - t0, 2)
        result["states"] = {m["name"]: m["state"] for m in models}
        result["warm"] = {m["name"]: m.get("warm") for m in models}
        result["load_s"] = {m["name"]: m.get("load_s") for m in models}  # per model, restored


def run(out: Path | None, record: Callable[[str, dict[str, Any]], None],
        deadline: Callable[[], float], tmp: Path | None = None) -> None:
    """All sections; `record(name, result)` stores each as it ends. `tmp`: a directory whose
    state already holds the measured profile (seed_profile), else a new one."""
    import tempfile

    from cuvild.client import Client

    tmp = tmp or Path(tempfile.mkdtemp(prefix="cuvild-gpu-daemon-"))
    daemon = Daemon(tmp, out)
    start: dict[str, Any] = {}
    try:
        start["health_s"] = round(daemon.start(), 2)
        client = Client(daemon.target, timeout=120)
        start["devices"] = client.status().get("devices")
    except Exception as e:
        traceback.print_exc()
        start["error"] = f"{type(e).__name__}: {e}"
        record("daemon_start", start)
        daemon.stop()
        return
    record("daemon_start", start)
    fast = Client(daemon.target, timeout=120, fast=True)
    steps: list[tuple[str, Callable[[dict[str, Any]], None]]] = [  # what decides most first
        ("daemon_gpu", lambda r: section_gpu(client, fast, r, ("fp32",))),
        ("daemon_unpinned", lambda r: section_unpinned(client, fast, r)),
        ("daemon_batching", lambda r: section_batching(client, r)),
        ("daemon_cuda_shm", lambda r: section_cuda_shm(client, r)),
        ("daemon_split", lambda r: section_split(client, r)),
        ("daemon_demo", lambda r: section_demo(client, fast, r)),
        ("daemon_gpu_bf16", lambda r: section_gpu(client, fast, r, ("bf16",))),
    ]
    if ACCELERATOR != "gpu":  # the dry run: what needs no CUDA
        steps = [s for s in steps if s[0] != "daemon_cuda_shm"]
    for name, step in steps:
        result: dict[str, Any] = {}
        if deadline() <= 0:
            result["skipped"] = "past the time budget"
        else:
            print(f"---- {name}", flush=True)
            t0 = time.perf_counter()
            try:
                step(result)
            except Exception as e:
                traceback.print_exc()
                result["error"] = f"{type(e).__name__}: {e}"[:2000]
            result["section_s"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {result}", flush=True)
        record(name, result)
    fast.close()
    client.close()
    restart: dict[str, Any] = {}
    try:
        section_restart(daemon, restart)
    except Exception as e:
        traceback.print_exc()
        restart["error"] = f"{type(e).__name__}: {e}"
    record("daemon_restart", restart)
    code = daemon.stop()
    left = [p.name for p in Path("/dev/shm").glob("cuvil-*")]
    record("daemon_stop", {"exit": code, "shm_left": left})


if __name__ == "__main__":
    import json

    if "--cpu" in sys.argv:
        ACCELERATOR = "cpu"
    import tempfile

    found: dict[str, Any] = {}
    end = time.monotonic() + 600
    where = Path(tempfile.mkdtemp(prefix="cuvild-gpu-daemon-"))
    found["seeded"] = {k: v for k, v in seed_profile(where).items() if k != "devices"}
    run(None, found.__setitem__, lambda: end - time.monotonic(), where)
    print(json.dumps(found, indent=1, default=str))
