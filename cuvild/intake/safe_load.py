"""Safe loading of untrusted ``torch.export`` ``.pt2`` archives.

Threat model: a client sends a ``.pt2`` file it built itself and may have crafted by hand.
``torch.export.load`` is not safe on such input: it unpickles weights, constants and example
inputs (``torch.load(weights_only=False)``, ``pickle.loads``), imports modules named in tree
specs, ``eval``s symbolic-shape strings through ``sympy.sympify``, pastes names from the JSON
into Python source that FX compiles with ``exec``, and keeps ``guards_code`` strings that
``ExportedProgram.module()`` later ``exec``s. This module accepts only the entries a plain
``torch.export.save`` writes, checks every string of the program JSON that reaches one of
those sinks against a strict allow-list, reads tensors as raw bytes, never reads the example
inputs, and only then hands the already-parsed program to torch's own deserializer. Resource
exhaustion is bounded by size/entry limits; everything else is rejected, never "repaired".

This module holds the zip layer, the payloads and the public API; the walk of the program
JSON and its per-class checks are in schema_checks.py, the grammars of the strings that reach
eval, exec or an import in grammar.py.

The caller must keep ``example_inputs`` off the returned program: the guard function that
``ExportedProgram.module()`` builds from them is generated Python source.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickletools
import re
import stat
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._export.serde import schema
from torch._export.serde.serialize import (
    _SERIALIZE_TO_TORCH_DTYPE,
    ExportedProgramDeserializer,
    _dict_to_dataclass,
)

from cuvild.intake.grammar import BAD_TEXT_CHARS, Reject
from cuvild.intake.schema_checks import (
    ALLOWED_HIGHER_ORDER_OPS,
    ALLOWED_OP_NAMESPACES,
    check_fqn,
    collect_targets,
    walk,
)

__all__ = [
    "ALLOWED_HIGHER_ORDER_OPS",
    "ALLOWED_OP_NAMESPACES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "ArchiveInfo",
    "UnsafeArchive",
    "load_exported_program",
    "validate_archive",
]

DEFAULT_MAX_BYTES = 8 * 1024**3
DEFAULT_MAX_ENTRIES = 65_536

_UNKNOWN = "<archive>"
_MODEL_JSON = "models/model.json"
_WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
_CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
_SAMPLE_INPUTS = "data/sample_inputs/model.pt"
_WEIGHT_RE = re.compile(r"data/weights/(weight_[0-9]+)")
_CONSTANT_RE = re.compile(r"data/constants/(tensor_[0-9]+)")
_FIXED_ENTRIES = {
    # entry -> required content (None: any, checked elsewhere or irrelevant)
    "archive_format": b"pt2",
    "archive_version": b"0",
    ".data/version": None,
    ".data/serialization_id": None,
    "byteorder": b"little",  # raw tensor bytes are reinterpreted in native (little) order
    _MODEL_JSON: None,
    _WEIGHTS_CONFIG: None,
    _CONSTANTS_CONFIG: None,
    # Pickled example inputs: every torch.export.save archive has one. Scanned, never loaded.
    _SAMPLE_INPUTS: None,
}
_REQUIRED = ("archive_format", "archive_version", _MODEL_JSON, _WEIGHTS_CONFIG, _CONSTANTS_CONFIG)
# Entries torch knows how to load but that carry code or pickles: named so the error says why.
_KNOWN_UNSAFE = (
    (re.compile(r"data/constants/custom_obj_.*"), "torchbind object (TorchScript-unpickled)"),
    (re.compile(r"data/constants/opaque_obj_.*"), "opaque object (pickle.loads)"),
    (re.compile(r"data/(weights|constants)/[^/]*\.pt"), "legacy pickled state (torch.load)"),
    (re.compile(r"data/aotinductor/.*"), "AOTInductor artifact (native code, dlopen)"),
    (re.compile(r"(data/)?extra/.*"), "extra file (not accepted)"),
    (re.compile(r"serialized_.*|.*\.pkl|.*\.pickle"), "pickle / legacy-format payload"),
)
_ROOT_RE = re.compile(r"[A-Za-z0-9_.\-]{1,255}")
_CHUNK = 1 << 20


class UnsafeArchive(ValueError):
    """Raised for every rejected archive: malformed, over a limit, or carrying unsafe content.

    ``entry`` is the offending zip entry (relative to the archive root), or ``"<archive>"``
    for problems with the file as a whole; ``reason`` says what was wrong.
    """

    def __init__(self, entry: str, reason: str) -> None:
        super().__init__(f"{entry}: {reason}")
        self.entry = entry
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class ArchiveInfo:
    """What :func:`validate_archive` learned about an accepted archive."""

    root: str
    entries: tuple[str, ...]
    total_bytes: int
    op_targets: frozenset[str]
    schema_version: tuple[int, int]
    torch_version: str
    _program: Any = dataclasses.field(repr=False, compare=False)
    _weights: Any = dataclasses.field(repr=False, compare=False)
    _constants: Any = dataclasses.field(repr=False, compare=False)
    _sizes: dict[str, int] = dataclasses.field(repr=False, compare=False)


# ---------------------------------------------------------------------------- zip layer


@contextmanager
def _open_zip(path: str | os.PathLike[str]) -> Iterator[zipfile.ZipFile]:
    if os.path.getsize(path) == 0:
        raise UnsafeArchive(_UNKNOWN, "empty file")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OverflowError) as e:
        raise UnsafeArchive(_UNKNOWN, f"not a readable zip archive ({e})") from e
    with zf:
        yield zf


def _check_members(
    zf: zipfile.ZipFile, max_bytes: int, max_entries: int
) -> tuple[str, dict[str, zipfile.ZipInfo]]:
    infos = zf.infolist()
    if not infos:
        raise UnsafeArchive(_UNKNOWN, "zip archive has no entries")
    if len(infos) > max_entries:
        raise UnsafeArchive(_UNKNOWN, f"{len(infos)} entries exceed the limit of {max_entries}")
    total = sum(i.file_size for i in infos)
    if total > max_bytes:  # zip-bomb guard: zipfile never inflates past the declared size
        raise UnsafeArchive(_UNKNOWN, f"{total} bytes uncompressed exceed the limit {max_bytes}")
    root = infos[0].filename.split("/", 1)[0]  # torch's reader takes the first entry's
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename
        parts = name.split("/")
        # Path safety, even though nothing is ever extracted to disk: a later tool might.
        if (
            name.startswith(("/", "\\"))
            or "\\" in name
            or re.match(r"[A-Za-z]:", name)
            or any(p in ("", ".", "..") for p in parts)
            or BAD_TEXT_CHARS.search(name)
        ):
            raise UnsafeArchive(name, "absolute, traversing or malformed entry path")
        mode = info.external_attr >> 16
        if info.is_dir() or stat.S_IFMT(mode) not in (0, stat.S_IFREG):  # symlink, dir, ...
            raise UnsafeArchive(name, "entry is not a regular file (symlink or directory)")
        if info.flag_bits & 0x1:
            raise UnsafeArchive(name, "encrypted entry")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise UnsafeArchive(name, f"unsupported compression {info.compress_type}")
        if parts[0] != root or len(parts) < 2 or not _ROOT_RE.fullmatch(root):
            raise UnsafeArchive(name, f"entry outside one plain archive root folder {root!r}")
        rel = name[len(root) + 1 :]
        if rel in members:
            raise UnsafeArchive(rel, "duplicate entry name")
        _check_allowed_entry(rel)
        members[rel] = info
    for rel in _REQUIRED:
        if rel not in members:
            raise UnsafeArchive(rel, "required entry missing (not a torch.export.save archive)")
    return root, members


def _check_allowed_entry(rel: str) -> None:
    if rel in _FIXED_ENTRIES or _WEIGHT_RE.fullmatch(rel) or _CONSTANT_RE.fullmatch(rel):
        return
    for pattern, why in _KNOWN_UNSAFE:
        if pattern.fullmatch(rel):
            raise UnsafeArchive(rel, f"refused entry: {why}")
    raise UnsafeArchive(rel, "entry is not on the allow-list of torch.export.save archives")


def _read(zf: zipfile.ZipFile, rel: str, info: zipfile.ZipInfo, keep: bool) -> bytearray:
    """Read one entry to its end, so zipfile verifies the CRC; return it if ``keep``."""
    out = bytearray(info.file_size if keep else 0)
    view = memoryview(out)
    size = 0
    try:
        with zf.open(info) as f:
            while chunk := f.read(_CHUNK):  # zipfile never returns more than file_size
                if keep:
                    view[size : size + len(chunk)] = chunk
                size += len(chunk)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
        raise UnsafeArchive(rel, f"corrupt or truncated entry ({e})") from e
    finally:
        view.release()
    if size != info.file_size:
        raise UnsafeArchive(rel, f"entry is {size} bytes, header says {info.file_size}")
    return out


# ------------------------------------------------------------------ payload configs


def _check_payload_config(config: Any, kind: str, members: dict[str, zipfile.ZipInfo]) -> None:
    pattern, folder = (_WEIGHT_RE, "weights") if kind == "weights" else (_CONSTANT_RE, "constants")
    referenced: set[str] = set()
    for fqn, meta in config.config.items():
        where = f"config[{fqn!r}]"
        check_fqn(fqn, where)
        rel = f"data/{folder}/{meta.path_name}"
        if meta.use_pickle:  # torch: torch.load(weights_only=False) / pickle.loads
            raise Reject(f"{where}: use_pickle payload {meta.path_name!r} is refused")
        if not pattern.fullmatch(rel):
            raise Reject(f"{where}: payload {meta.path_name!r} is not a raw tensor file")
        if rel not in members:
            raise Reject(f"{where}: payload {meta.path_name!r} missing from archive")
        tm = meta.tensor_meta
        if tm is None:
            raise Reject(f"{where}: raw payload without tensor_meta")
        if tm.dtype not in _SERIALIZE_TO_TORCH_DTYPE:
            raise Reject(f"{where}: unsupported dtype {tm.dtype!r}")
        for s in (*tm.sizes, *tm.strides, tm.storage_offset):
            if s.type != "as_int" or s.as_int < 0:
                raise Reject(f"{where}: stored tensors need concrete non-negative sizes")
        referenced.add(rel)
    for rel in members:
        if pattern.fullmatch(rel) and rel not in referenced:
            raise Reject(f"{rel}: tensor file not referenced by the {kind} config")


# Globals a torch.save'd tuple of tensors/scalars/dicts needs; all are on torch's own
# weights_only allow-list. Anything else (exec, os.system, ...) marks a hostile archive.
_SAMPLE_GLOBALS = frozenset(
    {
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "collections.OrderedDict",
        "torch.Size",
        "torch.device",
        "builtins.set",
        "builtins.complex",
    }
    | {f"torch.{n}" for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    | {f"torch.{n}" for n in vars(torch) if re.fullmatch(r"[A-Za-z0-9]+Storage", n)}
)
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_MEMO_OPS = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})


def _check_sample_inputs(data: bytes) -> None:
    """The example inputs are a pickle; torch.export.load unpickles them with a fallback
    to weights_only=False. We never unpickle them: the opcodes are only scanned (pickletools
    parses, it does not execute) so that a payload referencing other globals is refused."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pkls = [n for n in z.namelist() if n.endswith("/data.pkl")]
            if len(pkls) != 1 or z.getinfo(pkls[0]).file_size > len(data):  # inner bomb
                raise Reject("expected one (stored) data.pkl in a torch.save archive")
            ops = list(pickletools.genops(z.read(pkls[0])))
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as e:
        raise Reject(f"not a torch.save archive of tensors ({e})") from e
    recent: list[object] = []  # last two pushed strings, for STACK_GLOBAL
    for op, arg, _ in ops:
        if op.name in _MEMO_OPS:
            continue
        ref = None
        if op.name == "GLOBAL":
            ref = str(arg).replace(" ", ".")
        elif op.name == "STACK_GLOBAL":
            ok = len(recent) == 2 and all(isinstance(x, str) for x in recent)
            ref = ".".join(recent) if ok else "<computed>"  # type: ignore[arg-type]
        elif op.name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4"):
            ref = f"<{op.name}>"
        if ref is not None and ref not in _SAMPLE_GLOBALS:
            raise Reject(f"pickle references {ref!r} (would run on unpickling)")
        recent = [*recent, arg][-2:] if op.name in _STRING_OPS else []


