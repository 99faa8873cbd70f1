"""`make bench`: every benchmark section, one after another (never two at once on 2 cores)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTIONS = ["bench_startup.py", "bench_intake.py", "bench_partitioner.py", "bench_runtimes.py",
            "bench_llvm_cpu.py", "bench_auto.py", "bench_engine.py", "bench_costmodel.py",
            "bench_precision.py", "bench_serving.py", "bench_batching.py", "bench_load.py",
            "bench_models.py", "bench_http.py"]

if __name__ == "__main__":
    for name in SECTIONS:
        path = HERE / name
        if not path.exists():
            continue
        print(f"== {name} ==", flush=True)
        sys.argv = [str(path), *sys.argv[1:]]
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:  # a section may end with sys.exit(); go on to the next
            if e.code not in (None, 0):
                print(f"{name} exited with {e.code}", flush=True)
        print(flush=True)
