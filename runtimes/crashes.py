"""Compiles that killed their process, remembered so that they are not tried again.

A runtime's native code can die of a signal while it compiles a part (OpenVINO 2026.4.1's
CPU plugin: SIGFPE compiling a small Llama at bf16 on one thread of an AMX Xeon, as
openvinotoolkit/openvino#33300 reports under `taskset -c 0`; AOTInductor's package load on
torch 2.11, SIGSEGV), and the device's worker process dies with it. So before each compile
the worker writes a marker, `crashes/<part key>-<runtime>.trying`, holding its pid, and
removes it after (`attempt`). Where a worker dies of a crash signal, the daemon renames that
worker's markers `.crashed` (`confirm`); `crashed` is then true for that compile problem and
runtime: the search (runtimes/select.py) records the runtime as failed and tries the next,
so the part's second build on that device (cuvild/load/builder.py) gets what does not crash.
A worker that ended otherwise (stopped, killed when it hung or ran out of memory: SIGKILL)
leaves `.trying` markers only, which count for nothing (CompileCache removes old ones).

No torch here: the daemon's end of a worker (cuvild/workers/handle.py) calls `confirm`.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

FOLDER = "crashes"
# Signals of a fault in the process's own code, not of someone ending it
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGFPE, signal.SIGILL, signal.SIGBUS,
                           signal.SIGABRT})


def _marker(root: Path, part_key: str, runtime: str, kind: str) -> Path:
    return root / FOLDER / f"{part_key}-{runtime}.{kind}"


@contextlib.contextmanager
def attempt(root: Path, part_key: str, runtime: str) -> Iterator[None]:
    """Around one compile of `part_key` by `runtime` in this process."""
    path = _marker(root, part_key, runtime, "trying")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(os.getpid()))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def crashed(root: Path, part_key: str, runtime: str) -> bool:
    """Whether compiling `part_key` with `runtime` killed a worker here before."""
    return _marker(root, part_key, runtime, "crashed").exists()


def confirm(root: Path, pid: int, exit_code: int | None) -> list[str]:
    """Worker `pid` ended with `exit_code` (a Process's: -N for signal N): where that was a
    crash signal, its markers become `.crashed`; returns their names ("<key>-<runtime>")."""
    folder = root / FOLDER
    if exit_code is None or -exit_code not in CRASH_SIGNALS or not folder.is_dir():
        return []
    named = []
    for path in folder.glob("*.trying"):
        try:
            if path.read_text().strip() == str(pid):
                path.rename(path.with_suffix(".crashed"))
                named.append(path.stem)
        except OSError:
            continue
    return named


def describe(exit_code: int | None) -> str:
    """How a worker process ended, for its WorkerDied: "exit code 3", "killed by SIGFPE"."""
    if exit_code is None:
        return ""
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"
