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

The caller must keep ``example_inputs`` off the returned program: the guard function that
``ExportedProgram.module()`` builds from them is generated Python source.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import json
import keyword
import math
import operator
import os
import pickletools
import re
import stat
import threading
import types
import typing
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils._sympy.functions
from torch._export.serde import schema
from torch._export.serde.serialize import (
    _SERIALIZE_TO_TORCH_DTYPE,
    _SYM_OPS,
    ExportedProgramDeserializer,
    _dict_to_dataclass,
)
from torch._export.serde.union import _Union

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

# Operator namespaces whose ops are all implemented inside torch itself. A namespace is
# global per process, so "ships with torch" is what makes resolving one by name harmless.
ALLOWED_OP_NAMESPACES = frozenset({"aten", "prims", "quantized", "quantized_decomposed"})
# aten ops that touch the filesystem when the graph runs (arbitrary file write / read).
_DENIED_OPS = frozenset({("aten", "save"), ("aten", "from_file")})
# Control-flow HOPs export emits. Deliberately absent: call_torchbind, with_effects,
# triton_kernel_wrapper_*, executorch_call_delegate and friends (they reach custom
# objects, side tables or external code).
ALLOWED_HIGHER_ORDER_OPS = frozenset(
    {
        "cond",
        "while_loop",
        "map_impl",
        "scan",
        "associative_scan",
        "wrap_with_set_grad_enabled",
        "wrap_with_autocast",
        "invoke_subgraph",
        "auto_functionalized",
        "auto_functionalized_v2",
    }
)
# Plain Python callables the serializer writes by "module.name" (getitem + symbolic-int
# ops); everything else under "torch." / "_operator." / "math." would be resolved by getattr.
_PY_TARGETS: dict[str, object] = {
    f"{fn.__module__}.{fn.__name__}": fn for fn in (*_SYM_OPS, operator.getitem)
}

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
_SYMBOL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FLOAT_RE = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_BAD_FQN_CHARS = re.compile(r"[\"\\\x00-\x1f\x7f]")  # breaks FX's getattr(x, "...") codegen
_BAD_TEXT_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # \r etc. end a source comment
_DEVICE_TYPES = frozenset({"cpu", "cuda", "meta"})
_VERIFIERS = frozenset({"", "ATEN", "TRAINING"})  # ones whose op check stays in force
_MAX_EXPR_LEN = 10_000
_MAX_INT = 2**64
_MAX_EXPONENT = 64
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


class _Reject(Exception):
    """Internal: a check failed; turned into UnsafeArchive with the entry name attached."""


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
            or _BAD_TEXT_CHARS.search(name)
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


# ----------------------------------------------------------------- typed schema walk


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=vars(schema), include_extras=False)


def _resolve(tp: Any) -> Any:
    if isinstance(tp, typing.ForwardRef):
        tp = tp.__forward_arg__
    if isinstance(tp, str):
        return getattr(schema, tp)
    return tp


