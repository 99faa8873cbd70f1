"""Validate and time cuvild's GPU path on a CUDA machine, in one call of at most 8 minutes.

    cd <repo> && python3 tests/gpu/check_gpu.py            # the lease script
    python3 tests/gpu/check_gpu.py --budget 240 --skip-daemon
    python3 tests/gpu/check_gpu.py --timing --pytest       # + the older per-model rows, pytest

Made for a lent GPU machine with no network: it uses the system python and what is installed
there (torch, triton; torchvision, pytest if present). The daemon sections also need
grpcio, protobuf, pyyaml and tritonclient at our pins: `tests/gpu/lease.sh prepare` here makes
them wheels, `bash tests/gpu/lease.sh run` there installs them and runs this
(docs/RUNTIMES.md). Sections, each of which reports its error and lets the next one run, in
the order of what decides most:

1. environment: nvidia-smi, versions, the C compiler and headers AOTInductor needs;
2. the profile: the host's devices measured exactly as the daemon will measure them, into
   the daemon's state directory (tests/gpu/check_daemon.py seed_profile), so the daemon
   starts from it (no second measurement, no second AOTInductor check); the GPU's figures
   next to its datasheet's (H100 SXM and PCIe, H200), its compiled-part call and per-kernel
   cost (runtimes/profiling/calls.py);
3. host<->device copies from pinned and from pageable memory;
4. parts (tests/gpu/check_parts.py): resnet18 b1 fp32/bf16, bert4 b1, resnet18 b16 bf16, each
   kernel by kernel and as a CUDA graph, against a manual torch.cuda.graph replay of the same
   compiled function and torch.compile; torch.profiler per part, peak GPU memory, pinned vs
   pageable inputs, the restart path (save, load, first run); then a language model's
   stateful part on the GPU (tests/gpu/check_lm.py): greedy tokens vs the host's, its
   logits error per precision, a decode step at context 64 and 512 vs torch eager;
5. the daemon (tests/gpu/check_daemon.py): resnet18 end to end (fast path, tritonclient) vs
   its part, the bf16 ResNet-18 and the MLP loaded unpinned (where they go, predicted vs
   measured), batching at 1 vs 16 clients with its buckets warmed first, CUDA shared memory,
   the split model's cuts, the demo model split vs GPU-only vs CPU-only, a restart to READY;
6. AOTInductor three ways (as built, run_single_threaded, constants outside the .so), each
   loaded in a fresh process, with a native backtrace (gdb) where one crashes;
7. with --timing, the older per-model rows (eager, torch.compile, the part; resnet50 too);
   with --pytest, `pytest tests/gpu` (it recompiles everything: not in the lease by default).

Sections 4-7 run in child processes of this script (faulthandler on): a crash loses its own
rows only. After a crash of a compile, AOTInductor is switched off (CUVILD_TRITON_AOTI=0) for
the rest of the run; so it is from the start when the measured profile lists aoti-broken.

Every section has a share of the budget: past it, the remaining work is skipped and says so.
A JSON summary goes to $OUT/gpu_summary.json when OUT is set (rewritten after every section,
so a killed run still leaves one). On a host without CUDA every section says "no CUDA
device" and the run exits 1 (a dry run of the script itself).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = Path(tempfile.mkdtemp(prefix="cuvild-gpu-check-"))
DAEMON_DIR = SCRATCH / "daemon"  # the daemon's config, state (the seeded profile) and cache
# Set before torch and triton are imported: both read their cache locations from these. The
# daemon's own (its cache_dir's, where cuvild puts them: check_daemon.py starts it without
# these variables), so that the parts compiled here warm the daemon's first start, and its
# restart is timed on what its cache directory holds.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(DAEMON_DIR / "cache" / "inductor"))
os.environ.setdefault("TRITON_CACHE_DIR", str(DAEMON_DIR / "cache" / "triton"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from runtimes.base import child_env  # noqa: E402 - after the path; imports no torch

MODELS = ("resnet18", "resnet50", "bert4")
BATCHES = (1, 16)
PRECISIONS = ("fp32", "bf16")
WARMUP, REPS = 10, 50
T0 = time.monotonic()
SUMMARY: dict[str, Any] = {"errors": []}


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {message}", flush=True)


def elapsed() -> float:
    return time.monotonic() - T0


def write_summary() -> None:
    SUMMARY["wall_s"] = round(elapsed(), 1)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "gpu_summary.json").write_text(json.dumps(SUMMARY, indent=1, default=str))


def section(name: str, fn: Callable[[], Any]) -> Any:
    """Run one section; an exception is printed and recorded, and the check goes on."""
    say(f"==== {name}")
    try:
        return fn()
    except Exception as e:
        traceback.print_exc()
        SUMMARY["errors"].append(f"{name}: {type(e).__name__}: {e}")
        return None
    finally:
        write_summary()


# ---- 1. environment -----------------------------------------------------------------------

def environment() -> dict[str, Any]:
    import sysconfig

    env: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=name,driver_version,memory.total,compute_cap",
                 "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:  # older drivers lack compute_cap
            done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = (done.stdout or done.stderr).strip()
    else:
        env["nvidia_smi"] = "nvidia-smi not found"
    print(env["nvidia_smi"], flush=True)
    import torch

    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version(), cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    for module in ("triton", "pytest", "yaml", "numpy"):
        try:
            env[module] = __import__(module).__version__
        except Exception as e:  # a missing optional package is a fact to report, not a failure
            env[module] = f"absent ({type(e).__name__})"
    # AOTInductor builds a C++ wrapper and Triton a C launcher: both need these.
    env["cxx"] = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or "absent"
    env["cc"] = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc") or "absent"
    include = sysconfig.get_paths().get("include", "")
    env["python_h"] = str(Path(include, "Python.h").exists())
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        env["cuda_home"] = str(CUDA_HOME)
    except Exception as e:
        env["cuda_home"] = f"unknown ({type(e).__name__}: {e})"
    from runtimes.triton import TritonRuntime

    env["triton_runtime"] = TritonRuntime.unavailable() or "available"
    env["triton_runtime_version"] = TritonRuntime.version()
    for key, value in env.items():
        print(f"  {key}: {value}", flush=True)
    return env


# ---- 2. per-model timing ------------------------------------------------------------------

def median_ms(fn: Callable[[], Any]) -> float:
    import torch

    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return round(statistics.median(samples) * 1e3, 3)


def relative_error(out: Any, ref: Any) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def eager_ms(module: Any, args: tuple[Any, ...], dtype: Any, device: Any) -> dict[str, Any]:
    """torch eager and torch.compile on the GPU, on device-resident inputs (and eager with host
    tensors in and out, as the engine hands a part its inputs)."""
    import torch

    from runtimes.triton import _math

    # A copy: Module.to() converts in place, and `module` is the fp32 CPU reference whose
    # weights the part shares.
    eager = copy.deepcopy(module).to(device=device, dtype=dtype)
    dev_args = [a.to(device=device, dtype=dtype) for a in args]
    row: dict[str, Any] = {}
    # Same math as the runtime: no TF32 for fp32 (see runtimes/triton.py _strict_fp32).
    with torch.inference_mode(), _math(device, dtype):
        row["eager_gpu_ms"] = median_ms(lambda: eager(*dev_args))
        row["eager_gpu_host_io_ms"] = median_ms(
            lambda: eager(*(a.to(device, dtype) for a in args)).float().cpu())
        compiled = torch.compile(eager)
        t0 = time.perf_counter()
        compiled(*dev_args)
        row["torch_compile_s"] = round(time.perf_counter() - t0, 2)
        row["torch_compile_gpu_ms"] = median_ms(lambda: compiled(*dev_args))
        # CUDA graphs (inductor's cudagraph trees): what a static-shape part could gain at
        # small batch, where launches, not FLOPs, are the time (resnet18 b1 on the H200:
        # 2.2 ms for a 0.09 ms roofline). Measured only, for the decision to use them.
        try:
            graphed = torch.compile(copy.deepcopy(eager), mode="reduce-overhead")
            t0 = time.perf_counter()
            for _ in range(3):  # cudagraph trees record on a later call than the first
                graphed(*dev_args)
            row["cudagraphs_compile_s"] = round(time.perf_counter() - t0, 2)
            row["cudagraphs_gpu_ms"] = median_ms(lambda: graphed(*dev_args))
        except Exception as e:  # a measurement only: its failure is a fact to report
            row["cudagraphs_error"] = f"{type(e).__name__}: {e}"[:500]
    return row


def time_precision(module: Any, args: tuple[Any, ...], expected: Any, part: Any,
                   precision: str, device: Any) -> dict[str, Any]:
    """The compiled part against eager and torch.compile on the GPU, for one precision."""
    import torch

    from partitioner.profile import DeviceProfile
    from runtimes.base import TOLERANCE, CompileSpec
    from runtimes.triton import DTYPES, TritonRuntime, _math

    dtype = DTYPES[precision]
    gpu = DeviceProfile(id="gpu0", kind="gpu", runtimes=["triton"])
    spec = CompileSpec(gpu, precision, list(args))
    t0 = time.perf_counter()  # first, on cold caches: torch.compile below shares its kernels
    executable = TritonRuntime().compile(part, spec)
    row: dict[str, Any] = {"cold_compile_s": round(time.perf_counter() - t0, 2),
                           "path": executable.path}
    if executable.aoti_error:
        row["aoti_error"] = executable.aoti_error[:2000]
    row.update(eager_ms(module, args, dtype, device))
    dev_args = [a.to(device=device, dtype=dtype) for a in args]
    out = executable.run(list(args))[0]
    row["relative_error"] = relative_error(out, expected)
    row["within_tolerance"] = row["relative_error"] < TOLERANCE[precision]
    row["part_host_io_ms"] = median_ms(lambda: executable.run(list(args)))
    with torch.inference_mode(), _math(device, dtype):
        row["part_gpu_ms"] = median_ms(lambda: executable.model(*dev_args))
    row["part_over_torch_compile"] = round(row["part_gpu_ms"] / row["torch_compile_gpu_ms"], 3)
    row["part_over_eager"] = round(row["part_gpu_ms"] / row["eager_gpu_ms"], 3)
    if executable.package is not None:
        saved = SCRATCH / f"{id(part)}-{precision}"
        executable.save(saved)
        row["package_mb"] = round((saved / "part.pt2").stat().st_size / 1e6, 1)
        t0 = time.perf_counter()
        loaded = TritonRuntime().load(saved, spec)
        row["warm_load_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        again = loaded.run(list(args))[0]
        row["first_run_after_load_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        row["load_matches_compile"] = bool(torch.equal(again, out))
    return row


def reference_model(name: str, batch: int) -> tuple[Any, tuple[Any, ...]]:
    import torch

    if name != "resnet50":
        from cuvild.client.samples import reference

        return reference(name, batch)
    import torchvision  # a missing one is reported as this model's error

    torch.manual_seed(0)
    return (torchvision.models.resnet50(weights=None).eval(),
            (torch.randn(batch, 3, 224, 224),))


def time_model(name: str, batch: int, deadline: float,
               keep: Callable[[str, Any], None]) -> dict[str, Any]:
    import torch

    from partitioner.split import split_program

    module, args = reference_model(name, batch)
    with torch.inference_mode():
        expected = module(*args)
    exported = torch.export.export(module, args)
    names = [n.name for n in exported.graph.nodes if n.op == "call_function"]
    part = split_program(exported, {n: "p0" for n in names}).parts[0].module
    results: dict[str, Any] = {}
    for precision in PRECISIONS:
        if elapsed() > deadline:
            results[precision] = "skipped: past the time budget"
            say(f"{name} b{batch} {precision}: skipped, past the time budget")
            continue
        try:
            results[precision] = time_precision(module, args, expected, part, precision,
                                                torch.device("cuda", 0))
        except Exception as e:
            traceback.print_exc()
            results[precision] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            SUMMARY["errors"].append(f"timing {name} b{batch} {precision}: "
                                     f"{type(e).__name__}: {e}"[:300])
        torch.cuda.empty_cache()
        keep(precision, results[precision])
        say(f"{name} b{batch} {precision}: {json.dumps(results[precision])}")
    return results


def timing(keys: list[tuple[str, int]], deadline: float) -> dict[str, Any]:
    """Each (model, batch) in a child process: a crash in a compiler (a segfault in a build
    or a load, as seen on torch 2.11) loses that row alone, and the child's Python stack is
    printed (faulthandler). After a crash the row is run again with AOTInductor off
    (runtimes/triton.py AOTI_ENV), and so is everything after it, the daemon included."""
    import torch

    from runtimes.triton import AOTI_ENV

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
    results: dict[str, Any] = SUMMARY.setdefault("models", {})
    for name, batch in keys:
        key = f"{name}_b{batch}"
        if elapsed() > deadline:
            results[key] = "skipped: past the time budget"
            continue
        argv = ["--child", "timing", "--models", name, "--batch", str(batch)]
        results[key] = in_child(argv, deadline, key)
        if "crash" in results[key].get("child", "") and os.environ.get(AOTI_ENV) != "0":
            os.environ[AOTI_ENV] = "0"
            SUMMARY["aoti_off_after"] = key
            say(f"{key} crashed: again, and from now on, with {AOTI_ENV}=0")
            results[f"{key}_torch_compile_path"] = in_child(argv, deadline, f"{key}_tc")
        write_summary()
    return results


def in_child(argv: list[str], deadline: float, label: str) -> dict[str, Any]:
    """This script again as a child for one section; it writes what it found to a JSON file
    after every step, so what it finished before a crash or a kill is kept."""
    result = SCRATCH / f"{label}.json"
    command = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), *argv,
               "--result", str(result), "--deadline-s", str(max(1.0, deadline - elapsed()))]
    env = child_env()  # the repository, then the carried wheels
    # Output is not captured: it streams into this run's log as it comes. A session of its
    # own, so that a kill takes the child's daemon and compilers with it.
    proc = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc: int | str = proc.wait(timeout=max(30.0, deadline - elapsed() + 90))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "killed: past the time budget"
    found: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    if rc != 0:
        why = f"exited {rc}" + (" (a crash: see the Python stack above)"
                                if isinstance(rc, int) and rc < 0 else "")
        found["child"] = why
        SUMMARY["errors"].append(f"{label}: child {why}")
    return found


def child(options: argparse.Namespace) -> int:
    """The child's side of in_child."""
    out = Path(options.result)
    deadline = elapsed() + options.deadline_s
    found: dict[str, Any] = {}

    def keep(key: str, value: Any) -> None:
        found[key] = value
        out.write_text(json.dumps(found, indent=1, default=str))

    def left() -> float:
        return deadline - elapsed()

    if options.child == "daemon":
        import check_daemon  # tests/gpu/check_daemon.py; needs grpcio and tritonclient

        check_daemon.run(Path(os.environ["OUT"]) if os.environ.get("OUT") else None, keep,
                         left, Path(options.state) if options.state else None)
    elif options.child == "parts":
        import check_parts

        check_parts.parts(left, keep)
    elif options.child == "aoti":
        import check_parts

        check_parts.aoti_variants(left, keep)
    elif options.child == "lm":
        import check_lm

        check_lm.check(keep, left, Path(options.state) if options.state else None)
    else:
        time_model(options.models, options.batch, deadline, keep)
    return 0


