"""Memory a worker freed, given back to the system after a build.

A build's search makes and drops copies of a part (a precision search: each precision's
build; a mix: dozens of lowered copies, runtimes/mixed.py), and glibc keeps most of what they
freed in its heap: the process's resident memory stays at the search's peak. A language
model's 128-token prompt chunk mixed (the 200M Llama, one process, 2-core AMD EPYC):
2.02 GB of anonymous memory after its build, 1.36 GB after a garbage collection, 0.91 GB
after `malloc_trim`, with the built part alive throughout. So once a worker process's build
thread has done the orders in hand, where one of them searched (several precisions) or let
executables go (a final choice, an unload), it collects its garbage and trims glibc's heap
(a no-op where the C library is not glibc): once a burst, not once a build, because a
collection walks every object of the process (175 ms with a 24-part split of that model; a
collection after each build of a split language model's ~100 added 24 s to one test), and
not in thread workers (the daemon's own process: all of its objects, at every load).
"""

from __future__ import annotations

import ctypes
import gc


def _malloc_trim() -> object | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


MALLOC_TRIM = _malloc_trim()


def give_back() -> None:
    """Collect the process's garbage, then hand glibc's free heap pages back."""
    gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)  # type: ignore[operator]
