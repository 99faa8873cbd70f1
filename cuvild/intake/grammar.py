"""The grammars of the strings in a torch.export archive that reach eval, exec or an import.

Symbolic-shape expressions go to `sympy.sympify` (eval), guards are pasted into a function
that `ExportedProgram.module()` execs, tree specs name types that `treespec_loads` imports.
Each is parsed here (by `ast`, never evaluated) and accepted only when it stays inside the
small grammar torch itself writes. Part of the safe loader (cuvild/intake/safe_load.py).
"""

from __future__ import annotations

import ast
import json
import re

import torch
import torch.utils._pytree as pytree
import torch.utils._sympy.functions


class Reject(Exception):
    """A check failed; the safe loader turns it into UnsafeArchive naming the entry."""


SYMBOL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BAD_FQN_CHARS = re.compile(r"[\"\\\x00-\x1f\x7f]")  # breaks FX's getattr(x, "...") codegen
BAD_TEXT_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # \r etc. end a source comment
_FLOAT_RE = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_MAX_EXPR_LEN = 10_000
_MAX_INT = 2**64
_MAX_EXPONENT = 64


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


def check_sym_expr(expr: str, where: str) -> None:
    """SymExpr.expr_str goes to sympy.sympify(), i.e. eval(). Accept only the grammar
    srepr()/str() produce for shape expressions: numbers, symbols and a fixed set of calls."""
    if len(expr) > _MAX_EXPR_LEN:
        raise Reject(f"{where}: symbolic expression too long")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise Reject(f"{where}: unparsable symbolic expression") from e

    def check(node: ast.expr) -> None:
        if isinstance(node, ast.Constant):
            v = node.value
            if type(v) not in (int, float, bool) or (type(v) is int and abs(v) > _MAX_INT):
                raise Reject(f"{where}: constant {v!r} not allowed in {expr!r}")
        elif isinstance(node, ast.Name):
            if node.id not in _SYMPY_NAMES and not re.fullmatch(r"[a-z]+[0-9]+", node.id):
                raise Reject(f"{where}: name {node.id!r} not allowed in {expr!r}")
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
                raise Reject(f"{where}: call {fn!r} not allowed in {expr!r}")
            args = list(node.args)
            if fn in ("Symbol", "Float"):
                pattern = SYMBOL_NAME_RE if fn == "Symbol" else _FLOAT_RE
                first = args.pop(0) if args else None
                if not (
                    isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                    and pattern.fullmatch(first.value)
                ) and not (fn == "Float" and first is not None and _const_int(first) is not None):
                    raise Reject(f"{where}: bad {fn} literal in {expr!r}")
            for kw in node.keywords:
                ok_kw = (fn == "Symbol" and type(getattr(kw.value, "value", None)) is bool) or (
                    fn == "Float" and kw.arg == "precision" and _const_int(kw.value) is not None
                )
                if kw.arg is None or not ok_kw:
                    raise Reject(f"{where}: keyword {kw.arg!r} not allowed in {expr!r}")
            if fn in _POW_LIKE and len(args) == 2:
                exponent = _const_int(args[1])
                if exponent is not None and abs(exponent) > _MAX_EXPONENT:
                    raise Reject(f"{where}: exponent too large in {expr!r}")
            for a in args:
                check(a)
        else:
            raise Reject(f"{where}: {type(node).__name__} not allowed in {expr!r}")

    try:
        check(tree.body)
    except RecursionError as e:
        raise Reject(f"{where}: symbolic expression nested too deeply") from e


_GUARD_CALLS = frozenset({"max", "min", "abs", "int", "float"})
_GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt", "isnan", "isinf"})
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})


