"""A model repository on disk, read at start: Triton's layout, which KServe's storage
initializer fills under /mnt/models before the server starts.

    DIR/<name>/config.yaml          optional: the load options of every version of <name>
    DIR/<name>/<version>/model.pt2  a torch.export archive (cuvild.export + torch.export.save)

A version is a folder of <name> named by a number, or any folder holding a model.pt2; other
folders are the model's own (sentence-transformers' 1_Pooling/, a Hub repository's onnx/).

config.yaml holds the options an upload's header carries (`cuvilctl load` flags): precision
(fp32 | auto), max_error, calibration (an .npz next to config.yaml), max_batch, max_delay_us.
An entry is registered as an upload of those bytes would be (the same safe inspection, the
same registry), so nothing here trusts the directory more than a client. An entry whose
archive and options are registered already is not inspected again: a restart serves it from
its load record at once (its files not even read where their stat says they are unchanged
since the last scan: `Digests`). A bad entry is reported with its reason and never stops the others:
whatever one model's directory holds (an unreadable folder, a config.yaml nested 3000 deep or
an alias bomb, a version named "²") fails that model alone, with a reason of bounded length.

Links: a model's files may be symbolic links within the repository (its own layout, or the
storage initializer's); a link that leaves the repository is refused, so the directory cannot
make the daemon read (and hash) files elsewhere on the host. A file's size is checked before
a byte of it is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cuvild.intake.registry import NAME_RE, ModelRecord, Registry
from runtimes.base import write_atomic

log = logging.getLogger(__name__)
ARCHIVE = "model.pt2"
CONFIG = "config.yaml"
CHUNK = 1 << 20
MAX_CONFIG_BYTES = 64 << 10  # a config.yaml of load options is a few lines
_VERSION_NUMBER = re.compile(r"[0-9]{1,18}")  # ASCII digits: str.isdigit() takes "²"
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


def scan(root: Path, max_bytes: int = 2 << 30) -> list[Entry]:
    """The repository's entries, sorted by name and version; raises OSError when `root`
    cannot be listed. A model whose directory cannot be read as one is an entry with its
    error; `max_bytes` bounds an archive's size (limits.max_model_bytes)."""
    root = Path(root)
    top = root.resolve()
    entries: list[Entry] = []
    for model_dir in sorted(p for p in root.iterdir() if not p.name.startswith(".")):
        try:
            if not model_dir.is_dir():
                continue
            entries += _model(model_dir, top, max_bytes)
        except (OSError, ValueError, RecursionError) as e:  # that model alone fails
            entries.append(Entry(_clip(model_dir.name, 128), "", error=_clip(
                f"cannot read {model_dir.name}/: {type(e).__name__}: {e}", 500)))
    return entries


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _inside(path: Path, top: Path) -> bool:
    """Whether `path`, its links followed, stays in the repository."""
    return path.resolve().is_relative_to(top)


def _model(model_dir: Path, top: Path, max_bytes: int) -> list[Entry]:
    name = model_dir.name
    if not NAME_RE.fullmatch(name):
        return [Entry(_clip(name, 128), "", error="a model's directory name must be 1-128 of "
                                                  "A-Z a-z 0-9 _ . -")]
    if not _inside(model_dir, top):
        return [Entry(name, "", error=f"{name}/ links out of the repository (refused: copy it "
                                      "in, or serve the directory it is in)")]
    try:
        options, calibration = _options(model_dir, top)
    except (OSError, ValueError, yaml.YAMLError, RecursionError) as e:
        return [Entry(name, "", error=_clip(f"{CONFIG}: {' '.join(str(e).split())}", 500))]
    # (a folder that is not a version number and holds no archive is the model's own:
    # sentence-transformers' 1_Pooling/, a Hub repository's onnx/ or openvino/)
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir()
                       and not p.name.startswith(".") and (
                           _VERSION_NUMBER.fullmatch(p.name) or (p / ARCHIVE).exists())),
                      key=_version_order)
    if not versions:
        return [Entry(name, "", error=f"no version directory (expected {name}/1/{ARCHIVE})")]
    entries = []
    for version_dir in versions:
        entry = Entry(name, version_dir.name, version_dir / ARCHIVE, options, calibration)
        if not NAME_RE.fullmatch(entry.version):
            entry.version = _clip(entry.version, 128)
            entry.error = "a version's directory name must be 1-128 of A-Z a-z 0-9 _ . -"
        elif not entry.archive.is_file():
            entry.error = f"no {ARCHIVE} in {name}/{entry.version}/"
        elif not _inside(entry.archive, top):
            entry.error = (f"{name}/{entry.version}/{ARCHIVE} links out of the repository "
                           "(refused: copy the archive in)")
        elif (size := entry.archive.stat().st_size) > max_bytes:
            entry.error = (f"{ARCHIVE} is {size} bytes, over limits.max_model_bytes "
                           f"({max_bytes})")
        entries.append(entry)
    return entries