# ---- 2b. copies between host and device ----------------------------------------------------

# The card's published figures (NVIDIA H200 SXM datasheet; dense, no sparsity) and its host
# link (PCIe Gen5 x16: 64 GB/s each way, about 50-55 achievable).
PUBLISHED = {"NVIDIA H200": {"peak_gflops": {"fp32": 67_000, "bf16": 989_000,
                                             "fp16": 989_000, "int8": 1_979_000},
                             "mem_bw_gbs": 4_800, "link_bw_gbs": 64},
             # H100 SXM5 80 GB (torch names it "NVIDIA H100 80GB HBM3") and H100 PCIe
             "NVIDIA H100 80GB HBM3": {"peak_gflops": {"fp32": 67_000, "bf16": 989_000,
                                                       "fp16": 989_000, "int8": 1_979_000},
                                       "mem_bw_gbs": 3_350, "link_bw_gbs": 64},
             "NVIDIA H100 PCIe": {"peak_gflops": {"fp32": 51_000, "bf16": 756_000,
                                                  "fp16": 756_000, "int8": 1_513_000},
                                  "mem_bw_gbs": 2_000, "link_bw_gbs": 64}}


def published(name: str) -> Any:
    """The datasheet row of a card by torch's name for it (a prefix match: "NVIDIA H100")."""
    found = PUBLISHED.get(name) or next(
        (row for key, row in PUBLISHED.items() if name.startswith(key.split(" 80GB")[0])), None)
    return found or f"no published figures recorded for {name!r}"