def _parse(cls: type, data: bytes, rel: str) -> Any:
    try:
        obj = _dict_to_dataclass(cls, json.loads(data.decode("utf-8")))
        walk(cls, obj, cls.__name__)
    except Reject as e:
        raise UnsafeArchive(rel, str(e)) from None
    except Exception as e:  # malformed JSON / schema mismatch / nesting bombs
        raise UnsafeArchive(rel, f"malformed {cls.__name__} JSON ({type(e).__name__}: {e})") from e
    return obj


# ------------------------------------------------------------------------ public API


def validate_archive(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> ArchiveInfo:
    """Check an untrusted ``.pt2`` archive without executing anything from it.

    Verifies the zip structure (limits, paths, entry types, CRCs), that every entry is one
    a plain ``torch.export.save`` writes, that no weight/constant needs unpickling, and that
    every operator, name, symbolic expression, tree spec and guard in the program JSON is on
    the allow-lists of this module.

    Args:
        path: the archive file.
        max_bytes: limit on the total uncompressed size of all entries (zip-bomb guard).
        max_entries: limit on the number of zip entries.

    Returns:
        An :class:`ArchiveInfo` describing the accepted archive.

    Raises:
        UnsafeArchive: the archive is malformed, over a limit or unsafe.
        OSError: the file cannot be opened (e.g. it does not exist).
    """
    with _open_zip(path) as zf:
        root, members = _check_members(zf, max_bytes, max_entries)
        blobs = {
            rel: _read(zf, rel, info, keep=rel in _FIXED_ENTRIES) for rel, info in members.items()
        }
    if _SAMPLE_INPUTS in blobs:
        try:
            _check_sample_inputs(blobs.pop(_SAMPLE_INPUTS))
        except Reject as e:
            raise UnsafeArchive(_SAMPLE_INPUTS, str(e)) from None
    for rel, expected in _FIXED_ENTRIES.items():
        if expected is not None and rel in blobs and blobs[rel].strip() != expected:
            raise UnsafeArchive(rel, f"unexpected content {blobs[rel][:32]!r}")
    program = _parse(schema.ExportedProgram, blobs[_MODEL_JSON], _MODEL_JSON)
    configs = {}
    for kind, rel in (("weights", _WEIGHTS_CONFIG), ("constants", _CONSTANTS_CONFIG)):
        configs[kind] = _parse(schema.PayloadConfig, blobs[rel], rel)
        try:
            _check_payload_config(configs[kind], kind, members)
        except Reject as e:
            raise UnsafeArchive(rel, str(e)) from None
    targets: set[str] = set()
    collect_targets(program.graph_module.graph, targets)
    return ArchiveInfo(
        root=root,
        entries=tuple(members),
        total_bytes=sum(i.file_size for i in members.values()),
        op_targets=frozenset(targets),
        schema_version=(program.schema_version.major, program.schema_version.minor),
        torch_version=getattr(program, "torch_version", ""),
        _program=program,
        _weights=configs["weights"],
        _constants=configs["constants"],
        _sizes={rel: i.file_size for rel, i in members.items()},
    )


def _load_payloads(zf: zipfile.ZipFile, info: ArchiveInfo, kind: str) -> dict[str, torch.Tensor]:
    """Raw-bytes counterpart of torch's _load_state_dict/_load_constants, minus every
    pickle branch: one flat tensor per file, then as_strided views (keeps aliasing)."""
    config, folder = (
        (info._weights, "weights") if kind == "weights" else (info._constants, "constants")
    )
    flat: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for fqn, meta in config.config.items():
        tm = meta.tensor_meta
        rel = f"data/{folder}/{meta.path_name}"
        dtype = _SERIALIZE_TO_TORCH_DTYPE[tm.dtype]
        size = [s.as_int for s in tm.sizes]
        try:
            if rel not in flat:
                zinfo = zf.getinfo(f"{info.root}/{rel}")
                if zinfo.file_size != info._sizes[rel]:
                    raise UnsafeArchive(rel, "entry changed since validation")
                data = _read(zf, rel, zinfo, keep=True)
                if not data:  # torch writes empty records for empty (and fake) tensors
                    if math.prod(size) != 0:  # a fake one would need zeros(size): memory DoS
                        raise UnsafeArchive(rel, f"empty record for non-empty tensor {fqn!r}")
                    base = torch.zeros(size, dtype=dtype)
                else:
                    base = torch.frombuffer(data, dtype=torch.uint8)
                    base = base != 0 if dtype == torch.bool else base.view(dtype)
                device = torch.device(tm.device.type, tm.device.index)
                flat[rel] = base if device.type == "cpu" else base.to(device)
            t = torch.as_strided(
                flat[rel], size, [s.as_int for s in tm.strides], tm.storage_offset.as_int
            )
            if meta.is_param:
                t = torch.nn.Parameter(t, requires_grad=tm.requires_grad)
            elif tm.requires_grad:
                t = t.detach().requires_grad_(True)
        except UnsafeArchive:
            raise
        except Exception as e:  # size/stride out of bounds, dtype mismatch, no such device
            raise UnsafeArchive(rel, f"cannot build {fqn!r}: {type(e).__name__}: {e}") from e
        out[fqn] = t
    return out


_DESERIALIZE_LOCK = threading.Lock()


def load_exported_program(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> torch.export.ExportedProgram:
    """Load an untrusted ``.pt2`` archive without running any code it carries.

    Runs :func:`validate_archive`, reads weights and constants as raw bytes, and gives the
    validated program to torch's ``ExportedProgramDeserializer``. Example inputs are never
    read, so the result has ``example_inputs is None`` (and ``ep.module()`` builds no guard
    function); node ``meta["custom"]`` annotations are preserved. Calls are serialised by a
    lock: torch's deserializer keeps state in a module-level global.

    Args:
        path: the archive file.
        max_bytes: limit on the total uncompressed size of all entries (zip-bomb guard).
        max_entries: limit on the number of zip entries.

    Returns:
        The deserialized :class:`torch.export.ExportedProgram`.

    Raises:
        UnsafeArchive: the archive is malformed, over a limit, unsafe, or rejected by
            torch's deserializer after validation.
        OSError: the file cannot be opened.
    """
    info = validate_archive(path, max_bytes=max_bytes, max_entries=max_entries)
    with _open_zip(path) as zf:
        state_dict = _load_payloads(zf, info, "weights")
        constants = _load_payloads(zf, info, "constants")
    try:
        with _DESERIALIZE_LOCK:
            return ExportedProgramDeserializer().deserialize(info._program, state_dict,
                                                             constants, None)
    except Exception as e:  # schema version, dangling names, verifier errors, ...
        raise UnsafeArchive(_MODEL_JSON, f"rejected by torch's deserializer: {e}") from e
