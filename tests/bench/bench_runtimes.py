"""Runtimes against torch eager on the reference models: latency, accuracy and setup costs.

`python tests/bench/bench_runtimes.py [--json] [--rounds N] [MODEL ...]` (default: resnet18,
bert4, mlp at batch 1, 2 threads). Each model is compiled whole as one part by every runtime
(cold compile: export + convert + compile, timed), saved and loaded back in a fresh Runtime
(warm load from the compile cache, timed), then all runners are timed in interleaved rounds
so drift on a shared host hits them alike. Medians in ms, [ratio to eager].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

import torch  # noqa: E402

from cuvild.client.samples import reference  # noqa: E402
from partitioner.annotate import export  # noqa: E402
from partitioner.profile import DeviceProfile  # noqa: E402
from partitioner.split import split_program  # noqa: E402
from runtimes import registry  # noqa: E402
from runtimes.base import CompileSpec, Executable, RuntimeUnavailable, relative_error  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent))
from timing import interleaved  # noqa: E402  (idle GAP_S between calls: spinning pools sleep)

MODELS = ("resnet18", "bert4", "mlp")
THREADS = 2
WARMUP = 3
VARIANTS = (("openvino", "fp32"), ("openvino", "bf16"), ("onnxruntime", "fp32"))


def has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def build(runtime_name: str, precision: str, part: torch.fx.GraphModule,
          spec: CompileSpec) -> tuple[Executable, dict[str, float]]:
    """Compile cold, then save and load in a fresh Runtime; returns the loaded executable."""
    t0 = time.perf_counter()
    compiled = registry.get(runtime_name).compile(part, spec)
    compile_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as tmp:
        compiled.save(Path(tmp))
        del compiled
        t0 = time.perf_counter()
        loaded = registry.get(runtime_name).load(Path(tmp), spec)
        load_s = time.perf_counter() - t0
        loaded.run(spec.example_inputs)  # the first run, before the cache entry goes away
    return loaded, {"compile_s": compile_s, "load_s": load_s}


def interleaved_medians(runners: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    samples = interleaved(runners, rounds, warmup=WARMUP)
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_model(name: str, rounds: int) -> dict[str, Any]:
    model, inputs = reference(name, 1)
    with torch.inference_mode():
        expected = [model(*inputs)]
    ep = export(model, inputs)
    part = split_program(ep, {n.name: "all" for n in ep.graph.nodes
                              if n.op == "call_function"}).parts[0].module
    cpu = DeviceProfile(id="cpu0", kind="cpu", cores=list(range(THREADS)),
                        features=["amx_bf16"] if has_bf16() else [])

    def eager() -> Any:
        with torch.inference_mode():
            return model(*inputs)

    runners: dict[str, Callable[[], Any]] = {"eager": eager}
    setup: dict[str, Any] = {}
    errors: dict[str, float] = {}
    for runtime_name, precision in VARIANTS:
        label = f"{runtime_name} {precision}"
        spec = CompileSpec(device=cpu, precision=precision, example_inputs=list(inputs),
                           threads=THREADS)
        try:
            exe, setup[label] = build(runtime_name, precision, part, spec)
        except (RuntimeUnavailable, RuntimeError) as e:
            setup[label] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        errors[label] = relative_error(exe.run(inputs), expected)
        runners[label] = lambda exe=exe: exe.run(inputs)
    return {"model": name, "batch": 1, "median_ms": interleaved_medians(runners, rounds),
            "rel_error": errors, "setup": setup}


def table(results: list[dict[str, Any]]) -> str:
    labels = ["eager"] + [f"{r} {p}" for r, p in VARIANTS]
    lines = ["| model, batch | " + " | ".join(labels) + " |",
             "|---" * (len(labels) + 1) + "|"]
    for res in results:
        eager = res["median_ms"]["eager"]
        cells = []
        for label in labels:
            ms = res["median_ms"].get(label)
            cells.append("n/a" if ms is None else
                         f"{ms:.1f}" if label == "eager" else f"{ms:.1f} [{ms / eager:.2f}]")
        lines.append(f"| {res['model']} b{res['batch']} | " + " | ".join(cells) + " |")
    lines += ["", "| model | runtime | cold compile s | warm load s | rel. error vs eager |",
              "|---|---|---|---|---|"]
    for res in results:
        for label, setup in res["setup"].items():
            if "error" in setup:
                lines.append(f"| {res['model']} | {label} | failed: {setup['error']} | | |")
                continue
            lines.append(f"| {res['model']} | {label} | {setup['compile_s']:.2f} | "
                         f"{setup['load_s']:.3f} | {res['rel_error'][label]:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS),
                        help=f"reference models (default: {' '.join(MODELS)}; also: demo)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    unknown = set(args.models) - {*MODELS, "demo"}
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; expected some of {[*MODELS, 'demo']}")
    torch.set_num_threads(THREADS)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch pytree deprecations
    results = [bench_model(name, args.rounds) for name in args.models]
    host = {"cores": sorted(os.sched_getaffinity(0)), "threads": THREADS,
            "load_avg": os.getloadavg(), "torch": torch.__version__}
    if args.json:
        print(json.dumps({"host": host, "results": results}, indent=1))
    else:
        print(f"threads {THREADS}, rounds {args.rounds}, load average at the end "
              f"{host['load_avg'][0]:.1f}")
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
