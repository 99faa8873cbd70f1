"""The checks of an archive's payloads: the weight/constant configs against the tensor files
they describe and against the graph's own metadata, and the scan of the pickled example
inputs. Part of the safe loader (cuvild/intake/safe_load.py), which reads the zip.

Every amount of work or memory an archive can ask for is bounded by what it actually carries:
a tensor never needs more bytes than its payload file holds (no stride-0 expansion of a tiny
storage into a huge tensor), the graph's shapes and dtypes for parameters, buffers and
constants are the payloads' own, and the pickle scan streams its opcodes up to a fixed count.
"""

from __future__ import annotations

import math
import pickletools
import re
import zipfile
from typing import IO, Any

import torch
from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

from cuvild.intake.grammar import Reject
from cuvild.intake.schema_checks import check_fqn

# The pickled example inputs (never unpickled, only scanned): torch.save writes a few dozen
# opcodes and ~150 bytes of data.pkl per tensor; the tensor bytes are separate records.
MAX_SAMPLE_PICKLE_BYTES = 4 << 20  # data.pkl, read whole (its header size is checked first)
MAX_SAMPLE_OPCODES = 200_000  # opcodes scanned (pickletools: ~0.3 us each, streamed)
MAX_SAMPLE_DIRECTORY_BYTES = 1 << 20  # the inner zip's central directory (~10k entries)
# Bytes the tensors of one config may materialise beyond the payload bytes present, in all:
# room for small expanded (stride-0) buffers (torch.ones(1).expand(16)); a huge tensor built
# over a tiny storage (8192x16384 fp32 over 4 bytes) is refused.
MAX_EXPANSION_BYTES = 16 << 20

WEIGHT_RE = re.compile(r"data/weights/(weight_[0-9]+)")
CONSTANT_RE = re.compile(r"data/constants/(tensor_[0-9]+)")


def _dtype_name(code: Any) -> str:
    dtype = _SERIALIZE_TO_TORCH_DTYPE.get(code)
    return str(dtype).removeprefix("torch.") if dtype is not None else repr(code)


def check_payload_config(config: Any, kind: str, sizes: dict[str, int]) -> None:  # noqa: C901 - a check per config field, each naming it
    """Every entry of a weights/constants config names a raw tensor file of the archive
    (``sizes``: entry -> bytes) and describes a view that fits in it. The distinct views of
    one config together materialise no more bytes than its files hold (tied weights share
    one view and count once)."""
    pattern, folder = (WEIGHT_RE, "weights") if kind == "weights" else (CONSTANT_RE, "constants")
    referenced: set[str] = set()
    views: set[tuple[Any, ...]] = set()
    materialised = 0
    for fqn, meta in config.config.items():
        where = f"config[{fqn!r}]"
        check_fqn(fqn, where)
        rel = f"data/{folder}/{meta.path_name}"
        if meta.use_pickle:  # torch: torch.load(weights_only=False) / pickle.loads
            raise Reject(f"{where}: use_pickle payload {meta.path_name!r} is refused")
        if not pattern.fullmatch(rel):
            raise Reject(f"{where}: payload {meta.path_name!r} is not a raw tensor file")
        if rel not in sizes:
            raise Reject(f"{where}: payload {meta.path_name!r} missing from archive")
        tm = meta.tensor_meta
        if tm is None:
            raise Reject(f"{where}: raw payload without tensor_meta")
        if tm.dtype not in _SERIALIZE_TO_TORCH_DTYPE:
            raise Reject(f"{where}: unsupported dtype {tm.dtype!r}")
        for s in (*tm.sizes, *tm.strides, tm.storage_offset):
            if s.type != "as_int" or s.as_int < 0:
                raise Reject(f"{where}: stored tensors need concrete non-negative sizes")
        shape = tuple(s.as_int for s in tm.sizes)
        strides = tuple(s.as_int for s in tm.strides)
        if len(shape) != len(strides):
            raise Reject(f"{where}: {len(shape)} sizes but {len(strides)} strides")
        nbytes = _check_view(fqn, where, rel, sizes[rel], tm.dtype, shape, strides,
                             tm.storage_offset.as_int)
        view = (rel, tm.dtype, shape, strides, tm.storage_offset.as_int)
        if view not in views:
            views.add(view)
            materialised += nbytes
        referenced.add(rel)
    present = sum(sizes[rel] for rel in referenced)
    if materialised > present + MAX_EXPANSION_BYTES:
        raise Reject(f"the {kind} config's tensors materialise {materialised} bytes from "
                     f"{present} bytes of payload files: over the limit of {present} + "
                     f"{MAX_EXPANSION_BYTES} bytes (tensors may not hold much more than the "
                     "archive carries for them)")
    for rel in sizes:
        if pattern.fullmatch(rel) and rel not in referenced:
            raise Reject(f"{rel}: tensor file not referenced by the {kind} config")


