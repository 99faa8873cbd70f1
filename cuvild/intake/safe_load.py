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
exhaustion is bounded per archive: entries and bytes, JSON size, the work sympy may do on an
expression, the pickle scan, and the bytes tensors materialise against the payload bytes
present; everything else is rejected, never "repaired".

This module holds the zip layer, the loading of payloads and the public API; the walk of the
program JSON and its per-class checks are in schema_checks.py, the grammars of the strings
that reach eval, exec or an import in grammar.py, the checks of payloads (configs against
files and graph, the example-inputs scan) in payload_checks.py.

The caller must keep ``example_inputs`` off the returned program: the guard function that
``ExportedProgram.module()`` builds from them is generated Python source.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import stat
import threading
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._export.serde import schema
from torch._export.serde.serialize import (
    _SERIALIZE_TO_TORCH_DTYPE,
    ExportedProgramDeserializer,
)

from cuvild.intake import cuda_guard
from cuvild.intake.errors import UnsafeArchive
from cuvild.intake.grad_regions import inline_grad_regions
from cuvild.intake.grammar import BAD_TEXT_CHARS, Reject
from cuvild.intake.payload_checks import (
    CONSTANT_RE,
    WEIGHT_RE,
    check_payload_config,
    check_sample_inputs,
    check_state_metadata,
)
from cuvild.intake.schema_checks import (
    ALLOWED_HIGHER_ORDER_OPS,
    ALLOWED_OP_NAMESPACES,
    collect_targets,
    from_json,
    walk,
)
from cuvild.intake.trees import plain_program

__all__ = [
    "ALLOWED_HIGHER_ORDER_OPS",
    "ALLOWED_OP_NAMESPACES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "MAX_JSON_BYTES",
    "MAX_JSON_ITEMS",
    "ArchiveInfo",
    "UnsafeArchive",
    "load_archive",
    "load_exported_program",
    "validate_archive",
]

DEFAULT_MAX_BYTES = 8 * 1024**3
DEFAULT_MAX_ENTRIES = 65_536
# JSON entries are read whole and parsed into Python objects: bound both before parsing.
# Torch writes ~1 KB and ~60 items per graph node: 32 MiB is a graph of ~30k nodes.
MAX_JSON_BYTES = 32 << 20  # uncompressed bytes of model.json and of each payload config
MAX_JSON_ITEMS = 2_000_000  # objects + arrays + strings in one JSON entry
_MAX_MARKER_BYTES = 4096  # archive_format, byteorder, version files: a few bytes each

_UNKNOWN = "<archive>"
_MODEL_JSON = "models/model.json"
_WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
_CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
_SAMPLE_INPUTS = "data/sample_inputs/model.pt"
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
EXPORT_INSTEAD = ("export the model with torch.export.export(model, example_inputs) and save "
                  "that with torch.export.save(program, 'model.pt2'), or let the Python client "
                  "do both: Client().load(name, model, example_inputs)")
_ROOT_RE = re.compile(r"[A-Za-z0-9_.\-]{1,255}")
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class ArchiveInfo:
    """What :func:`validate_archive` learned about an accepted archive."""

    root: str
    entries: tuple[str, ...]
    total_bytes: int
    op_targets: frozenset[str]
    schema_version: tuple[int, int]
    torch_version: str
    # The root call's input and output tree specs as uploaded (cuvild/intake/trees.py): the
    # program itself has their non-builtin containers rewritten to dicts.
    trees: dict[str, str]
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


