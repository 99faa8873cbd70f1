"""`runtime: auto` on the whole of each reference model on this host's CPU: every candidate's
median latency (torch = eager), the winner, cold build and warm (cached) load time."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cuvild  # noqa: E402
from cuvild.client.samples import reference  # noqa: E402
from partitioner.profile import DeviceProfile  # noqa: E402
from partitioner.split import split_program  # noqa: E402
from runtimes.cache import CompileCache  # noqa: E402
from runtimes.select import build_part  # noqa: E402

CPU = DeviceProfile(id="cpu0", kind="cpu", cores=sorted(os.sched_getaffinity(0)),
                    runtimes=["openvino", "onnxruntime", "llvm-cpu", "torch"],
                    features=["avx512f", "amx_bf16"])


def one(name: str, cache: CompileCache) -> dict[str, Any]:
    model, inputs = reference(name)
    ep = cuvild.export(model, inputs)
    split = split_program(ep, {n.name: "p0" for n in ep.graph.nodes if n.op == "call_function"})
    part = split.parts[0]

    def samples() -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        with torch.no_grad():
            values = split.trace(*inputs)
        return [[values[n] for n in part.inputs]], [[values[n] for n in part.outputs]]

    t0 = time.perf_counter()
    built = build_part(part.module, CPU, "fp32", samples, cache)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = build_part(part.module, CPU, "fp32", samples, cache)
    warm = time.perf_counter() - t0
    cands = {c.runtime: c for c in built.candidates}
    eager = cands["torch"].median_ms if "torch" in cands else None
    return {
        "winner": built.runtime, "cold_build_s": cold, "warm_load_s": warm,
        "warm_compiled_nothing": again.from_cache and not again.compiled,
        "eager_ms": eager,
        "candidates": {c.runtime: {"status": c.status, "median_ms": c.median_ms,
                                   "compile_s": c.compile_s, "rel_error": c.rel_error,
                                   "reason": c.reason[:120]} for c in built.candidates},
    }


def main() -> dict[str, Any]:
    torch.set_num_threads(len(CPU.cores))
    with tempfile.TemporaryDirectory(prefix="cuvil-auto-") as tmp:
        cache = CompileCache(Path(tmp))
        names = [a for a in sys.argv[1:] if not a.startswith("-")] or ["resnet18", "bert4", "mlp"]
        return {name: one(name, cache) for name in names}


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))
        sys.exit(0)
    for name, r in result.items():
        eager = r["eager_ms"]
        cells = []
        for rt, c in r["candidates"].items():
            if c["status"] == "ok":
                ratio = f" [{c['median_ms'] / eager:.2f}]" if eager else ""
                cells.append(f"{rt} {c['median_ms']:.1f} ms{ratio}")
            else:
                cells.append(f"{rt} {c['status']}")
        print(f"{name}: auto -> {r['winner']}; " + ", ".join(cells)
              + f"; cold build {r['cold_build_s']:.1f} s, warm load {r['warm_load_s']:.2f} s "
              f"(compiled nothing: {r['warm_compiled_nothing']})")