def _walk(tp: Any, value: Any, where: str) -> None:
    """Type-check ``value`` against schema type ``tp`` (torch's JSON->dataclass conversion
    does not), then run the semantic check registered for its class, recursively."""
    tp = _resolve(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _walk(typing.get_args(tp)[0], value, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _walk(args[0], value, where)
    if isinstance(tp, type) and issubclass(tp, IntEnum):
        if type(value) is not int or value not in tp._value2member_map_:
            raise _Reject(f"{where}: {value!r} is not a valid {tp.__name__}")
        return None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if type(value) is not tp:
            raise _Reject(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        hints = _hints(tp)
        if issubclass(tp, _Union):
            names = [value.type]
        else:
            names = [f.name for f in dataclasses.fields(tp)]
        for name in names:
            _walk(hints[name], getattr(value, name), f"{where}.{name}")
        check = _CHECKS.get(tp)
        if check is not None:
            check(value, where)
        return None
    if origin is list:
        if not isinstance(value, list):
            raise _Reject(f"{where}: expected a list")
        for i, item in enumerate(value):
            _walk(typing.get_args(tp)[0], item, f"{where}[{i}]")
        return None
    if origin is dict:
        if not isinstance(value, dict):
            raise _Reject(f"{where}: expected a dict")
        for k, v in value.items():
            if not isinstance(k, str):
                raise _Reject(f"{where}: non-string key")
            _walk(typing.get_args(tp)[1], v, f"{where}[{k!r}]")
        return None
    if tp is bool:
        ok = type(value) is bool
    elif tp is int:
        ok = type(value) is int
    elif tp is float:
        ok = type(value) in (float, int)
    elif tp is str:
        ok = isinstance(value, str)
    else:
        raise _Reject(f"{where}: unsupported schema type {tp!r}")
    if not ok:
        raise _Reject(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return None


# ------------------------------------------------------------------- semantic checks
# Each string below ends up somewhere dangerous in torch's deserializer or in code that FX
# generates from the graph; the comment on each check names that place.


def _ident(name: str, where: str, *, empty_ok: bool = False) -> None:
    # Node / value / argument names become Python identifiers in FX-generated source
    # (placeholders, assignments, kwargs) that GraphModule.recompile() exec()s.
    if empty_ok and name == "":
        return
    if not (name.isascii() and name.isidentifier() and not keyword.iskeyword(name)):
        raise _Reject(f"{where}: name {name!r} is not a plain Python identifier")


def _fqn(name: str, where: str) -> None:
    # Attribute paths end up in FX's `getattr(self, "<part>")` codegen (unlift/unflatten).
    if _BAD_FQN_CHARS.search(name):
        raise _Reject(f"{where}: attribute path {name!r} has forbidden characters")


def _text(value: str, where: str) -> None:
    # Free text (stack traces) is copied into comments of generated source; a lone \r
    # or other control character would end the comment.
    if _BAD_TEXT_CHARS.search(value):
        raise _Reject(f"{where}: control characters in text")


def _check_target(target: str, where: str) -> None:
    """Node targets are resolved by getattr chains from `torch`, `operator`, `math`
    (deserialize_operator): "torch.os.system" would resolve. Allow only real operators."""
    if target in _PY_TARGETS:
        return
    m = re.fullmatch(r"torch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?", target)
    if m is None:
        raise _Reject(f"{where}: operator {target!r} is not an allowed op target")
    ns, name, overload = m.groups()
    if name.startswith("__") or (overload or "").startswith("__"):
        raise _Reject(f"{where}: operator {target!r} is not an allowed op target")
    if ns == "higher_order":
        ok = name in ALLOWED_HIGHER_ORDER_OPS and overload is None
        hop = getattr(torch.ops.higher_order, name, None) if ok else None
        if not isinstance(hop, torch._ops.HigherOrderOperator):
            raise _Reject(f"{where}: higher-order op {target!r} is not allowed")
        return
    if ns not in ALLOWED_OP_NAMESPACES:
        raise _Reject(f"{where}: operator {target!r}: namespace {ns!r} is not allowed")
    if (ns, name) in _DENIED_OPS or overload is None:
        raise _Reject(f"{where}: operator {target!r} is not allowed")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError) as e:
        raise _Reject(f"{where}: unknown operator {target!r}") from e
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != ns:
        raise _Reject(f"{where}: operator {target!r} does not resolve to an op overload")


# Names sympify may call. torch's own sympy functions are passed as locals by the
# deserializer; the sympy names are what srepr() prints. Everything else in sympy's
# namespace (sympify, lambdify, preview, ...) evaluates strings or runs programs.
_TORCH_SYMPY_FUNCS = frozenset(
    n
    for n in (
        "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt",
        "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow",
        "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
        "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "Max", "Min",
    )
    if hasattr(torch.utils._sympy.functions, n)
)  # fmt: skip
_SYMPY_CALLS = _TORCH_SYMPY_FUNCS | {
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs",
    "floor", "ceiling", "Equality", "Unequality", "StrictLessThan", "StrictGreaterThan",
    "LessThan", "GreaterThan", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not",
    "Piecewise", "ExprCondPair",
}  # fmt: skip
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "int_oo", "true", "false", "pi", "E", "I"})
_POW_LIKE = frozenset({"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"})
_BIN_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.BitAnd, ast.BitOr)


