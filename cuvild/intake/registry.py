"""The model registry: archives stored content-addressed under state_dir, one JSON index.

Layout:  state_dir/models/<sha256>.pt2   the archives (one file per distinct content)
         state_dir/models/<sha256>.npz   calibration inputs uploaded with a model
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

from cuvild.intake.errors import UnsafeArchive
from cuvild.intake.verdicts import Verdicts
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
    precision: str = ""  # "fp32" | "auto" | "" (the daemon's default)
    max_error: float = 0.0  # the budget of "auto" (0: the daemon's default)
    calibration: str = ""  # sha256 of the calibration .npz ("": none)
    calibration_inputs: int = 0
    max_batch: int = 0  # rows merged into one run (0: the daemon's default; 1: not batched)
    max_delay_us: int = 0  # the oldest request's wait for others (0: the daemon's default)
    out_spec: str = ""  # the output tree spec as uploaded, data only (cuvild/intake/trees.py)


class _Incoming:
    """One file arriving in chunks: hashed and size-checked as it is written."""

    def __init__(self, directory: Path, suffix: str, size: int, sha256: str,
                 fields: tuple[str, str, str]) -> None:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix="upload-", suffix=suffix)
        self.path, self.size, self.sha256 = Path(tmp), size, sha256
        self.what, self.size_field, self.sha_field = fields  # for messages naming the header
        self._file = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.received = 0

    def write(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.size:
            raise RegistryError("invalid", f"more bytes than the declared {self.size_field} "
                                           f"{self.size}")
        self._hash.update(chunk)
        self._file.write(chunk)

    def finish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self.received != self.size:
            raise RegistryError("invalid", f"truncated {self.what}: received {self.received} "
                                           f"of {self.size} declared bytes")
        digest = self._hash.hexdigest()
        if digest != self.sha256:
            raise RegistryError("invalid", f"{self.sha_field} mismatch: declared "
                                           f"{self.sha256}, received {digest}")

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)


class Upload:
    """One archive, and its calibration inputs if any, arriving in chunks."""

    def __init__(self, registry: Registry, header: dict[str, Any]) -> None:
        self.registry = registry
        self.header = header
        self.archive = _Incoming(registry.uploads_dir, ".pt2", header["size_bytes"],
                                 header["sha256"], ("upload", "size_bytes", "sha256"))
        self.calibration = (_Incoming(registry.uploads_dir, ".npz", header["calibration_bytes"],
                                      header["calibration_sha256"],
                                      ("calibration", "calibration_bytes",
                                       "calibration_sha256"))
                            if header["calibration_bytes"] else None)

    def write(self, chunk: bytes) -> None:
        self.archive.write(chunk)

    def write_calibration(self, chunk: bytes) -> None:
        if self.calibration is None:
            raise RegistryError("invalid", "calibration_chunk without calibration_bytes in the "
                                           "header")
        if self.archive.received != self.archive.size:
            raise RegistryError("invalid", "calibration_chunk before the whole archive")
        self.calibration.write(chunk)

    def finish(self, inspect: Callable[[Path], dict[str, Any]]) -> tuple[ModelRecord, bool]:
        """Check sizes and digests, inspect the archive and the calibration inputs against
        it, then store them. Cleans up on failure."""
        try:
            self.archive.finish()
            if self.calibration is not None:
                self.calibration.finish()
            summary = self.registry.inspected(self.header["sha256"], self.archive.path, inspect)
            if self.calibration is not None:
                summary["calibration_inputs"] = check_calibration(self.calibration.path,
                                                                  summary["inputs"])
            return self.registry._commit(self.header, self.archive.path, summary,  # noqa: SLF001 - an upload commits to its registry
                                         self.calibration and self.calibration.path)
        finally:
            self.abort()

    def abort(self) -> None:
        self.archive.abort()
        if self.calibration is not None:
            self.calibration.abort()


MAX_CALIBRATION_INPUTS = 1024
MAX_BATCH = 1024
MAX_DELAY_US = 1_000_000
POLICIES = ("", "fp32", "auto")


def _policy(header: dict[str, Any]) -> dict[str, Any]:
    """A record's load options, as an upload's header gives them."""
    return {"precision": header["precision"], "max_error": header["max_error"],
            "calibration": header["calibration_sha256"] if header["calibration_bytes"] else "",
            "max_batch": header["max_batch"], "max_delay_us": header["max_delay_us"]}


def check_policy(header: dict[str, Any], max_bytes: int) -> None:
    """Refuse a bad precision policy before any byte is stored, naming the field."""
    if header["precision"] not in POLICIES:
        raise RegistryError("invalid", f"precision: expected 'fp32' or 'auto', got "
                                       f"{header['precision']!r}")
    budget = header["max_error"]
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (
            budget == 0 or 0 < budget < 1):
        raise RegistryError("invalid", f"max_error: expected a relative error in (0, 1) (or 0 "
                                       f"for the daemon's default), got {budget!r}")
    if not 0 <= header["max_batch"] <= MAX_BATCH:
        raise RegistryError("invalid", f"max_batch: expected 0 (the daemon's default), 1 (not "
                                       f"batched) to {MAX_BATCH}, got {header['max_batch']}")
    if not 0 <= header["max_delay_us"] <= MAX_DELAY_US:
        raise RegistryError("invalid", f"max_delay_us: expected 0 (the daemon's default) to "
                                       f"{MAX_DELAY_US}, got {header['max_delay_us']}")
    size = header["calibration_bytes"]
    if size < 0 or size > max_bytes:
        raise RegistryError("invalid", f"calibration_bytes: expected 0 to {max_bytes}, got "
                                       f"{size}")
    if size and not HEX_RE.fullmatch(header["calibration_sha256"].lower()):
        raise RegistryError("invalid", "calibration_sha256: expected 64 hex digits")


def check_calibration(path: Path, specs: list[dict[str, Any]]) -> int:
    """How many samples the calibration .npz holds; RegistryError naming `calibration` and
    what is wrong unless it has one array per model input, of its dtype and shape (any size
    of a dynamic dimension), all with the same number of samples along axis 0."""
    import numpy as np

    def refuse(why: str) -> RegistryError:
        return RegistryError("invalid", f"calibration: {why}")

    try:
        with np.load(path, allow_pickle=False) as data:
            names = set(data.files)
            arrays = {spec["name"]: data[spec["name"]] for spec in specs if spec["name"] in data}
    except Exception as e:  # noqa: BLE001 - object arrays (pickles), a bad zip, ...
        raise refuse(f"not an .npz of plain arrays ({type(e).__name__}: {e})") from None
    wanted = [spec["name"] for spec in specs]
    if names != set(wanted):
        raise refuse(f"expected one array per model input {wanted}, got {sorted(names)}")
    counts = set()
    for spec in specs:
        a = arrays[spec["name"]]
        shape = list(a.shape[1:])
        if str(a.dtype) != spec["dtype"]:
            raise refuse(f"input {spec['name']!r}: dtype {a.dtype}, the model takes "
                         f"{spec['dtype']}")
        if len(shape) != len(spec["shape"]) or any(
                want not in (-1, got) for want, got in zip(spec["shape"], shape, strict=True)):
            raise refuse(f"input {spec['name']!r}: samples of shape {shape}, the model takes "
                         f"{spec['shape']} (samples along axis 0)")
        counts.add(a.shape[0])
    if len(counts) != 1 or not 0 < counts.pop() <= MAX_CALIBRATION_INPUTS:
        raise refuse(f"every input needs the same number of samples, 1 to "
                     f"{MAX_CALIBRATION_INPUTS}")
    return len(arrays[wanted[0]])


class Registry:
    """Registered models of one daemon; safe to use from several gRPC threads."""

    def __init__(self, state_dir: Path, max_model_bytes: int,
                 verdicts: Verdicts | None = None) -> None:
        self.verdicts = verdicts  # the inspection's, kept in the compile cache (verdicts.py)
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
                if not self.archive_path(record.sha256).exists():
                    log.error("model %s:%s lost its archive; dropping it", record.name,
                              record.version)
                    continue
                if record.calibration and not self.calibration_path(record.calibration).exists():
                    log.error("model %s:%s lost its calibration inputs; int8 will not be tried",
                              record.name, record.version)
                    record.calibration, record.calibration_inputs = "", 0
                self._records[(record.name, record.version)] = record
        referenced = {r.sha256 for r in self._records.values()} | {
            r.calibration for r in self._records.values() if r.calibration}
        for blob in [*self.models_dir.glob("*.pt2"), *self.models_dir.glob("*.npz")]:
            if blob.stem not in referenced:
                log.info("removing unreferenced %s", blob.name)
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
        if not NAME_RE.fullmatch(name):
            raise RegistryError("invalid", f"name {name!r}: expected 1-128 of A-Z a-z 0-9 _ . -")
        if header["version"] and not NAME_RE.fullmatch(header["version"]):
            raise RegistryError("invalid", f"version {header['version']!r}: expected 1-128 of "
                                           "A-Z a-z 0-9 _ . -")
        if not HEX_RE.fullmatch(sha):
            raise RegistryError("invalid", "sha256: expected 64 hex digits")
        if size <= 0:
            raise RegistryError("invalid", f"size_bytes: expected > 0, got {size}")
        if size > self.max_model_bytes:
            raise RegistryError("invalid", f"size_bytes {size} exceeds limits.max_model_bytes "
                                           f"{self.max_model_bytes}")
        header = {"precision": "", "max_error": 0.0, "calibration_bytes": 0,
                  "calibration_sha256": "", "max_batch": 0, "max_delay_us": 0, **header}
        check_policy(header, self.max_model_bytes)
        header = {**header, "sha256": sha, "version": header["version"] or "1",
                  "calibration_sha256": header["calibration_sha256"].lower()}
        with self._lock:
            self._check_conflict(header)
        return Upload(self, header)

    def _check_conflict(self, header: dict[str, Any]) -> None:
        existing = self._records.get((header["name"], header["version"]))
        if existing and existing.sha256 != header["sha256"] and not header["replace"]:
            raise RegistryError(
                "exists", f"model {header['name']!r} version {header['version']!r} is registered "
                          f"with different content; upload it as a new version, or replace it "
                          f"(Python: replace=True; cuvilctl load --replace)")

    def _commit(self, header: dict[str, Any], tmp: Path, summary: dict[str, Any],
                calibration_tmp: Path | None = None) -> tuple[ModelRecord, bool]:
        key = (header["name"], header["version"])
        policy = _policy(header)
        static = [i["name"] for i in summary.get("inputs", []) if i["shape"][:1] != [-1]]
        if header["max_batch"] > 1 and static:
            raise RegistryError("invalid", f"max_batch {header['max_batch']}: input "
                                           f"{static[0]!r} has no dynamic first dimension; "
                                           "export the model with dynamic_shapes={...: {0: "
                                           "torch.export.Dim('batch')}} to batch it")
        with self._lock:
            self._check_conflict(header)  # another upload may have won meanwhile
            existing = self._records.get(key)
            if self._same(existing, header):
                return existing, True
            for path, dest in ((tmp, self.archive_path(header["sha256"])),
                               (calibration_tmp, self.calibration_path(policy["calibration"]))):
                if path is not None and not dest.exists():
                    os.replace(path, dest)
            fsync_dir(self.models_dir)
            record = ModelRecord(name=key[0], version=key[1], sha256=header["sha256"],
                                 size_bytes=header["size_bytes"], created_at=time.time(),
                                 **summary, **policy)
            self._records[key] = record
            self._write_index()
            if existing:
                self._drop_unreferenced(existing)
            return record, False

    def known(self, sha256: str) -> bool:
        """Whether the inspection's verdict on these bytes is kept (one this daemon signed):
        then they are not inspected again."""
        return self.verdicts is not None and self.verdicts.verdict(
            sha256.lower(), self.max_model_bytes) is not None

    def inspected(self, sha256: str, path: Path,
                  inspect: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """The archive's summary: its verdict's, else `inspect`'s (kept as a verdict, as the
        safe loader's refusal is). `path` holds bytes whose sha256 was checked to be
        `sha256`. Raises UnsafeArchive (a ValueError) where they are refused."""
        verdicts = self.verdicts
        kept = verdicts.verdict(sha256, self.max_model_bytes) if verdicts is not None else None
        if kept is not None:
            log.info("archive %s: %s before (its verdict in the compile cache)", sha256[:12],
                     "refused" if isinstance(kept, UnsafeArchive) else "inspected")
            if isinstance(kept, UnsafeArchive):
                raise kept
            return kept
        try:
            summary = inspect(path)
        except UnsafeArchive as e:
            if verdicts is not None:
                verdicts.refuse(sha256, e.entry, e.reason, self.max_model_bytes)
            raise
        if verdicts is not None:
            verdicts.keep(sha256, summary)
        return summary

    def unchanged(self, header: dict[str, Any]) -> ModelRecord | None:
        """The record an upload with this header (a full one, as begin_upload fills it) would
        leave as it is: the same archive under that name and version, with the same policy."""
        with self._lock:
            existing = self._records.get((header["name"], header["version"]))
            return existing if self._same(existing, header) else None

    @staticmethod
    def _same(existing: ModelRecord | None, header: dict[str, Any]) -> bool:
        return existing is not None and existing.sha256 == header["sha256"] and all(
            getattr(existing, k) == v for k, v in _policy(header).items())

    def calibration_path(self, sha256: str) -> Path:
        return self.models_dir / f"{sha256}.npz"

    def _drop_unreferenced(self, gone: ModelRecord) -> None:
        """Remove the files of a record no other record shares."""
        if all(r.sha256 != gone.sha256 for r in self._records.values()):
            self.archive_path(gone.sha256).unlink(missing_ok=True)
        if gone.calibration and all(r.calibration != gone.calibration
                                    for r in self._records.values()):
            self.calibration_path(gone.calibration).unlink(missing_ok=True)

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
                self._drop_unreferenced(record)
            return removed
