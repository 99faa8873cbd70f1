"""What the daemon and its device workers share in memory (the fast path's own wire,
which clients speak too, is protos/fastpath.py): a session's counts and histogram, and a
bell's request record. cuvild/workers/sessions.py writes and reads them on the worker's side;
cuvild/run/bells.py, cuvild/serve/fast.py and cuvild/serve/metrics.py on the daemon's."""

from __future__ import annotations

import mmap
import struct

# A session's counts, in a memfd of its own that the daemon and the worker share (the client
# never gets it): requests done, failed, seconds run. The metrics read them.
STATS = struct.Struct("<QQd")
# After them, on a fast-path session (whose requests the daemon never sees), a histogram of
# the requests done: seconds from doorbell to answer, summed, then the requests per bucket
# (each up to its bound in SECONDS, the metrics' buckets; the last one past them all).
SECONDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
           2.5, 5.0, 10.0, 60.0)  # from a tenth of a millisecond to a minute
TIMES = struct.Struct(f"<d{len(SECONDS) + 1}Q")
STATS_BYTES = STATS.size + TIMES.size

# A bell's request record (cuvild/run/bells.py), `bell_bytes` long: seq, state, error_len, the
# arena block's offset, its segment's name's length, the count of tensors elsewhere and the
# request's sequence slot (cuvild/run/sequences.py; 0: none); the
# name at BELL_NAME; the error text (JSON: kind, error) at BELL_ERRORS; from BELL_ELSEWHERE,
# each tensor in a client's region: TENSOR_AT (0 input, 1 output; its index; the object's
# inode; the offset; its name's length) and the name.
BELL = struct.Struct("<QIIQHHI")
BELL_NAME, BELL_ERRORS, BELL_ELSEWHERE = 64, 320, 1344
TENSOR_AT = struct.Struct("<BHQQH")
NAME_MAX = 255  # a client's object is a file in /dev/shm: its name is at most this long


def bell_bytes(tensors: int) -> int:
    """The record of a bell for a part of `tensors` inputs and outputs, in whole pages: room
    for each of them in a client's region, at the longest name an object can have."""
    size = BELL_ELSEWHERE + tensors * (TENSOR_AT.size + NAME_MAX)
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
