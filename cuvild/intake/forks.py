"""The daemon's forkserver: one process that imported torch and the loader once, from which
archive inspections (cuvild/intake/summary.py) and device workers (cuvild/workers/handle.py)
fork instead of starting an interpreter and importing torch each (~1.7 s of CPU a process on
the 2-core dev host, torch 2.13). It stays resident (~370 MB, shared with what forks from it).

It is started by the first upload of bytes never inspected (`start`, as they arrive). A daemon
that restores models, or registers bytes inspected before (cuvild/intake/verdicts.py), never
starts it for them: its workers are spawned, and serve their records with no torch in any
process. Workers fork from it only once it runs (`running`).

Its first import sets the OpenMP settings a worker's pools read when torch's OpenMP library
loads (passive waits: cuvild/workers/omp_env.py); a worker still sizes its pool to its cores.
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

PRELOAD = ["cuvild.workers.omp_env", "torch", "cuvild.intake.safe_load", "cuvild.intake.summary",
           "partitioner.annotate", "cuvild.workers.worker"]
_lock = threading.Lock()
_context: Any = None
_started = False


def context() -> Any:
    """The forkserver's multiprocessing context (the server starts with its first process)."""
    global _context, _started
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)  # taken when the forkserver starts
            _context = ctx
        _started = True
        return _context


def start() -> None:
    """Start the forkserver now; its preload goes on in it while the caller goes on."""
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()


def running() -> bool:
    """Whether this process has started the forkserver (a dead one restarts when used)."""
    return _started