def _const_int(node: ast.expr) -> int | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Integer" and node.args:
        node = node.args[0]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _check_sym_expr(expr: str, where: str) -> None:
    """SymExpr.expr_str goes to sympy.sympify(), i.e. eval(). Accept only the grammar
    srepr()/str() produce for shape expressions: numbers, symbols and a fixed set of calls."""
    if len(expr) > _MAX_EXPR_LEN:
        raise _Reject(f"{where}: symbolic expression too long")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _Reject(f"{where}: unparsable symbolic expression") from e

    def check(node: ast.expr) -> None:
        if isinstance(node, ast.Constant):
            v = node.value
            if type(v) not in (int, float, bool) or (type(v) is int and abs(v) > _MAX_INT):
                raise _Reject(f"{where}: constant {v!r} not allowed in {expr!r}")
        elif isinstance(node, ast.Name):
            if node.id not in _SYMPY_NAMES and not re.fullmatch(r"[a-z]+[0-9]+", node.id):
                raise _Reject(f"{where}: name {node.id!r} not allowed in {expr!r}")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            check(node.operand)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, _BIN_OPS):
            check(node.left)
            check(node.right)
        elif isinstance(node, ast.Compare):
            for sub in (node.left, *node.comparators):
                check(sub)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fn = node.func.id
            if fn not in _SYMPY_CALLS or any(isinstance(a, ast.Starred) for a in node.args):
                raise _Reject(f"{where}: call {fn!r} not allowed in {expr!r}")
            args = list(node.args)
            if fn in ("Symbol", "Float"):
                pattern = _SYMBOL_NAME_RE if fn == "Symbol" else _FLOAT_RE
                first = args.pop(0) if args else None
                if not (
                    isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                    and pattern.fullmatch(first.value)
                ) and not (fn == "Float" and first is not None and _const_int(first) is not None):
                    raise _Reject(f"{where}: bad {fn} literal in {expr!r}")
            for kw in node.keywords:
                ok_kw = (fn == "Symbol" and type(getattr(kw.value, "value", None)) is bool) or (
                    fn == "Float" and kw.arg == "precision" and _const_int(kw.value) is not None
                )
                if kw.arg is None or not ok_kw:
                    raise _Reject(f"{where}: keyword {kw.arg!r} not allowed in {expr!r}")
            if fn in _POW_LIKE and len(args) == 2:
                exponent = _const_int(args[1])
                if exponent is not None and abs(exponent) > _MAX_EXPONENT:
                    raise _Reject(f"{where}: exponent too large in {expr!r}")
            for a in args:
                check(a)
        else:
            raise _Reject(f"{where}: {type(node).__name__} not allowed in {expr!r}")

    try:
        check(tree.body)
    except RecursionError as e:
        raise _Reject(f"{where}: symbolic expression nested too deeply") from e


_GUARD_CALLS = frozenset({"max", "min", "abs", "int", "float"})
_GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt", "isnan", "isinf"})
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})


def _check_guard(code: str, where: str) -> None:
    """guards_code strings are pasted into a function body and exec()d by
    ExportedProgram.module() (torch/export/_unlift.py:_convert_guards_code_to_fn).
    Accept only comparisons/arithmetic over L['input'].size()[i]-style accessors."""
    if len(code) > _MAX_EXPR_LEN:
        raise _Reject(f"{where}: guard too long")
    try:
        tree = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _Reject(f"{where}: unparsable guard") from e

    def source(node: ast.expr) -> None:  # L['x'] / L['x'][0] / L['x'].attr
        if isinstance(node, ast.Name) and node.id == "L":
            return
        if isinstance(node, ast.Subscript):
            key = node.slice
            if not isinstance(key, ast.Constant) or not (
                type(key.value) is int
                or (isinstance(key.value, str) and _SYMBOL_NAME_RE.fullmatch(key.value))
            ):
                raise _Reject(f"{where}: subscript not allowed in guard {code!r}")
            return source(node.value)
        if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
            return source(node.value)
        raise _Reject(f"{where}: expression not allowed in guard {code!r}")

    def check(node: ast.expr) -> None:
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float, bool):
                raise _Reject(f"{where}: constant not allowed in guard {code!r}")
        elif isinstance(node, ast.Name) and node.id == "inf":
            pass  # the exec namespace defines inf; other names are not allowed
        elif isinstance(node, ast.BoolOp):
            for v in node.values:
                check(v)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            check(node.operand)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (*_BIN_OPS, ast.Pow)):
            if isinstance(node.op, ast.Pow):
                exponent = _const_int(node.right)
                if exponent is None or abs(exponent) > _MAX_EXPONENT:
                    raise _Reject(f"{where}: exponent not allowed in guard {code!r}")
            check(node.left)
            check(node.right)
        elif isinstance(node, ast.Compare):
            for sub in (node.left, *node.comparators):
                check(sub)
        elif isinstance(node, ast.Call) and not node.keywords:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in _GUARD_METHODS and not node.args:
                source(f.value)
            elif isinstance(f, ast.Name) and f.id in _GUARD_CALLS:
                for a in node.args:
                    check(a)
            elif (
                isinstance(f, ast.Attribute)
                and f.attr in _GUARD_MATH
                and isinstance(f.value, ast.Name)
                and f.value.id == "math"
            ):
                for a in node.args:
                    check(a)
            else:
                raise _Reject(f"{where}: call not allowed in guard {code!r}")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call):
            if not isinstance(node.slice, ast.Constant) or type(node.slice.value) is not int:
                raise _Reject(f"{where}: subscript not allowed in guard {code!r}")
            check(node.value)  # L['x'].size()[0]
        elif isinstance(node, (ast.Subscript, ast.Attribute, ast.Name)):
            source(node)  # L['n'], L['x'].attr
        else:
            raise _Reject(f"{where}: {type(node).__name__} not allowed in guard {code!r}")

    try:
        check(tree.body)
    except RecursionError as e:
        raise _Reject(f"{where}: guard nested too deeply") from e


