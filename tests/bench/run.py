"""`make bench`: every benchmark section, one after another (never two at once on 2 cores).

`make bench SECTION=serving` (or `python tests/bench/run.py serving models`) runs the sections
named, by file (bench_serving.py) or short name (serving)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTIONS = ["bench_startup.py", "bench_intake.py", "bench_partitioner.py", "bench_runtimes.py",
            "bench_llvm_cpu.py", "bench_auto.py", "bench_engine.py", "bench_costmodel.py",
            "bench_precision.py", "bench_serving.py", "bench_batching.py", "bench_load.py",
            "bench_models.py", "bench_http.py", "bench_generation.py", "bench_embeddings.py",
            "bench_soak.py"]

def chosen(names: list[str]) -> list[str]:
    """The sections named (all of them when none is); SystemExit names an unknown one."""
    if not names:
        return SECTIONS
    short = {s.removeprefix("bench_").removesuffix(".py"): s for s in SECTIONS}
    picked = [short.get(n.removeprefix("bench_").removesuffix(".py")) for n in names]
    unknown = [n for n, s in zip(names, picked, strict=True) if s is None]
    if unknown:
        raise SystemExit(f"bench: unknown section(s) {unknown}; sections: "
                         f"{', '.join(short)}")
    return [s for s in picked if s]


if __name__ == "__main__":
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    for name in chosen(names):
        path = HERE / name
        if not path.exists():
            continue
        print(f"== {name} ==", flush=True)
        sys.argv = [str(path), *[a for a in sys.argv[1:] if a.startswith("-")]]
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:  # a section may end with sys.exit(); go on to the next
            if e.code not in (None, 0):
                print(f"{name} exited with {e.code}", flush=True)
        print(flush=True)
