"""The typed walk of an archive's program JSON and the checks of every string in it that
reaches a dangerous place in torch's deserializer or in code FX generates from the graph.

torch's JSON -> dataclass conversion does not check types; `walk` does, then runs the check
registered for each schema class (the comment on each check names the place it guards).
Part of the safe loader (cuvild/intake/safe_load.py); expression grammars are in grammar.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import keyword
import operator
import re
import types
import typing
from enum import IntEnum
from typing import Any

import torch
from torch._export.serde import schema
from torch._export.serde.serialize import _SYM_OPS
from torch._export.serde.union import _Union

from cuvild.intake import foreign_ops
from cuvild.intake.grammar import (
    BAD_FQN_CHARS,
    BAD_TEXT_CHARS,
    SYMBOL_NAME_RE,
    Reject,
    check_guard,
    check_sym_expr,
    check_treespec,
)

# Operator namespaces whose ops are all implemented inside torch itself. A namespace is
# global per process, so "ships with torch" is what makes resolving one by name harmless.
# Beside them, the few ops of other libraries that cuvild defines itself (foreign_ops.py).
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
_DEVICE_TYPES = frozenset({"cpu", "cuda", "meta"})
_VERIFIERS = frozenset({"", "ATEN", "TRAINING"})  # ones whose op check stays in force


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


def from_json(tp: Any, data: Any) -> Any:  # noqa: C901, PLR0911 - a branch per schema node kind
    """The schema objects of a parsed JSON value, as torch's ``_dict_to_dataclass`` builds
    them (keys a dataclass lacks ignored, ints of a float field made floats), with each
    class's field types looked up once, not once an object: torch's resolves them every
    time, 0.85 s of the 200M Llama's 4.3 MB program here, 0.17 s this way (pytorch/pytorch
    #196452). Shapes that do not fit are passed through for `walk` to refuse."""
    tp = _resolve(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return from_json(typing.get_args(tp)[0], data)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        return from_json(next(a for a in typing.get_args(tp) if a is not type(None)), data)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(data, dict):
        hints = _hints(tp)
        if issubclass(tp, _Union):
            if len(data) != 1:
                raise Reject(f"{tp.__name__}: one field expected, got {len(data)}")
            (name, value), = data.items()
            if name not in hints:
                raise Reject(f"{tp.__name__}: no field {name!r}")
            return tp.create(**{name: from_json(hints[name], value)})
        return tp(**{f.name: from_json(hints[f.name], data[f.name])
                     for f in dataclasses.fields(tp) if f.name in data})
    if origin is list and isinstance(data, list):
        item = typing.get_args(tp)[0]
        return [from_json(item, d) for d in data]
    if origin is dict and isinstance(data, dict):
        value_tp = typing.get_args(tp)[1]
        return {k: from_json(value_tp, v) for k, v in data.items()}
    if tp is float and (isinstance(data, int | float) or data in NON_FINITE):
        return float(data)
    return data


# How torch's serializer writes a float that JSON cannot hold (a masked_fill with -inf: PhiMoE's
# router); torch's reader takes any string float() parses, this one these three alone.
NON_FINITE = frozenset({"Infinity", "-Infinity", "NaN"})


def walk(tp: Any, value: Any, where: str) -> None:  # noqa: C901 - a branch per schema node kind
    """Type-check ``value`` against schema type ``tp`` (torch's JSON->dataclass conversion
    does not), then run the semantic check registered for its class, recursively."""
    tp = _resolve(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return walk(typing.get_args(tp)[0], value, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return walk(args[0], value, where)
    if isinstance(tp, type) and issubclass(tp, IntEnum):
        if type(value) is not int or value not in tp._value2member_map_:
            raise Reject(f"{where}: {value!r} is not a valid {tp.__name__}")
        return None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if type(value) is not tp:
            raise Reject(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        hints = _hints(tp)
        if issubclass(tp, _Union):
            names = [value.type]
        else:
            names = [f.name for f in dataclasses.fields(tp)]
        for name in names:
            walk(hints[name], getattr(value, name), f"{where}.{name}")
        check = _CHECKS.get(tp)
        if check is not None:
            check(value, where)
        return None
    if origin is list:
        if not isinstance(value, list):
            raise Reject(f"{where}: expected a list")
        for i, item in enumerate(value):
            walk(typing.get_args(tp)[0], item, f"{where}[{i}]")
        return None
    if origin is dict:
        if not isinstance(value, dict):
            raise Reject(f"{where}: expected a dict")
        for k, v in value.items():
            if not isinstance(k, str):
                raise Reject(f"{where}: non-string key")
            walk(typing.get_args(tp)[1], v, f"{where}[{k!r}]")
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
        raise Reject(f"{where}: unsupported schema type {tp!r}")
    if not ok:
        raise Reject(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
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
        raise Reject(f"{where}: name {name!r} is not a plain Python identifier")


def check_fqn(name: str, where: str) -> None:
    # Attribute paths end up in FX's `getattr(self, "<part>")` codegen (unlift/unflatten).
    if BAD_FQN_CHARS.search(name):
        raise Reject(f"{where}: attribute path {name!r} has forbidden characters")


def _text(value: str, where: str) -> None:
    # Free text (stack traces) is copied into comments of generated source; a lone \r
    # or other control character would end the comment.
    if BAD_TEXT_CHARS.search(value):
        raise Reject(f"{where}: control characters in text")


def _check_target(target: str, where: str) -> None:
    """Node targets are resolved by getattr chains from `torch`, `operator`, `math`
    (deserialize_operator): "torch.ops.aten.__class__" would resolve to a Python attribute,
    "torch.os.system" to a function. Allow only operators the dispatcher has a schema for
    (every op of the allowed namespaces that torch itself registers, dunder-named ones like
    aten.__and__ included; ops of libraries not loaded have none), then check that the
    getattr chain reaches that very op."""
    if target in _PY_TARGETS:
        return
    m = re.fullmatch(r"torch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?", target)
    if m is None:
        raise Reject(f"{where}: operator {target!r} is not an allowed op target")
    ns, name, overload = m.groups()
    if ns == "higher_order":
        ok = name in ALLOWED_HIGHER_ORDER_OPS and overload is None
        hop = getattr(torch.ops.higher_order, name, None) if ok else None
        if not isinstance(hop, torch._ops.HigherOrderOperator):  # noqa: SLF001 - torch's op classes live in torch._ops
            raise Reject(f"{where}: higher-order op {target!r} is not allowed")
        return
    _check_namespace(ns, name, overload, target, where)
    if (ns, name) in _DENIED_OPS or overload is None or overload.startswith("__"):
        raise Reject(f"{where}: operator {target!r} is not allowed")
    try:  # the registry, by name: nothing of Python is looked up
        torch._C._get_schema(f"{ns}::{name}", "" if overload == "default" else overload)  # noqa: SLF001 - the dispatcher's schema registry
    except RuntimeError as e:
        raise Reject(f"{where}: unknown operator {target!r} (no such schema)") from e
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError) as e:
        raise Reject(f"{where}: unknown operator {target!r}") from e
    is_op = isinstance(op, torch._ops.OpOverload)  # noqa: SLF001 - torch's op classes live in torch._ops
    if not is_op or op.namespace != ns or op.name().split(".")[0] != f"{ns}::{name}":
        raise Reject(f"{where}: operator {target!r} does not resolve to an op overload")


def _check_namespace(ns: str, name: str, overload: str | None, target: str, where: str) -> None:
    """Torch's own namespaces, or an op of another library that cuvild defines itself (as
    that library does: foreign_ops.py), defined now where this process has none."""
    if (ns, name) in foreign_ops.KNOWN and overload == "default":
        if not foreign_ops.ensure(ns, name):
            raise Reject(f"{where}: operator {target!r} is declared otherwise in this process "
                         f"than {foreign_ops.KNOWN[(ns, name)]!r}, which cuvild runs")
    elif ns not in ALLOWED_OP_NAMESPACES:
        raise Reject(f"{where}: operator {target!r}: namespace {ns!r} is not allowed")


def _check_node_metadata(meta: dict[str, str], where: str) -> None:
    for key, value in meta.items():
        w = f"{where}.metadata[{key!r}]"
        if key in ("custom", "from_node"):
            try:  # kept as plain JSON data (custom carries the cuvil annotations)
                json.loads(value)
            except (ValueError, RecursionError) as e:
                raise Reject(f"{w}: not valid JSON") from e
        elif key == "nn_module_stack":
            check_fqn(value, w)  # module paths reach FX codegen again in torch.export.unflatten
        elif key == "source_fn_stack":
            # "name,fn": an fn under torch/_operator/math is resolved by a getattr chain
            # (deserialize_meta_func); keep that chain to plain public-ish attribute names.
            _text(value, w)
            for item in value.split(";"):
                parts = item.partition(",")[2].split(".")
                if parts[0].startswith(("torch", "_operator", "math")) and not all(
                    SYMBOL_NAME_RE.fullmatch(p) and not p.startswith("__") for p in parts
                ):
                    raise Reject(f"{w}: source function {item!r} is not a dotted name")
        else:
            _text(value, w)


def _check_node(node: schema.Node, where: str) -> None:
    if getattr(node, "name", None) is not None:
        _ident(node.name, f"{where}.name", empty_ok=True)
    _check_target(node.target, f"{where}.target")
    _check_node_metadata(node.metadata, where)


def _check_graph(graph: schema.Graph, where: str) -> None:
    if getattr(graph, "custom_obj_values", None):
        raise Reject(f"{where}: custom objects (torchbind) are not allowed")
    for field in ("tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values"):
        for name in getattr(graph, field, {}):
            _ident(name, f"{where}.{field}")


def _check_argument(arg: schema.Argument, where: str) -> None:
    if arg.type == "as_custom_obj":
        raise Reject(f"{where}: custom object argument (torchbind) is not allowed")
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
        raise Reject(f"{where}: device {dev.type!r}:{dev.index!r} is not allowed")


def _check_module_call_signature(sig: schema.ModuleCallSignature, where: str) -> None:
    check_treespec(sig.in_spec, f"{where}.in_spec")
    check_treespec(sig.out_spec, f"{where}.out_spec")
    for name in sig.forward_arg_names or ():
        _ident(name, f"{where}.forward_arg_names")


def _check_graph_module(gm: schema.GraphModule, where: str) -> None:
    for key, value in gm.metadata.items():
        if key == "custom":
            try:
                json.loads(value)
            except (ValueError, RecursionError) as e:
                raise Reject(f"{where}.metadata['custom']: not valid JSON") from e
    for type_name, nt in getattr(gm, "treespec_namedtuple_fields", {}).items():
        for name in nt.field_names:
            _ident(name, f"{where}.treespec_namedtuple_fields[{type_name!r}]")


def _check_exported_program(ep: schema.ExportedProgram, where: str) -> None:
    for v in getattr(ep, "verifiers", []):
        if v not in _VERIFIERS:  # a custom dialect's verifier may accept any callable
            raise Reject(f"{where}.verifiers: verifier {v!r} is not allowed")
    for name in ep.range_constraints:  # keys ("s0", "2*s0") are only used for lookups
        _text(name, f"{where}.range_constraints")
    for i, code in enumerate(getattr(ep, "guards_code", [])):
        check_guard(code, f"{where}.guards_code[{i}]")


def _check_constant_input(spec: schema.InputToConstantInputSpec, where: str) -> None:
    _ident(spec.name, where)  # becomes a placeholder, i.e. a parameter of forward()
    if spec.value.type == "as_string":  # pasted into '...' quotes by _unlift guard codegen
        check_fqn(spec.value.as_string, where)
        if "'" in spec.value.as_string:
            raise Reject(f"{where}: quote in constant string input")


def _no_custom_obj(_: object, where: str) -> None:
    raise Reject(f"{where}: custom objects (torchbind) are not allowed")


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
        "SymExpr": lambda e, w: check_sym_expr(e.expr_str, w),
        "Device": _check_device,
        "InputToParameterSpec": lambda s, w: check_fqn(s.parameter_name, w),
        "InputToBufferSpec": lambda s, w: check_fqn(s.buffer_name, w),
        "InputToTensorConstantSpec": lambda s, w: check_fqn(s.tensor_constant_name, w),
        "InputToConstantInputSpec": _check_constant_input,
        "BufferMutationSpec": lambda s, w: check_fqn(s.buffer_name, w),
        "ParameterMutationSpec": lambda s, w: check_fqn(s.parameter_name, w),
        "GradientToParameterSpec": lambda s, w: check_fqn(s.parameter_name, w),
        "GradientToUserInputSpec": lambda s, w: _ident(s.user_input_name, w),
        "UserInputMutationSpec": lambda s, w: _ident(s.user_input_name, w),
        "ModuleCallEntry": lambda e, w: check_fqn(e.fqn, w),
        "ModuleCallSignature": _check_module_call_signature,
    }.items()
    if hasattr(schema, name)
}


def collect_targets(graph: schema.Graph, out: set[str]) -> None:
    for node in graph.nodes:
        out.add(node.target)
        for inp in node.inputs:
            if inp.arg.type == "as_graph":
                collect_targets(inp.arg.as_graph.graph, out)
            elif inp.arg.type == "as_operator":
                out.add(inp.arg.as_operator)
