"""The same-host fast path's wire: a session on the daemon's unix socket, a request ring and
the model's input and output slots in one shared-memory object, a doorbell per request.

Any process on the host may speak it (docs/FASTPATH.md describes it for other languages);
cuvild/client/fast.py is the Python client and cuvild/serve/fast.py the daemon's side.

1. Open. Connect to the daemon's unix socket (the one gRPC clients use) and send, in one
   write, `OPEN` (magic b"CUVF", version, length) and that many bytes of JSON:
   {"model": name, "version": "" (the newest), "depth": ring entries (1..64), "shapes": one
   list of sizes per input (required for a dynamic-shape model: the session serves those)}.
2. The daemon answers `LENGTH` and that many bytes of JSON. With "ok": true the same message
   carries one file descriptor (SCM_RIGHTS): a sealed memfd (it cannot be shrunk or grown)
   that the client maps read-write, whole ("size" bytes). The JSON gives its layout:
   "ring" (offset of `depth` entries of ENTRY_BYTES), "errors" (offset of `depth` error texts
   of ERROR_BYTES), "slots" (one offset per entry), and "inputs"/"outputs": name, dtype (torch's
   name), shape, offset from a slot's start, nbytes. With "ok": false it carries "code" (a gRPC
   status name) and "error", and the daemon closes the socket.
3. Each request: write the inputs into a slot (C order), write ring entry `seq % depth` with
   `ENTRY` (seq, slot, state SUBMITTED), send `DOORBELL` (seq). The daemon runs the entries it
   is rung for in order and answers each with `DOORBELL` (the seq); the entry's state is then
   DONE (the outputs are in the slot) or FAILED (the entry's error text, JSON with "code" and
   "error", of `error_len` bytes). Code RELOADED: the model was loaded again since the session
   opened (its layout may differ): open a new session and send the request again.
4. Close the socket to end the session (a client that dies ends it the same way; its memory
   goes with the last mapping). EOF or EPIPE on a doorbell: the daemon went away.
"""

from __future__ import annotations

import struct
from typing import Any

MAGIC = b"CUVF"
VERSION = 1
OPEN = struct.Struct("<4sII")  # magic, version, JSON length
LENGTH = struct.Struct("<I")  # the open reply's JSON length
DOORBELL = struct.Struct("<Q")  # a request's seq, both ways
ENTRY = struct.Struct("<QIII")  # seq, slot, state, error_len
ENTRY_BYTES = 64
ERROR_BYTES = 1024
MAX_DEPTH = 64
MAX_OPEN_BYTES = 64 << 10
MAX_ERROR_TEXT = 900  # characters of an error message (its JSON fits ERROR_BYTES)
ALIGN = 64
FREE, SUBMITTED, DONE, FAILED = 0, 1, 2, 3
RELOADED = "RELOADED"  # an error code of its own: re-open and send again


class BadEntry(ValueError):
    """A doorbell rang for a ring entry that does not hold a submitted request of that seq,
    or that names a slot the session does not have: the client wrote its ring wrong."""


def submitted(mm: Any, ring: int, depth: int, seq: int) -> tuple[int, int, int]:
    """The ring entry a doorbell for request `seq` rang: (index, its offset, its slot),
    checked (BadEntry); `ring` is the ring's offset in the session's memory."""
    index = seq % depth
    at = ring + index * ENTRY_BYTES
    got, slot, state, _ = ENTRY.unpack_from(mm, at)
    if got != seq or state != SUBMITTED:
        raise BadEntry(f"ring entry {index} holds request {got} in state {state}, the "
                       f"doorbell rang for request {seq} (state {SUBMITTED}: submitted)")
    if slot >= depth:
        raise BadEntry(f"ring entry {index} names slot {slot}; the session has slots "
                       f"0..{depth - 1}")
    return index, at, slot