_SAFE_DEFAULT_FACTORIES = frozenset({"list", "dict", "set", "int", "float", "str", "tuple"})


def _check_treespec(spec: str, where: str) -> None:
    """treespec_loads() imports any module named by an "__enum__" context
    (pytree.enum_object_hook) or a defaultdict's default_factory_module."""
    try:
        protocol, node = json.loads(spec)
    except (ValueError, TypeError, RecursionError) as e:
        raise _Reject(f"{where}: malformed tree spec") from e
    if protocol != 1:
        raise _Reject(f"{where}: tree spec protocol {protocol!r} not supported")

    def check_context(obj: object) -> None:
        if isinstance(obj, dict):
            if "__enum__" in obj:
                raise _Reject(f"{where}: enum (module import) in tree spec context")
            for k, v in obj.items():
                check_context(k)
                check_context(v)
        elif isinstance(obj, list):
            for v in obj:
                check_context(v)
        elif isinstance(obj, str) and (_BAD_FQN_CHARS.search(obj) or "'" in obj):
            # dict keys are pasted as '<key>' into forward() by FX's _PyTreeCodeGen
            raise _Reject(f"{where}: tree spec key {obj!r} has forbidden characters")

    def visit(n: object) -> None:
        if not isinstance(n, dict) or set(n) != {"type", "context", "children_spec"}:
            raise _Reject(f"{where}: malformed tree spec node")
        typ, ctx, children = n["type"], n["context"], n["children_spec"]
        if not isinstance(children, list):
            raise _Reject(f"{where}: malformed tree spec node")
        if typ is None:
            if ctx is not None or children:
                raise _Reject(f"{where}: malformed tree spec leaf")
            return
        if typ not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE or not isinstance(ctx, str):
            raise _Reject(f"{where}: tree spec type {typ!r} is not registered")
        try:
            context = json.loads(ctx)
        except (ValueError, RecursionError):
            context = None  # namedtuple contexts are a bare registry name
        if typ == "collections.defaultdict" and not (
            isinstance(context, dict)
            and context.get("default_factory_module") == "builtins"
            and context.get("default_factory_name") in _SAFE_DEFAULT_FACTORIES
        ):
            raise _Reject(f"{where}: defaultdict factory would import a module")
        check_context(context)
        for child in children:
            visit(child)

    try:
        visit(node)
    except RecursionError as e:
        raise _Reject(f"{where}: tree spec nested too deeply") from e


def _check_node_metadata(meta: dict[str, str], where: str) -> None:
    for key, value in meta.items():
        w = f"{where}.metadata[{key!r}]"
        if key in ("custom", "from_node"):
            try:  # kept as plain JSON data (custom carries the cuvil annotations)
                json.loads(value)
            except (ValueError, RecursionError) as e:
                raise _Reject(f"{w}: not valid JSON") from e
        elif key == "nn_module_stack":
            _fqn(value, w)  # module paths reach FX codegen again in torch.export.unflatten
        elif key == "source_fn_stack":
            # "name,fn": an fn under torch/_operator/math is resolved by a getattr chain
            # (deserialize_meta_func); keep that chain to plain public-ish attribute names.
            _text(value, w)
            for item in value.split(";"):
                parts = item.partition(",")[2].split(".")
                if parts[0].startswith(("torch", "_operator", "math")) and not all(
                    _SYMBOL_NAME_RE.fullmatch(p) and not p.startswith("__") for p in parts
                ):
                    raise _Reject(f"{w}: source function {item!r} is not a dotted name")
        else:
            _text(value, w)


