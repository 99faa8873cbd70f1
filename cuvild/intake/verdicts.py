"""What the safe inspection found in an archive, kept in the compile cache by the archive's
sha256, so that the same bytes uploaded again are not inspected again: to a fresh state
directory, to another daemon or pod sharing the cache (a KServe ServingRuntime's replicas), or
from a model repository scanned by a new pod. Such an upload starts no inspector (a forkserver
that imports torch: ~3 s of CPU on the 2-core dev host, ~370 MB resident) and, where the
model's load record is there too, imports torch nowhere: the small MLP registered and READY on
a fresh daemon sharing the cache in 2.0 -> 0.25-0.35 s, its processes' CPU 4.4 -> 0.65 s (the
2-core dev host, two daemons in turn on one cache).

A verdict lets an archive skip the isolated inspection, so it is signed as the compile cache's
entries are (HMAC-SHA256 with the daemon's cache key, runtimes/cache.py): whoever can write the
cache but not read the key cannot have a crafted archive parsed in the daemon without the
inspection's limits. It names the software that inspected (cuvild's intake code and torch's
version): after an upgrade or a changed loader the archive is inspected again. The safe
loader's refusals are kept too (what it refused is in the bytes: a repository entry refused
is not inspected again at every start), the inspection process's limits' are not (a busy
host may pass them); at most KEEP verdicts, the oldest go.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any

from cuvild.intake.errors import UnsafeArchive
from runtimes.base import write_atomic
from runtimes.cache import cache_key_file

log = logging.getLogger(__name__)
FORMAT = 1
SHA256 = re.compile(r"[0-9a-f]{64}")
KEEP = 1024  # verdicts kept in a cache (a few hundred bytes to a few KB each)
_software: list[str] = []
_lock = threading.Lock()


def software() -> list[str]:
    """What inspected: the digest of cuvild's intake sources (its safe loader and checks) and
    torch's version (read from its metadata: torch is not imported)."""
    with _lock:
        if not _software:
            h = hashlib.sha256()
            for path in sorted(Path(__file__).parent.glob("*.py")):
                h.update(path.name.encode() + b"\0" + path.read_bytes())
            _software.extend([h.hexdigest()[:16], version("torch")])
        return list(_software)


class Verdicts:
    """The inspection's verdicts in `cache_dir`/inspected, by archive sha256."""

    def __init__(self, cache_dir: Path) -> None:
        self.directory = Path(cache_dir) / "inspected"

    def verdict(self, sha256: str, max_bytes: int) -> dict[str, Any] | UnsafeArchive | None:
        """What a verdict signed with this daemon's key, by this software, says of these
        bytes: the summary the inspection gave them, or the safe loader's refusal (under the
        same size limit) to raise again; None where there is none (inspect them)."""
        body = self._read(sha256)
        if body is None:
            return None
        if "summary" in body:
            return body["summary"]
        refused = body.get("refused")
        if not isinstance(refused, dict) or refused.get("max_bytes") != max_bytes:
            return None
        return UnsafeArchive(str(refused["entry"]), str(refused["reason"]))

    def keep(self, sha256: str, summary: dict[str, Any]) -> None:
        """Record that the inspection accepted these bytes with `summary` (best effort: a
        cache that cannot be written means the next upload of them is inspected again)."""
        self._write(sha256, {"summary": summary})

    def refuse(self, sha256: str, entry: str, reason: str, max_bytes: int) -> None:
        """Record the safe loader's refusal of these bytes: what it found is in the bytes
        (a malformed entry, a pickle, an op outside the allow-list), so a repository entry
        refused is not inspected again at every start, nor an upload of it again. Not a
        limit of the inspection's process (memory, CPU, time): a busy host may pass it."""
        self._write(sha256, {"refused": {"entry": entry, "reason": reason,
                                         "max_bytes": max_bytes}})

    def _read(self, sha256: str) -> dict[str, Any] | None:
        if not SHA256.fullmatch(sha256):  # (a header's, not checked yet: no path of it)
            return None
        try:
            kept = json.loads((self.directory / f"{sha256}.json").read_text())
            body = {k: v for k, v in kept.items() if k != "mac"}
            fresh = (body["format"] == FORMAT and body["sha256"] == sha256
                     and body["software"] == software())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if not fresh:
            return None
        if not hmac.compare_digest(str(kept.get("mac", "")), _mac(body)):
            log.warning("intake: the verdict on archive %s is not signed with this daemon's "
                        "key; inspecting it again", sha256[:12])
            return None
        return body

    def _write(self, sha256: str, verdict: dict[str, Any]) -> None:
        body = {"format": FORMAT, "sha256": sha256, "software": software(), **verdict}
        try:
            write_atomic(self.directory / f"{sha256}.json",
                         json.dumps({**body, "mac": _mac(body)}).encode())
            kept = list(self.directory.glob("*.json"))
            if len(kept) > KEEP:
                kept.sort(key=lambda p: p.stat().st_mtime)
                for old in kept[:len(kept) - KEEP]:
                    old.unlink(missing_ok=True)
        except OSError as e:
            log.warning("intake: the verdict on archive %s not kept (%s)", sha256[:12], e)


def _mac(body: dict[str, Any]) -> str:
    return hmac.new(cache_key_file(), json.dumps(body, sort_keys=True).encode(),
                    hashlib.sha256).hexdigest()