def check_guard(code: str, where: str) -> None:
    """guards_code strings are pasted into a function body and exec()d by
    ExportedProgram.module() (torch/export/_unlift.py:_convert_guards_code_to_fn).
    Accept only comparisons/arithmetic over L['input'].size()[i]-style accessors."""
    if len(code) > _MAX_EXPR_LEN:
        raise Reject(f"{where}: guard too long")
    try:
        tree = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise Reject(f"{where}: unparsable guard") from e

    def source(node: ast.expr) -> None:  # L['x'] / L['x'][0] / L['x'].attr
        if isinstance(node, ast.Name) and node.id == "L":
            return
        if isinstance(node, ast.Subscript):
            key = node.slice
            if not isinstance(key, ast.Constant) or not (
                type(key.value) is int
                or (isinstance(key.value, str) and SYMBOL_NAME_RE.fullmatch(key.value))
            ):
                raise Reject(f"{where}: subscript not allowed in guard {code!r}")
            return source(node.value)
        if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
            return source(node.value)
        raise Reject(f"{where}: expression not allowed in guard {code!r}")

    def check(node: ast.expr) -> None:
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float, bool):
                raise Reject(f"{where}: constant not allowed in guard {code!r}")
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
                    raise Reject(f"{where}: exponent not allowed in guard {code!r}")
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
                raise Reject(f"{where}: call not allowed in guard {code!r}")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call):
            if not isinstance(node.slice, ast.Constant) or type(node.slice.value) is not int:
                raise Reject(f"{where}: subscript not allowed in guard {code!r}")
            check(node.value)  # L['x'].size()[0]
        elif isinstance(node, (ast.Subscript, ast.Attribute, ast.Name)):
            source(node)  # L['n'], L['x'].attr
        else:
            raise Reject(f"{where}: {type(node).__name__} not allowed in guard {code!r}")

    try:
        check(tree.body)
    except RecursionError as e:
        raise Reject(f"{where}: guard nested too deeply") from e


_SAFE_DEFAULT_FACTORIES = frozenset({"list", "dict", "set", "int", "float", "str", "tuple"})


def check_treespec(spec: str, where: str) -> None:
    """treespec_loads() imports any module named by an "__enum__" context
    (pytree.enum_object_hook) or a defaultdict's default_factory_module."""
    try:
        protocol, node = json.loads(spec)
    except (ValueError, TypeError, RecursionError) as e:
        raise Reject(f"{where}: malformed tree spec") from e
    if protocol != 1:
        raise Reject(f"{where}: tree spec protocol {protocol!r} not supported")

    def check_context(obj: object) -> None:
        if isinstance(obj, dict):
            if "__enum__" in obj:
                raise Reject(f"{where}: enum (module import) in tree spec context")
            for k, v in obj.items():
                check_context(k)
                check_context(v)
        elif isinstance(obj, list):
            for v in obj:
                check_context(v)
        elif isinstance(obj, str) and (BAD_FQN_CHARS.search(obj) or "'" in obj):
            # dict keys are pasted as '<key>' into forward() by FX's _PyTreeCodeGen
            raise Reject(f"{where}: tree spec key {obj!r} has forbidden characters")

    def visit(n: object) -> None:
        if not isinstance(n, dict) or set(n) != {"type", "context", "children_spec"}:
            raise Reject(f"{where}: malformed tree spec node")
        typ, ctx, children = n["type"], n["context"], n["children_spec"]
        if not isinstance(children, list):
            raise Reject(f"{where}: malformed tree spec node")
        if typ is None:
            if ctx is not None or children:
                raise Reject(f"{where}: malformed tree spec leaf")
            return
        if typ not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE or not isinstance(ctx, str):
            raise Reject(f"{where}: tree spec type {typ!r} is not registered")
        try:
            context = json.loads(ctx)
        except (ValueError, RecursionError):
            context = None  # namedtuple contexts are a bare registry name
        if typ == "collections.defaultdict" and not (
            isinstance(context, dict)
            and context.get("default_factory_module") == "builtins"
            and context.get("default_factory_name") in _SAFE_DEFAULT_FACTORIES
        ):
            raise Reject(f"{where}: defaultdict factory would import a module")
        check_context(context)
        for child in children:
            visit(child)

    try:
        visit(node)
    except RecursionError as e:
        raise Reject(f"{where}: tree spec nested too deeply") from e