def _check_node(node: schema.Node, where: str) -> None:
    if getattr(node, "name", None) is not None:
        _ident(node.name, f"{where}.name", empty_ok=True)
    _check_target(node.target, f"{where}.target")
    _check_node_metadata(node.metadata, where)


def _check_graph(graph: schema.Graph, where: str) -> None:
    if getattr(graph, "custom_obj_values", None):
        raise _Reject(f"{where}: custom objects (torchbind) are not allowed")
    for field in ("tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values"):
        for name in getattr(graph, field, {}):
            _ident(name, f"{where}.{field}")


def _check_argument(arg: schema.Argument, where: str) -> None:
    if arg.type == "as_custom_obj":
        raise _Reject(f"{where}: custom object argument (torchbind) is not allowed")
    if arg.type == "as_operator":
        _check_target(arg.as_operator, where)
    if arg.type == "as_string_to_argument":
        for key in arg.as_string_to_argument:
            _ident(key, where)


def _check_sym_argument(arg: Any, where: str) -> None:
    if arg.type == "as_name":
        _ident(arg.as_name, where)


def _check_device(dev: schema.Device, where: str) -> None:
    if dev.type not in _DEVICE_TYPES or (dev.index is not None and dev.index < 0):
        raise _Reject(f"{where}: device {dev.type!r}:{dev.index!r} is not allowed")


def _check_module_call_signature(sig: schema.ModuleCallSignature, where: str) -> None:
    _check_treespec(sig.in_spec, f"{where}.in_spec")
    _check_treespec(sig.out_spec, f"{where}.out_spec")
    for name in sig.forward_arg_names or ():
        _ident(name, f"{where}.forward_arg_names")


def _check_graph_module(gm: schema.GraphModule, where: str) -> None:
    for key, value in gm.metadata.items():
        if key == "custom":
            try:
                json.loads(value)
            except (ValueError, RecursionError) as e:
                raise _Reject(f"{where}.metadata['custom']: not valid JSON") from e
    for type_name, nt in getattr(gm, "treespec_namedtuple_fields", {}).items():
        for name in nt.field_names:
            _ident(name, f"{where}.treespec_namedtuple_fields[{type_name!r}]")


def _check_exported_program(ep: schema.ExportedProgram, where: str) -> None:
    for v in getattr(ep, "verifiers", []):
        if v not in _VERIFIERS:  # a custom dialect's verifier may accept any callable
            raise _Reject(f"{where}.verifiers: verifier {v!r} is not allowed")
    for name in ep.range_constraints:  # keys ("s0", "2*s0") are only used for lookups
        _text(name, f"{where}.range_constraints")
    for i, code in enumerate(getattr(ep, "guards_code", [])):
        _check_guard(code, f"{where}.guards_code[{i}]")


def _check_constant_input(spec: schema.InputToConstantInputSpec, where: str) -> None:
    _ident(spec.name, where)  # becomes a placeholder, i.e. a parameter of forward()
    if spec.value.type == "as_string":  # pasted into '...' quotes by _unlift guard codegen
        _fqn(spec.value.as_string, where)
        if "'" in spec.value.as_string:
            raise _Reject(f"{where}: quote in constant string input")


def _no_custom_obj(_: object, where: str) -> None:
    raise _Reject(f"{where}: custom objects (torchbind) are not allowed")