def _check_members(  # noqa: C901 - a check per member rule, each naming it
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
    if rel in _FIXED_ENTRIES or WEIGHT_RE.fullmatch(rel) or CONSTANT_RE.fullmatch(rel):
        return
    if rel == "data.pkl":  # torch.save's own root pickle
        raise UnsafeArchive(rel, f"refused entry: pickle; this is a torch.save file, not a "
                                 f"torch.export archive: {EXPORT_INSTEAD}")
    for pattern, why in _KNOWN_UNSAFE:
        if pattern.fullmatch(rel):
            raise UnsafeArchive(rel, f"refused entry: {why}" + (
                f"; {EXPORT_INSTEAD}" if "pickle" in why else ""))
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


_LOCAL_HEADER = 30  # a zip entry's local header, before its name and extra field
_ALIGN = 64  # torch.export.save aligns every entry's bytes to 64


def _mapped(mapped: mmap.mmap, rel: str, info: zipfile.ZipInfo) -> memoryview | None:
    """A stored entry's bytes in the mapped archive, CRC-checked (every page read once), or
    None where zipfile should read it: compressed, encrypted, a local header that does not
    say what the central directory does, or bytes not aligned as torch writes them."""
    if (info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1
            or info.compress_size != info.file_size):
        return None
    at = info.header_offset
    head = mapped[at:at + _LOCAL_HEADER]
    if len(head) < _LOCAL_HEADER or head[:4] != b"PK\x03\x04" or head[8:10] != b"\0\0":
        return None
    named, extra = (int.from_bytes(head[i:i + 2], "little") for i in (26, 28))
    name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
    start = at + _LOCAL_HEADER + named + extra
    if mapped[at + _LOCAL_HEADER:at + _LOCAL_HEADER + named] != name or start % _ALIGN:
        return None
    if start + info.file_size > len(mapped):
        raise UnsafeArchive(rel, "corrupt or truncated entry (past the end of the file)")
    data = memoryview(mapped)[start:start + info.file_size]
    if zlib.crc32(data) != info.CRC:
        raise UnsafeArchive(rel, "corrupt or truncated entry (its CRC does not match)")
    return data


def _payload(zf: zipfile.ZipFile, mapped: mmap.mmap | None, rel: str,
             info: zipfile.ZipInfo) -> memoryview | bytearray:
    """A weight's or constant's bytes: mapped where they can be (`_mapped`), else read."""
    data = _mapped(mapped, rel, info) if mapped is not None else None
    return _read(zf, rel, info, keep=True) if data is None else data


# ------------------------------------------------------------------------ JSON entries


def _check_entry_sizes(members: dict[str, zipfile.ZipInfo]) -> None:
    """Entries read whole and parsed are bounded from their headers, before a byte of them
    is inflated (a 230 KB deflated model.json of padding inflates to ~230 MB)."""
    for rel in _FIXED_ENTRIES:
        info = members.get(rel)
        if info is None or rel == _SAMPLE_INPUTS:
            continue
        limit = MAX_JSON_BYTES if rel.endswith(".json") else _MAX_MARKER_BYTES
        if info.file_size > limit:
            raise UnsafeArchive(rel, f"{info.file_size} bytes uncompressed, over the limit of "
                                     f"{limit} bytes for this entry")


def _parse(cls: type, data: bytearray, rel: str, prepare: Any = None) -> Any:
    # Each JSON container or string costs ~50-200 bytes of Python objects once parsed.
    items = data.count(b"{") + data.count(b"[") + data.count(b'"') // 2
    if items > MAX_JSON_ITEMS:
        raise UnsafeArchive(rel, f"~{items} JSON objects, arrays and strings, over the limit "
                                 f"of {MAX_JSON_ITEMS}")
    try:
        obj = from_json(cls, json.loads(data.decode("utf-8")))
        if prepare is not None:
            prepare(obj)
        walk(cls, obj, cls.__name__)
    except Reject as e:
        raise UnsafeArchive(rel, str(e)) from None
    except MemoryError:  # a limit of the process, not a fault of this entry
        raise
    except Exception as e:  # malformed JSON / schema mismatch / nesting bombs
        raise UnsafeArchive(rel, f"malformed {cls.__name__} JSON ({type(e).__name__}: {e})") from e
    return obj


# ------------------------------------------------------------------------ public API


def validate_archive(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    payloads: bool = True,
) -> ArchiveInfo:
    """Check an untrusted ``.pt2`` archive without executing anything from it.

    Verifies the zip structure (limits, paths, entry types, CRCs), that every entry is one
    a plain ``torch.export.save`` writes, that no weight/constant needs unpickling, and that
    every operator, name, symbolic expression, tree spec and guard in the program JSON is on
    the allow-lists of this module, that every tensor fits in (and materialises no more than)
    its payload bytes and that the graph's metadata of parameters, buffers and constants
    matches their payloads.

    Args:
        path: the archive file.
        max_bytes: limit on the total uncompressed size of all entries (zip-bomb guard).
        max_entries: limit on the number of zip entries.
        payloads: also read every weight and constant entry to its end (its CRC); False
            where the caller reads them next, each checked then (:func:`load_archive`: the
            200M Llama's 800 MB were read twice, 0.5 s of its 3 s load here).

    Returns:
        An :class:`ArchiveInfo` describing the accepted archive.

    Raises:
        UnsafeArchive: the archive is malformed, over a limit or unsafe.
        OSError: the file cannot be opened (e.g. it does not exist).
    """
    with _open_zip(path) as zf:
        root, members = _check_members(zf, max_bytes, max_entries)
        _check_entry_sizes(members)
        keep = set(_FIXED_ENTRIES) - {_SAMPLE_INPUTS}  # the example inputs are streamed
        blobs = {rel: _read(zf, rel, info, keep=rel in keep) for rel, info in members.items()
                 if payloads or not (WEIGHT_RE.fullmatch(rel) or CONSTANT_RE.fullmatch(rel))}
        if _SAMPLE_INPUTS in members:
            try:
                with zf.open(members[_SAMPLE_INPUTS]) as f:
                    check_sample_inputs(f)
            except Reject as e:
                raise UnsafeArchive(_SAMPLE_INPUTS, str(e)) from None
    for rel, expected in _FIXED_ENTRIES.items():
        if expected is not None and rel in blobs and blobs[rel].strip() != expected:
            raise UnsafeArchive(rel, f"unexpected content {blobs[rel][:32]!r}")
    trees: dict[str, str] = {}
    program = _parse(schema.ExportedProgram, blobs[_MODEL_JSON], _MODEL_JSON,
                     prepare=lambda p: trees.update(plain_program(p)))
    configs = {}
    sizes = {rel: i.file_size for rel, i in members.items()}
    for kind, rel in (("weights", _WEIGHTS_CONFIG), ("constants", _CONSTANTS_CONFIG)):
        configs[kind] = _parse(schema.PayloadConfig, blobs[rel], rel)
        try:
            check_payload_config(configs[kind], kind, sizes)
        except Reject as e:
            raise UnsafeArchive(rel, str(e)) from None
    try:
        check_state_metadata(program, configs)
    except Reject as e:
        raise UnsafeArchive(_MODEL_JSON, str(e)) from None
    targets: set[str] = set()
    collect_targets(program.graph_module.graph, targets)
    return ArchiveInfo(
        root=root,
        entries=tuple(members),
        total_bytes=sum(i.file_size for i in members.values()),
        op_targets=frozenset(targets),
        schema_version=(program.schema_version.major, program.schema_version.minor),
        torch_version=getattr(program, "torch_version", ""),
        trees=trees,
        _program=program,
        _weights=configs["weights"],
        _constants=configs["constants"],
        _sizes=sizes,
    )


def _load_payloads(zf: zipfile.ZipFile, mapped: mmap.mmap | None, info: ArchiveInfo,
                   kind: str) -> dict[str, torch.Tensor]:
    """Raw-bytes counterpart of torch's _load_state_dict/_load_constants, minus every
    pickle branch: one flat tensor per file, then as_strided views (keeps aliasing).
    A stored entry's tensor is the archive's own pages, mapped copy-on-write (`mapped`), as
    OpenVINO and ONNX Runtime map weights and torch.load(mmap=True) does: not copied (the
    200M Llama's 800 MB read in 1.0 s less here), and the processes that read one archive
    (the daemon, each worker) share its pages, which the kernel can drop and read again,
    until a process writes to them (a cache buffer updated in place: a page of its own)."""
    config, folder = (
        (info._weights, "weights") if kind == "weights" else (info._constants, "constants")  # noqa: SLF001 - ArchiveInfo is this module's
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
                if zinfo.file_size != info._sizes[rel]:  # noqa: SLF001 - ArchiveInfo is this module's
                    raise UnsafeArchive(rel, "entry changed since validation")
                data = _payload(zf, mapped, rel, zinfo)
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
        except (UnsafeArchive, MemoryError):
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
    """:func:`load_archive`'s program."""
    return load_archive(path, max_bytes=max_bytes, max_entries=max_entries)[0]


def load_archive(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> tuple[torch.export.ExportedProgram, ArchiveInfo]:
    """Load an untrusted ``.pt2`` archive without running any code it carries.

    Runs :func:`validate_archive`, reads weights and constants as raw bytes, and gives the
    validated program to torch's ``ExportedProgramDeserializer``. Example inputs are never
    read, so the result has ``example_inputs is None`` (and ``ep.module()`` builds no guard
    function); node ``meta["custom"]`` annotations are preserved. Containers of the inputs
    and outputs that are not builtin ones come back as dicts of their fields (the uploaded
    specs are in ``ArchiveInfo.trees``). Calls are serialised by a lock: torch's
    deserializer keeps state in a module-level global.

    Args:
        path: the archive file.
        max_bytes: limit on the total uncompressed size of all entries (zip-bomb guard).
        max_entries: limit on the number of zip entries.

    Returns:
        The deserialized :class:`torch.export.ExportedProgram` and what
        :func:`validate_archive` learned.

    Raises:
        UnsafeArchive: the archive is malformed, over a limit, unsafe, or rejected by
            torch's deserializer after validation.
        OSError: the file cannot be opened.
    """
    cuda_guard.hold()  # the deserializer's fake tensors, on whichever thread (intake/cuda_guard.py)
    info = validate_archive(path, max_bytes=max_bytes, max_entries=max_entries, payloads=False)
    with _open_zip(path) as zf, open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # (kept by its tensors)
        except (OSError, ValueError):  # a file system that cannot map: read as before
            mapped = None
        state_dict = _load_payloads(zf, mapped, info, "weights")
        constants = _load_payloads(zf, mapped, info, "constants")
    try:
        with _DESERIALIZE_LOCK:
            ep = ExportedProgramDeserializer().deserialize(info._program, state_dict,  # noqa: SLF001 - ArchiveInfo is this module's
                                                           constants, None)
    except MemoryError:
        raise
    except Exception as e:  # schema version, dangling names, verifier errors, ...
        raise UnsafeArchive(_MODEL_JSON, f"rejected by torch's deserializer: {e}"
                            f"{UNBACKED_HINT if 'unbacked symbols' in str(e) else ''}") from e
    inline_grad_regions(ep)  # `with torch.no_grad():` in a forward (grad_regions.py)
    return ep, info


# torch 2.13's deserializer fails on some graphs whose sizes come from the data (BART's
# sequence classifier: torch.unique_consecutive over its eos positions), torch.export.load too
UNBACKED_HINT = ("; the graph holds a size read from the data (an unbacked symbol: "
                 "torch.unique, nonzero, x[mask], .item()), which torch.export.load cannot "
                 "read back from this archive either. Export a model whose sizes follow from its "
                 "inputs' shapes (BART's classifier: its base model, the eos rows picked by the "
                 "caller)")