def transfers() -> dict[str, Any]:
    """Host->device and device->host copies of 256 MiB, from pinned and from pageable memory."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
    nbytes = 256 << 20
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {}
    for label, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        for direction, copy_ in (("h2d", lambda h=host: dev.copy_(h, non_blocking=True)),
                                 ("d2h", lambda h=host: h.copy_(dev, non_blocking=True))):
            copy_()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                copy_()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            out[f"{direction}_{label}_gbs"] = round(nbytes / best / 1e9, 1)
    out["published"] = published(torch.cuda.get_device_name(0))
    return out


# ---- 3. the test suite --------------------------------------------------------------------

def pytest_suite(deadline: float) -> dict[str, Any]:
    try:
        import pytest  # noqa: F401 - only to learn whether it is installed
    except ImportError:
        return {"skipped": "pytest is not installed: section 2 checked accuracy and save/load"}
    # --noconftest: tests/conftest.py starts daemons and needs pyyaml; tests/gpu needs neither.
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
               "--noconftest"]
    env = child_env()  # the repository, then the carried wheels
    timeout = max(30.0, deadline - elapsed())
    say(f"{' '.join(command[1:])} (timeout {timeout:.0f} s)")
    t0 = time.perf_counter()
    lines: list[str] = []
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    watchdog = threading.Timer(timeout, proc.kill)  # a compile may print nothing for minutes
    watchdog.start()
    try:
        for line in proc.stdout:  # streamed, so progress shows while it runs
            print(line, end="", flush=True)
            lines.append(line.rstrip())
    finally:
        rc = proc.wait()
        watchdog.cancel()
    if time.perf_counter() - t0 >= timeout:
        lines.append(f"killed after {timeout:.0f} s (time budget)")
        print(lines[-1], flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "pytest_gpu.log").write_text("\n".join(lines) + "\n")
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln
                    or " skipped" in ln or " error" in ln), "")
    return {"rc": rc, "summary": summary, "seconds": round(time.perf_counter() - t0, 1)}


# ---- 4. the measured GPU profile ----------------------------------------------------------

def profile() -> Any:
    """The host's devices measured into the daemon's state directory (DAEMON_DIR), as the
    daemon would (check_daemon.seed_profile); the GPUs alone where that cannot run (no
    pyyaml): the daemon then measures again itself."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
    try:
        import check_daemon

        seeded = check_daemon.seed_profile(DAEMON_DIR)
        seeded["seeded"] = str(DAEMON_DIR)
        profiles = seeded["devices"]
    except ImportError as e:
        say(f"the daemon's profile cannot be seeded ({e}): measuring the GPUs alone")
        seeded = {"seeded": f"no ({e})"}
        spec = {"task": "host", "cpu": False, "openvino": False}
        command = [sys.executable, "-m", "runtimes.profiling.benchmarks", json.dumps(spec)]
        done = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"runtimes.profiling.benchmarks exited {done.returncode}: "
                               f"{done.stderr[-3000:]}") from None
        profiles = json.loads(done.stdout.strip().splitlines()[-1])
    for p in profiles:
        print(json.dumps(p), flush=True)
        if p.get("kind") == "gpu":
            p["published"] = published(p.get("name", ""))
    return {**seeded, "devices": profiles}