def _version_order(path: Path) -> tuple[int, int, str]:
    return ((0, int(path.name), "") if _VERSION_NUMBER.fullmatch(path.name)
            else (1, 0, path.name))


def _options(model_dir: Path, top: Path) -> tuple[dict[str, Any], Path | None]:
    path = model_dir / CONFIG
    if not path.exists():
        return {}, None
    if not _inside(path, top):
        raise ValueError("links out of the repository (refused)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path.stat().st_size} bytes, over {MAX_CONFIG_BYTES}: a few lines of "
                         "load options are expected")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of load options, got {type(data).__name__}")
    unknown = sorted(set(data) - set(OPTIONS), key=str)
    if unknown:  # (values and keys said clipped: YAML aliases make a small file say a lot)
        raise ValueError(f"unknown option(s) {_clip(', '.join(map(str, unknown)), 200)} "
                         f"(known: {', '.join(OPTIONS)})")
    for key, value in data.items():
        types, _ = OPTIONS[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{key}: expected {' or '.join(t.__name__ for t in types)}, got "
                             f"{type(value).__name__} {_clip(_short(value), 80)}")
    calibration = None
    if data.get("calibration"):
        calibration = model_dir / data["calibration"]
        if calibration.parent != model_dir or not calibration.is_file() or not _inside(
                calibration, top):
            raise ValueError(f"calibration: expected an .npz file in {model_dir.name}/, got "
                             f"{_clip(data['calibration'], 80)!r}")
    return {k: v for k, v in data.items() if k != "calibration"}, calibration


def _short(value: Any) -> str:
    """A value's start, never the whole (an aliased list of lists repr()s to gigabytes)."""
    if isinstance(value, (list, dict)):
        return f"{type(value).__name__} of {len(value)}"
    return repr(value)[:80]


def digest(path: Path) -> tuple[str, int]:
    """sha256 and size of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


class Digests:
    """The repository's files' sha256 as last read, each with the file's stat (device, inode,
    size, modification and change times in ns): a file that stat says is unchanged is not
    read again at the next start (an 800 MB archive took 2.4 s to hash on the 2-core dev
    host; a 14 GB one would take ~40 s of every restart). Any write to a file moves its
    change time, which no one can set back (touching it back to an old mtime moves it too),
    and a file replaced has another inode: either is read again, as git's index and make
    decide. Kept in `path` (state_dir/repository-digests.json), for the files the last scan
    read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            known = json.loads(path.read_text())
            self.known = {k: v for k, v in known.items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError):
            self.known = {}
        self.seen: dict[str, dict[str, Any]] = {}

    @staticmethod
    def _stamp(file: Path) -> list[int]:
        st = file.stat()
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def of(self, file: Path) -> tuple[str, int]:
        """`digest(file)`, from the last scan where the file is unchanged since."""
        key, stamp = str(file), self._stamp(file)
        known = self.known.get(key)
        if known is not None and known.get("stat") == stamp:
            self.seen[key] = known
            return str(known["sha256"]), int(known["size"])
        sha, size = digest(file)
        if self._stamp(file) == stamp:  # (not written to while read: else read next time)
            self.seen[key] = {"stat": stamp, "sha256": sha, "size": size}
        return sha, size

    def save(self) -> None:
        try:
            write_atomic(self.path, json.dumps(self.seen).encode())
        except OSError as e:  # (the next start reads the files again)
            log.warning("model repository: its digests not kept (%s)", e)


def register(entry: Entry, registry: Registry,
             inspect: Callable[[Path], dict[str, Any]],
             digests: Digests | None = None) -> tuple[ModelRecord, bool]:
    """Register `entry` as an upload of its files with its options would (replacing what
    that name and version held); True when it was registered already, as it is, in which
    case nothing is read but the files' digests (none where `digests` has them, unchanged).
    Raises RegistryError, or ValueError when the inspection refuses the archive."""
    assert entry.archive is not None and not entry.error
    read = digests.of if digests is not None else digest
    sha, size = read(entry.archive)
    calibration_sha, calibration_size = read(entry.calibration) if entry.calibration else ("", 0)
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
