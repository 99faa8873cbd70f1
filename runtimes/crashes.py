"""Compiles that killed their process, remembered so that they are not tried again.

A runtime's native code can die of a signal while it compiles a part (OpenVINO 2026.4.1's
CPU plugin: SIGFPE compiling a small Llama at bf16 on one thread of an AMX Xeon, as
openvinotoolkit/openvino#33300 reports under `taskset -c 0`; AOTInductor's package load on
torch 2.11, SIGSEGV), and the device's worker process dies with it. So before each compile
the worker writes a marker, `crashes/<part key>-<runtime>.trying`, holding its pid, and
removes it after (`attempt`; also around a mix search's compiles and a cached build's load).
Where a worker dies of a crash signal, the daemon renames that worker's markers `.crashed`
(`confirm`); `crashed` is then true for that compile problem and runtime: the search
(runtimes/select.py) records the runtime as failed and tries the next, so the part's second
build on that device (cuvild/load/builder.py) gets what does not crash.
A worker that ended otherwise (stopped, killed when it hung or ran out of memory: SIGKILL)
leaves `.trying` markers only, which count for nothing (CompileCache removes old ones).

Workers that are threads of the daemon (`engine.workers: thread`) die with it, and nothing is
left to read their signal. So the daemon has Python's faulthandler write to
`crashes/<pid>.fault` (`watch`): on a crash signal it writes "Fatal Python error: ..." and the
crashing thread's stack there. The next start reads what a dead daemon left (`left_by_the_dead`):
where a fault was written, that daemon's markers become `.crashed` as a worker's would, and
the restart does not compile the same thing again to die again (systemd's restart loop).

No torch here: the daemon's end of a worker (cuvild/workers/handle.py) calls `confirm`, the
daemon's start `left_by_the_dead` then `watch`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import IO, NamedTuple

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
    if exit_code is None or -exit_code not in CRASH_SIGNALS:
        return []
    return _crashed(root, pid)


def _crashed(root: Path, pid: int) -> list[str]:
    folder, named = root / FOLDER, []
    for path in folder.glob("*.trying") if folder.is_dir() else ():
        try:
            if path.read_text().strip() == str(pid):
                path.rename(path.with_suffix(".crashed"))
                named.append(path.stem)
        except OSError:
            continue
    return named


def watch(root: Path) -> IO[str]:
    """Have faulthandler write this process's crash to `crashes/<pid>.fault` (the crashing
    thread's stack, under "Fatal Python error: <the signal>"); returns the file, kept open."""
    folder = root / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    out = open(folder / f"{os.getpid()}.fault", "w")  # noqa: SIM115 - open while we live
    # (the crashing thread's stack only: dumping the others' while they run can fault again,
    # which one CI run saw as SIGSEGV after the SIGFPE)
    faulthandler.enable(file=out, all_threads=False)
    return out


def unwatch(out: IO[str]) -> None:
    """`watch` ended at a clean stop: its (empty) file removed."""
    faulthandler.disable()
    out.close()
    Path(out.name).unlink(missing_ok=True)


class Fault(NamedTuple):
    """What a daemon that died of a crash signal left: its pid, faulthandler's first line
    ("Fatal Python error: Floating point exception") and the compiles it had in hand."""

    pid: int
    said: str
    compiles: list[str]


def left_by_the_dead(root: Path) -> list[Fault]:
    """The faults of daemons (`watch`) that are no longer running, their compile markers made
    `.crashed`; their fault files removed (an empty one: a daemon that ended otherwise). A
    file of this process's pid is a dead one's (a container's daemon is often pid 1 each
    start); one of a live process, another daemon's on this cache directory, is left."""
    faults = []
    for path in (root / FOLDER).glob("*.fault") if (root / FOLDER).is_dir() else ():
        try:
            pid = int(path.stem)
            if pid != os.getpid() and _alive(pid):
                continue
            said = path.read_text(errors="replace").strip()
            path.unlink(missing_ok=True)
        except (OSError, ValueError):
            continue
        if said.startswith("Fatal Python error"):
            faults.append(Fault(pid, said.splitlines()[0], _crashed(root, pid)))
    return faults


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


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