# Keyed by schema class name; classes missing from an older torch's schema are skipped.
_CHECKS: dict[type, Any] = {
    getattr(schema, name): check
    for name, check in {
        "ExportedProgram": _check_exported_program,
        "GraphModule": _check_graph_module,
        "Graph": _check_graph,
        "Node": _check_node,
        "NamedArgument": lambda a, w: _ident(a.name, f"{w}.name", empty_ok=True),
        "Argument": _check_argument,
        "TensorArgument": lambda a, w: _ident(a.name, w),
        "TokenArgument": lambda a, w: _ident(a.name, w),
        "GraphArgument": lambda a, w: _ident(a.name, w),
        "SymIntArgument": _check_sym_argument,
        "SymFloatArgument": _check_sym_argument,
        "SymBoolArgument": _check_sym_argument,
        "CustomObjArgument": _no_custom_obj,
        "InputToCustomObjSpec": _no_custom_obj,
        "SymExpr": lambda e, w: _check_sym_expr(e.expr_str, w),
        "Device": _check_device,
        "InputToParameterSpec": lambda s, w: _fqn(s.parameter_name, w),
        "InputToBufferSpec": lambda s, w: _fqn(s.buffer_name, w),
        "InputToTensorConstantSpec": lambda s, w: _fqn(s.tensor_constant_name, w),
        "InputToConstantInputSpec": _check_constant_input,
        "BufferMutationSpec": lambda s, w: _fqn(s.buffer_name, w),
        "ParameterMutationSpec": lambda s, w: _fqn(s.parameter_name, w),
        "GradientToParameterSpec": lambda s, w: _fqn(s.parameter_name, w),
        "GradientToUserInputSpec": lambda s, w: _ident(s.user_input_name, w),
        "UserInputMutationSpec": lambda s, w: _ident(s.user_input_name, w),
        "ModuleCallEntry": lambda e, w: _fqn(e.fqn, w),
        "ModuleCallSignature": _check_module_call_signature,
    }.items()
    if hasattr(schema, name)
}


def _collect_targets(graph: schema.Graph, out: set[str]) -> None:
    for node in graph.nodes:
        out.add(node.target)
        for inp in node.inputs:
            if inp.arg.type == "as_graph":
                _collect_targets(inp.arg.as_graph.graph, out)
            elif inp.arg.type == "as_operator":
                out.add(inp.arg.as_operator)


# ------------------------------------------------------------------ payload configs


def _check_payload_config(config: Any, kind: str, members: dict[str, zipfile.ZipInfo]) -> None:
    pattern, folder = (_WEIGHT_RE, "weights") if kind == "weights" else (_CONSTANT_RE, "constants")
    referenced: set[str] = set()
    for fqn, meta in config.config.items():
        where = f"config[{fqn!r}]"
        _fqn(fqn, where)
        rel = f"data/{folder}/{meta.path_name}"
        if meta.use_pickle:  # torch: torch.load(weights_only=False) / pickle.loads
            raise _Reject(f"{where}: use_pickle payload {meta.path_name!r} is refused")
        if not pattern.fullmatch(rel):
            raise _Reject(f"{where}: payload {meta.path_name!r} is not a raw tensor file")
        if rel not in members:
            raise _Reject(f"{where}: payload {meta.path_name!r} missing from archive")
        tm = meta.tensor_meta
        if tm is None:
            raise _Reject(f"{where}: raw payload without tensor_meta")
        if tm.dtype not in _SERIALIZE_TO_TORCH_DTYPE:
            raise _Reject(f"{where}: unsupported dtype {tm.dtype!r}")
        for s in (*tm.sizes, *tm.strides, tm.storage_offset):
            if s.type != "as_int" or s.as_int < 0:
                raise _Reject(f"{where}: stored tensors need concrete non-negative sizes")
        referenced.add(rel)
    for rel in members:
        if pattern.fullmatch(rel) and rel not in referenced:
            raise _Reject(f"{rel}: tensor file not referenced by the {kind} config")


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
                raise _Reject("expected one (stored) data.pkl in a torch.save archive")
            ops = list(pickletools.genops(z.read(pkls[0])))
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError) as e:
        raise _Reject(f"not a torch.save archive of tensors ({e})") from e
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
            raise _Reject(f"pickle references {ref!r} (would run on unpickling)")
        recent = [*recent, arg][-2:] if op.name in _STRING_OPS else []


def _parse(cls: type, data: bytes, rel: str) -> Any:
    try:
        obj = _dict_to_dataclass(cls, json.loads(data.decode("utf-8")))
        _walk(cls, obj, cls.__name__)
    except _Reject as e:
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
        except _Reject as e:
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
        except _Reject as e:
            raise UnsafeArchive(rel, str(e)) from None
    targets: set[str] = set()
    _collect_targets(program.graph_module.graph, targets)
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
