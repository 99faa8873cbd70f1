"""A model repository on disk, read at start: Triton's layout, which KServe's storage
initializer fills under /mnt/models before the server starts.

    DIR/<name>/config.yaml          optional: the load options of every version of <name>
    DIR/<name>/<version>/model.pt2  a torch.export archive (cuvild.export + torch.export.save)

config.yaml holds the options an upload's header carries (`cuvilctl load` flags): precision
(fp32 | auto), max_error, calibration (an .npz next to config.yaml), max_batch, max_delay_us.
An entry is registered as an upload of those bytes would be (the same safe inspection, the
same registry), so nothing here trusts the directory more than a client. An entry whose
archive and options are registered already is not inspected again: a restart serves it from
its load record at once. A bad entry is reported with its reason and never stops the others.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cuvild.intake.registry import NAME_RE, ModelRecord, Registry

log = logging.getLogger(__name__)
ARCHIVE = "model.pt2"
CONFIG = "config.yaml"
CHUNK = 1 << 20
# option -> (types, the header's value when absent: the daemon's engine.* default applies)
OPTIONS: dict[str, tuple[tuple[type, ...], Any]] = {
    "precision": ((str,), ""), "max_error": ((int, float), 0.0), "calibration": ((str,), ""),
    "max_batch": ((int,), 0), "max_delay_us": ((int,), 0)}


@dataclass
class Entry:
    """One version of one model in the repository; `error` says why it cannot be loaded."""
    name: str
    version: str
    archive: Path | None = None
    options: dict[str, Any] = field(default_factory=dict)
    calibration: Path | None = None
    error: str = ""

    @property
    def key(self) -> str:
        return f"{self.name}:{self.version}" if self.version else self.name


def scan(root: Path) -> list[Entry]:
    """The repository's entries, sorted by name and version; raises OSError when `root`
    cannot be listed."""
    entries: list[Entry] = []
    for model_dir in sorted(p for p in Path(root).iterdir() if not p.name.startswith(".")):
        if not model_dir.is_dir():
            continue
        entries += _model(model_dir)
    return entries


def _model(model_dir: Path) -> list[Entry]:
    name = model_dir.name
    if not NAME_RE.fullmatch(name):
        return [Entry(name, "", error="a model's directory name must be 1-128 of A-Z a-z 0-9 "
                                      "_ . -")]
    try:
        options, calibration = _options(model_dir)
    except (OSError, ValueError, yaml.YAMLError) as e:
        return [Entry(name, "", error=f"{CONFIG}: {' '.join(str(e).split())}")]
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir()
                       and not p.name.startswith(".")), key=_version_order)
    if not versions:
        return [Entry(name, "", error=f"no version directory (expected {name}/1/{ARCHIVE})")]
    entries = []
    for version_dir in versions:
        entry = Entry(name, version_dir.name, version_dir / ARCHIVE, options, calibration)
        if not NAME_RE.fullmatch(entry.version):
            entry.error = "a version's directory name must be 1-128 of A-Z a-z 0-9 _ . -"
        elif not entry.archive.is_file():
            entry.error = f"no {ARCHIVE} in {name}/{entry.version}/"
        entries.append(entry)
    return entries


def _version_order(path: Path) -> tuple[int, int, str]:
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def _options(model_dir: Path) -> tuple[dict[str, Any], Path | None]:
    path = model_dir / CONFIG
    if not path.exists():
        return {}, None
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of load options, got {type(data).__name__}")
    unknown = sorted(set(data) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(map(str, unknown))} (known: "
                         f"{', '.join(OPTIONS)})")
    for key, value in data.items():
        types, _ = OPTIONS[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{key}: expected {' or '.join(t.__name__ for t in types)}, got "
                             f"{value!r}")
    calibration = None
    if data.get("calibration"):
        calibration = model_dir / data["calibration"]
        if calibration.parent != model_dir or not calibration.is_file():
            raise ValueError(f"calibration: expected an .npz file in {model_dir.name}/, got "
                             f"{data['calibration']!r}")
    return {k: v for k, v in data.items() if k != "calibration"}, calibration


def digest(path: Path) -> tuple[str, int]:
    """sha256 and size of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def register(entry: Entry, registry: Registry,
             inspect: Callable[[Path], dict[str, Any]]) -> tuple[ModelRecord, bool]:
    """Register `entry` as an upload of its files with its options would (replacing what
    that name and version held); True when it was registered already, as it is, in which
    case nothing is read but the files' digests. Raises RegistryError, or ValueError when
    the inspection refuses the archive."""
    assert entry.archive is not None and not entry.error
    sha, size = digest(entry.archive)
    calibration_sha, calibration_size = digest(entry.calibration) if entry.calibration else ("", 0)
    header = {"name": entry.name, "version": entry.version, "sha256": sha, "size_bytes": size,
              "replace": True, "calibration_bytes": calibration_size,
              "calibration_sha256": calibration_sha,
              **{k: entry.options.get(k, default) for k, (_, default) in OPTIONS.items()
                 if k != "calibration"}}
    same = registry.unchanged(header)
    if same is not None:
        return same, True
    upload = registry.begin_upload(header)
    try:
        _send(entry.archive, upload.write)
        if entry.calibration is not None:
            _send(entry.calibration, upload.write_calibration)
    except BaseException:
        upload.abort()
        raise
    return upload.finish(inspect)


def _send(path: Path, write: Callable[[bytes], None]) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            write(chunk)