# ---- entry --------------------------------------------------------------------------------

def in_children(name: str, argv: list[str], deadline: float) -> dict[str, Any]:
    """A section in a child process (`--child NAME`), its rows kept in SUMMARY[name]."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
    SUMMARY[name] = results = in_child(["--child", *argv], deadline, name)
    return results


def main() -> int:
    from runtimes.triton import AOTI_BROKEN, AOTI_ENV

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"with --timing: comma-separated, from {MODELS} (default: all)")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET_S", 400)),
                        help="seconds after which no new work starts (default 400: the run "
                             "ends within 8 minutes)")
    parser.add_argument("--skip-daemon", action="store_true")
    parser.add_argument("--timing", action="store_true", help="the older per-model rows too")
    parser.add_argument("--pytest", action="store_true", help="pytest tests/gpu at the end")
    parser.add_argument("--child", choices=("daemon", "timing", "parts", "aoti", "lm"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--deadline-s", type=float, default=0.0, help=argparse.SUPPRESS)
    options = parser.parse_args()
    faulthandler.enable()  # a crash in native code prints the Python stack that led there
    if options.child:
        try:
            return child(options)
        finally:
            shutil.rmtree(SCRATCH, ignore_errors=True)
    budget = options.budget
    DAEMON_DIR.mkdir(parents=True, exist_ok=True)
    say(f"cuvild GPU check: budget {budget:.0f} s, caches in {SCRATCH}")
    SUMMARY["environment"] = section("environment", environment)
    SUMMARY["profile"] = section("the profile, seeded for the daemon", profile)
    SUMMARY["transfers"] = section("host<->device copies", transfers)
    gpus = [p for p in (SUMMARY.get("profile") or {}).get("devices", [])
            if p.get("kind") == "gpu"]
    if any(AOTI_BROKEN in p.get("features", []) for p in gpus):
        os.environ[AOTI_ENV] = "0"  # its own check crashed or failed: no compile to crash again
        say(f"{AOTI_BROKEN} in the measured profile: {AOTI_ENV}=0")
    section("parts (tests/gpu/check_parts.py)",
            lambda: in_children("parts", ["parts"], 0.45 * budget))
    section("a language model's step on the GPU (tests/gpu/check_lm.py)",
            lambda: in_children("lm", ["lm", "--state", str(DAEMON_DIR / "state")],
                                0.55 * budget))
    if options.skip_daemon:
        SUMMARY["daemon"] = {"skipped": "--skip-daemon"}
    else:
        section("daemon (tests/gpu/check_daemon.py)", lambda: in_children(
            "daemon", ["daemon", "--state", str(DAEMON_DIR)], 0.88 * budget))
    # last: each variant compiles for ~1-2 min and may crash (it did on the H200)
    section("AOTInductor three ways (check_parts.py)",
            lambda: in_children("aoti", ["aoti"], budget))
    if options.timing:
        models = [m for m in options.models.split(",") if m]
        keys = [(name, batch) for batch in BATCHES for name in models]
        section("timing", lambda: timing(keys, deadline=budget))
    if options.pytest:
        SUMMARY["pytest"] = section("pytest tests/gpu", lambda: pytest_suite(budget + 120))
    write_summary()
    say("==== summary")
    print(json.dumps({k: v for k, v in SUMMARY.items() if k != "environment"}, indent=1,
                     default=str), flush=True)
    shutil.rmtree(SCRATCH, ignore_errors=True)
    failed = bool(SUMMARY["errors"]) or (SUMMARY.get("pytest") or {}).get("rc", 0) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