def _check_view(fqn: str, where: str, rel: str, present: int, dtype_code: Any,
                shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> int:
    """The bytes a view materialises, once sure its storage is in the payload and it does
    not hold (much) more bytes than the payload: the worker copies views into dense tensors."""
    itemsize = _SERIALIZE_TO_TORCH_DTYPE[dtype_code].itemsize
    numel = math.prod(shape)
    nbytes = numel * itemsize
    if numel == 0:
        return 0
    span = (offset + 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))) * itemsize
    if span > present:
        raise Reject(f"{where}: cannot build {fqn!r}: sizes {list(shape)}, strides "
                     f"{list(strides)} and offset {offset} reach {span} bytes, payload {rel} "
                     f"holds {present}")
    if nbytes > present + MAX_EXPANSION_BYTES:
        raise Reject(f"{where}: cannot build {fqn!r}: {list(shape)} "
                     f"{_dtype_name(dtype_code)} is {nbytes} bytes over {present} bytes of "
                     f"payload {rel} (strides {list(strides)}): over the limit of {present} + "
                     f"{MAX_EXPANSION_BYTES} bytes (a tensor may not hold much more than its "
                     "payload)")
    return nbytes


def check_state_metadata(program: Any, configs: dict[str, Any]) -> None:  # noqa: C901 - a check per metadata field, each naming it
    """The graph's metadata of every parameter, buffer and tensor constant is what its
    payload holds: same dtype, same shape (kernels and plans trust the graph)."""
    payloads: dict[str, Any] = {}
    for config in configs.values():
        for fqn, meta in config.config.items():
            payloads.setdefault(fqn, meta)
    values = program.graph_module.graph.tensor_values
    for i, spec in enumerate(program.graph_module.signature.input_specs):
        if spec.type == "parameter":
            arg, fqn = spec.parameter.arg.name, spec.parameter.parameter_name
        elif spec.type == "buffer":
            arg, fqn = spec.buffer.arg.name, spec.buffer.buffer_name
        elif spec.type == "tensor_constant":
            arg, fqn = spec.tensor_constant.arg.name, spec.tensor_constant.tensor_constant_name
        else:
            continue
        where = f"signature.input_specs[{i}] ({spec.type} {fqn!r})"
        meta, declared = payloads.get(fqn), values.get(arg)
        if meta is None or meta.tensor_meta is None:
            raise Reject(f"{where}: no tensor payload for it in the archive")
        if declared is None:
            raise Reject(f"{where}: the graph has no tensor metadata for {arg!r}")
        held = meta.tensor_meta
        if declared.dtype != held.dtype:
            raise Reject(f"{where}: the graph declares dtype {_dtype_name(declared.dtype)}, "
                         f"its payload holds {_dtype_name(held.dtype)}")
        shape = [s.as_int if s.type == "as_int" else s.as_expr.expr_str for s in declared.sizes]
        held_shape = [s.as_int for s in held.sizes]
        if shape != held_shape:
            raise Reject(f"{where}: the graph declares shape {shape}, its payload "
                         f"{meta.path_name!r} holds {held_shape}")


# Globals a torch.save'd tuple of tensors/scalars/dicts needs; all are on torch's own
# weights_only allow-list. Anything else (exec, os.system, ...) marks a hostile archive.
_SAMPLE_GLOBALS = frozenset(
    {
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        # a tensor carrying Python attributes: export(dynamic_shapes=Dim.DYNAMIC) leaves
        # `_specialize_on` on the caller's example tensor, and torch.export.save pickles it
        "torch._tensor._rebuild_from_type_v2",
        "torch.Tensor",
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


def check_sample_inputs(f: IO[bytes]) -> None:  # noqa: C901 - a bound per step of the read, each naming it
    """The example inputs are a pickle; torch.export.load unpickles them with a fallback
    to weights_only=False. We never unpickle them: the opcodes are only scanned (pickletools
    parses, it does not execute) so that a payload referencing other globals is refused.
    ``f`` is the (seekable) entry; only its directory and data.pkl are read, each bounded,
    and the opcodes are streamed up to MAX_SAMPLE_OPCODES."""
    try:
        # zipfile's own reader of the end record (no public one): the directory's size is
        # known before zipfile reads the directory itself.
        endrec = zipfile._EndRecData(f)  # type: ignore[attr-defined]  # noqa: SLF001
        if endrec is None:
            raise zipfile.BadZipFile("no end of central directory")
        directory_bytes = endrec[zipfile._ECD_SIZE]  # type: ignore[attr-defined]  # noqa: SLF001
        if directory_bytes > MAX_SAMPLE_DIRECTORY_BYTES:
            raise Reject(f"its zip directory is {directory_bytes} bytes, over the "
                         f"limit of {MAX_SAMPLE_DIRECTORY_BYTES}")
        with zipfile.ZipFile(f) as z:
            pkls = [i for i in z.infolist() if i.filename.endswith("/data.pkl")]
            if len(pkls) != 1:
                raise Reject("expected one data.pkl in a torch.save archive")
            if pkls[0].file_size > MAX_SAMPLE_PICKLE_BYTES:
                raise Reject(f"data.pkl is {pkls[0].file_size} bytes, over the limit of "
                             f"{MAX_SAMPLE_PICKLE_BYTES} bytes")
            data = z.read(pkls[0])  # zipfile never inflates past the header's size
        recent: list[object] = []  # last two pushed strings, for STACK_GLOBAL
        for count, (op, arg, _) in enumerate(pickletools.genops(data)):  # a generator
            if count >= MAX_SAMPLE_OPCODES:
                raise Reject(f"pickle has more than {MAX_SAMPLE_OPCODES} opcodes: over the "
                             "limit of the scan")
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
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as e:
        raise Reject(f"not a torch.save archive of tensors ({e})") from e
