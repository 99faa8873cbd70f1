"""The model registry: archives stored content-addressed under state_dir, one JSON index.

Layout:  state_dir/models/<sha256>.pt2   the archives (one file per distinct content)
         state_dir/models/index.json     name/version -> sha256 and a summary of the graph
         state_dir/uploads/              uploads in progress (wiped at start)

Every write is temp + fsync + rename, and the index is written after the archive is in place,
so a daemon killed at any point restarts with a consistent registry: an upload in flight
leaves only a temp file (removed at start), an archive the index never got is removed too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runtimes.base import fsync_dir, write_atomic

log = logging.getLogger(__name__)
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
HEX_RE = re.compile(r"^[0-9a-f]{64}$")


class RegistryError(Exception):
    """A request the registry refuses. `kind` maps to a gRPC status in the servicer."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "invalid" | "exists" | "not_found"


@dataclass
class ModelRecord:
    name: str
    version: str
    sha256: str
    size_bytes: int
    created_at: float
    num_nodes: int = 0
    annotated_nodes: int = 0
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)


class Upload:
    """One archive arriving in chunks: hashed and size-checked as it is written."""

    def __init__(self, registry: Registry, header: dict[str, Any]) -> None:
        self.registry = registry
        self.header = header
        fd, tmp = tempfile.mkstemp(dir=registry.uploads_dir, prefix="upload-", suffix=".pt2")
        self.path = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.received = 0

    def write(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.header["size_bytes"]:
            raise RegistryError("invalid", f"more bytes than the declared size_bytes "
                                           f"{self.header['size_bytes']}")
        self._hash.update(chunk)
        self._file.write(chunk)

    def finish(self, inspect: Callable[[Path], dict[str, Any]]) -> tuple[ModelRecord, bool]:
        """Check size and digest, inspect the archive, then store it. Cleans up on failure."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            size = self.header["size_bytes"]
            if self.received != size:
                raise RegistryError("invalid", f"truncated upload: received {self.received} of "
                                               f"{size} declared bytes")
            digest = self._hash.hexdigest()
            if digest != self.header["sha256"]:
                raise RegistryError("invalid", f"sha256 mismatch: declared "
                                               f"{self.header['sha256']}, received {digest}")
            summary = inspect(self.path)
            return self.registry._commit(self.header, self.path, summary)
        finally:
            self.abort()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)


class Registry:
    """Registered models of one daemon; safe to use from several gRPC threads."""

    def __init__(self, state_dir: Path, max_model_bytes: int) -> None:
        self.models_dir = state_dir / "models"
        self.uploads_dir = state_dir / "uploads"
        self.index_path = self.models_dir / "index.json"
        self.max_model_bytes = max_model_bytes
        self._lock = threading.Lock()
        self.models_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.uploads_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._records: dict[tuple[str, str], ModelRecord] = {}
        self._recover()

    # -- persistence -----------------------------------------------------------------------
    def _recover(self) -> None:
        for leftover in self.uploads_dir.iterdir():
            log.info("removing interrupted upload %s", leftover.name)
            leftover.unlink(missing_ok=True)
        for leftover in self.models_dir.glob(".tmp-*"):
            leftover.unlink(missing_ok=True)
        if self.index_path.exists():
            for item in json.loads(self.index_path.read_text())["models"]:
                record = ModelRecord(**item)
                if self.archive_path(record.sha256).exists():
                    self._records[(record.name, record.version)] = record
                else:
                    log.error("model %s:%s lost its archive; dropping it", record.name,
                              record.version)
        referenced = {r.sha256 for r in self._records.values()}
        for blob in self.models_dir.glob("*.pt2"):
            if blob.stem not in referenced:
                log.info("removing unreferenced archive %s", blob.name)
                blob.unlink(missing_ok=True)

    def _write_index(self) -> None:
        models = [asdict(r) for r in sorted(self._records.values(),
                                            key=lambda r: (r.name, r.version))]
        write_atomic(self.index_path, json.dumps({"models": models}, indent=1).encode())

    def archive_path(self, sha256: str) -> Path:
        return self.models_dir / f"{sha256}.pt2"

    # -- requests --------------------------------------------------------------------------
    def begin_upload(self, header: dict[str, Any]) -> Upload:
        """Check a LoadModel header before any byte is stored."""
        name, sha, size = header["name"], header["sha256"].lower(), header["size_bytes"]
        if not NAME_RE.match(name):
            raise RegistryError("invalid", f"name {name!r}: expected 1-128 of A-Z a-z 0-9 _ . -")
        if header["version"] and not NAME_RE.match(header["version"]):
            raise RegistryError("invalid", f"version {header['version']!r}: expected 1-128 of "
                                           "A-Z a-z 0-9 _ . -")
        if not HEX_RE.match(sha):
            raise RegistryError("invalid", "sha256: expected 64 hex digits")
        if size <= 0:
            raise RegistryError("invalid", f"size_bytes: expected > 0, got {size}")
        if size > self.max_model_bytes:
            raise RegistryError("invalid", f"size_bytes {size} exceeds limits.max_model_bytes "
                                           f"{self.max_model_bytes}")
        header = {**header, "sha256": sha, "version": header["version"] or "1"}
        with self._lock:
            self._check_conflict(header)
        return Upload(self, header)

    def _check_conflict(self, header: dict[str, Any]) -> None:
        existing = self._records.get((header["name"], header["version"]))
        if existing and existing.sha256 != header["sha256"] and not header["replace"]:
            raise RegistryError(
                "exists", f"model {header['name']!r} version {header['version']!r} is registered "
                          f"with different content; upload a new version or set replace")

    def _commit(self, header: dict[str, Any], tmp: Path,
                summary: dict[str, Any]) -> tuple[ModelRecord, bool]:
        key = (header["name"], header["version"])
        with self._lock:
            self._check_conflict(header)  # another upload may have won meanwhile
            existing = self._records.get(key)
            if existing and existing.sha256 == header["sha256"]:
                return existing, True
            blob = self.archive_path(header["sha256"])
            if not blob.exists():
                os.replace(tmp, blob)
                fsync_dir(self.models_dir)
            record = ModelRecord(name=key[0], version=key[1], sha256=header["sha256"],
                                 size_bytes=header["size_bytes"], created_at=time.time(),
                                 **summary)
            self._records[key] = record
            self._write_index()
            if existing:
                self._drop_unreferenced(existing.sha256)
            return record, False

    def _drop_unreferenced(self, sha256: str) -> None:
        if all(r.sha256 != sha256 for r in self._records.values()):
            self.archive_path(sha256).unlink(missing_ok=True)

    def list(self) -> list[ModelRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: (r.name, r.version))

    def get(self, name: str, version: str = "") -> ModelRecord:
        with self._lock:
            versions = [r for (n, _), r in self._records.items() if n == name]
        if version:
            versions = [r for r in versions if r.version == version]
        if not versions:
            what = f"{name!r}" + (f" version {version!r}" if version else "")
            raise RegistryError("not_found", f"no model {what} is registered")
        return max(versions, key=lambda r: r.created_at)

    def remove(self, name: str, version: str = "") -> list[ModelRecord]:
        with self._lock:
            keys = [k for k in self._records if k[0] == name and (not version or k[1] == version)]
            if not keys:
                what = f"{name!r}" + (f" version {version!r}" if version else "")
                raise RegistryError("not_found", f"no model {what} is registered")
            removed = [self._records.pop(k) for k in keys]
            self._write_index()
            for record in removed:
                self._drop_unreferenced(record.sha256)
            return removed
