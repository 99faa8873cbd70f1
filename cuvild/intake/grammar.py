"""The grammars of the strings in a torch.export archive that reach eval, exec or an import.

Symbolic-shape expressions go to `sympy.sympify` (eval), guards are pasted into a function
that `ExportedProgram.module()` execs, tree specs name types that `treespec_loads` imports.
Each is parsed here (by `ast`, never evaluated) and accepted only when it stays inside the
small grammar torch itself writes. Part of the safe loader (cuvild/intake/safe_load.py).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable

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
_MAX_INT = 2**64  # largest integer literal (in magnitude) in an expression or a guard
_MAX_EXPONENT = 64  # largest literal exponent (Pow, PowByNatural, FloatPow, shifts, **)
# Per-archive work bounds (sympy evaluates numbers eagerly: Integer(Float('1e300000')) and
# nested powers cost O(digits**2) at every load). Torch writes small literals, shallow
# expressions and symbols; these leave it a wide margin.
MAX_EXPR_DEPTH = 64  # nesting levels of one expression or guard (AST nodes, root to leaf)
MAX_LITERAL_DIGITS = 64  # significant digits of a Float('...') literal (a double needs 17)
MAX_FLOAT_EXPONENT = 400  # |decimal exponent| of a Float('...') literal (a double: 308)
MAX_FLOAT_PRECISION = 256  # Float(..., precision=N) bits (torch writes 53)
MAX_VALUE_BITS = 1 << 16  # estimated size of any sub-expression's value, in bits
_SYMBOL_BITS = 64  # a size symbol stands for an int below 2**63


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
    if hasattr(torch.utils._sympy.functions, n)  # noqa: SLF001 - torch's own sympy functions: no public home
)  # fmt: skip
_SYMPY_CALLS = _TORCH_SYMPY_FUNCS | {
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs",
    "floor", "ceiling", "Equality", "Unequality", "StrictLessThan", "StrictGreaterThan",
    "LessThan", "GreaterThan", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not",
    "Piecewise", "ExprCondPair",
}  # fmt: skip
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "int_oo", "true", "false", "pi", "E", "I"})
_POW_LIKE = frozenset({"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"})
# Calls whose second argument is an exponent-like count: only a small literal or a symbol.
_EXPONENT_ARG = _POW_LIKE | {"RoundDecimal"}
_BOOL_CALLS = frozenset({
    "Equality", "Unequality", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "IsNonOverlappingAndDenseIndicator",
})  # fmt: skip
_BIN_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.BitAnd, ast.BitOr)
_SYMBOLIC_NAME_RE = re.compile(r"[a-z]+[0-9]+")  # s0, u3: how str() prints size symbols


def _clip(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _const_int(node: ast.expr) -> int | None:
    """The value of an integer literal: 2, -2, Integer(2), Integer(-2), -Integer(2)."""
    sign = 1
    while True:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            sign = -sign if isinstance(node.op, ast.USub) else sign
            node = node.operand
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "Integer"
            and len(node.args) == 1
            and not node.keywords
        ):
            node = node.args[0]
        else:
            break
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return sign * node.value
    return None


def _float_bits(text: str, where: str) -> int:
    """Bits of the magnitude of a Float('...') literal, or of its reciprocal: what a later
    Integer(), division or power would have to hold. Digits and exponent are bounded first
    (mpmath parses '1e300000' in O(digits**2))."""
    mantissa, _, exp = text.lower().lstrip("+-").partition("e")
    digits = sum(c.isdigit() for c in mantissa)
    if digits > MAX_LITERAL_DIGITS:
        raise Reject(f"{where}: Float literal {_clip(text, 40)!r} has {digits} digits, over the "
                     f"limit of {MAX_LITERAL_DIGITS} digits")
    exp_digits = exp.lstrip("+-").lstrip("0")
    exponent = int(exp_digits) if exp_digits and len(exp_digits) <= 6 else 0
    if len(exp_digits) > 6 or exponent > MAX_FLOAT_EXPONENT:
        raise Reject(f"{where}: Float literal {_clip(text, 40)!r}: exponent over the limit of "
                     f"{MAX_FLOAT_EXPONENT} (the value would need ~{_clip(exp_digits, 12)} "
                     "decimal digits)")
    return (exponent + digits) * 10 // 3 + 1


def _literal_number(node: ast.expr) -> float | None:
    """The value of a plain numeric literal (2, -1, 2.5, Integer(2), Float('0.5'),
    Rational(1, 2)), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _literal_number(node.operand)
        return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.keywords:
        return _const_int(node)
    fn, args = node.func.id, node.args
    if fn == "Integer":
        return _const_int(node)
    if fn == "Float" and len(args) == 1:
        value = args[0].value if isinstance(args[0], ast.Constant) else None
        if isinstance(value, str) and len(value) <= 32 and _FLOAT_RE.fullmatch(value):
            return float(value)
        return _const_int(args[0])
    if fn == "Rational" and len(args) == 2:
        p, q = _const_int(args[0]), _const_int(args[1])
        if p is not None and q and abs(p) <= _MAX_INT and abs(q) <= _MAX_INT:
            return p / q
    return None


def _is_symbol(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return bool(_SYMBOLIC_NAME_RE.fullmatch(node.id))
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Symbol"


def _bounded(node: ast.expr, depth: int, value_bits: Callable[[ast.expr, int], int],
             where: str, what: str, shown: str) -> int:
    """One grammar's `value_bits` of ``node`` under the bounds every grammar shares: nesting
    depth and the size of any value (an upper bound, in bits)."""
    if depth > MAX_EXPR_DEPTH:
        raise Reject(f"{where}: {what} nested deeper than the limit of {MAX_EXPR_DEPTH} "
                     "levels")
    bits = value_bits(node, depth + 1)
    if bits > MAX_VALUE_BITS:
        raise Reject(f"{where}: {_clip(ast.unparse(node), 60)!r} may reach ~{bits} bits, "
                     f"over the limit of {MAX_VALUE_BITS} bits, in {shown}")
    return bits


def check_sym_expr(expr: str, where: str) -> None:  # noqa: C901, PLR0915 - the allow-list of sympy forms reads best whole
    """SymExpr.expr_str goes to sympy.sympify(), i.e. eval(). Accept only the grammar
    srepr()/str() produce for shape expressions: numbers, symbols and a fixed set of calls;
    and bound the work sympy does on it (it folds numbers eagerly): literal sizes, nesting
    depth, literal exponents, and an estimate of the size of every value."""
    if len(expr) > _MAX_EXPR_LEN:
        raise Reject(f"{where}: symbolic expression too long")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise Reject(f"{where}: unparsable symbolic expression") from e
    shown = _clip(expr)

    def exponent(node: ast.expr, fn: str) -> int:
        # How many times a power may multiply its base's size. A computed exponent
        # (Pow(3, Add(2000000, 0))) would escape the cap: only literals and symbols pass.
        if _is_symbol(node):
            return _MAX_EXPONENT  # sympy keeps s0**s1 symbolic
        value = _literal_number(node)
        if value is None or not abs(value) <= _MAX_EXPONENT:
            raise Reject(f"{where}: exponent {_clip(ast.unparse(node), 60)!r} of {fn} not "
                         f"allowed in {shown!r}: only a literal up to {_MAX_EXPONENT} or a "
                         "symbol")
        return max(1, math.ceil(abs(value)))

    def check(node: ast.expr, depth: int) -> int:
        return _bounded(node, depth, value_bits, where, "symbolic expression", repr(shown))

    def value_bits(node: ast.expr, depth: int) -> int:  # noqa: C901 - a branch per allowed node kind
        if isinstance(node, ast.Constant):
            v = node.value
            if type(v) not in (int, float, bool) or (type(v) is int and abs(v) > _MAX_INT):
                raise Reject(f"{where}: constant {_clip(repr(v), 40)} not allowed in "
                             f"{shown!r} (integer literals are limited to 2**64)")
            if type(v) is float:
                return abs(math.frexp(v)[1]) + 1 if math.isfinite(v) else 1
            return int(v).bit_length() + 1
        if isinstance(node, ast.Name):
            if node.id not in _SYMPY_NAMES and not _SYMBOLIC_NAME_RE.fullmatch(node.id):
                raise Reject(f"{where}: name {node.id!r} not allowed in {shown!r}")
            return _SYMBOL_BITS
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return check(node.operand, depth)
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BIN_OPS):
            return check(node.left, depth) + check(node.right, depth) + 1
        if isinstance(node, ast.Compare):
            for sub in (node.left, *node.comparators):
                check(sub, depth)
            return 1
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise Reject(f"{where}: {type(node).__name__} not allowed in {shown!r}")
        fn = node.func.id
        if fn not in _SYMPY_CALLS or any(isinstance(a, ast.Starred) for a in node.args):
            raise Reject(f"{where}: call {fn!r} not allowed in {shown!r}")
        for kw in node.keywords:
            precision = _const_int(kw.value) if fn == "Float" else None
            ok_kw = (fn == "Symbol" and type(getattr(kw.value, "value", None)) is bool) or (
                kw.arg == "precision" and precision is not None
                and 0 < precision <= MAX_FLOAT_PRECISION
            )
            if kw.arg is None or not ok_kw:
                raise Reject(f"{where}: keyword {kw.arg!r} not allowed in {shown!r} (Float "
                             f"precision is limited to {MAX_FLOAT_PRECISION} bits)")
        args = list(node.args)
        if fn in ("Symbol", "Float"):
            first = args.pop(0) if args else None
            text = first.value if isinstance(first, ast.Constant) else None
            pattern = SYMBOL_NAME_RE if fn == "Symbol" else _FLOAT_RE
            if fn == "Float" and args:  # Float(x, dps): unbounded decimal precision
                raise Reject(f"{where}: Float takes one literal in {shown!r}")
            if isinstance(text, str) and pattern.fullmatch(text):
                bits = _SYMBOL_BITS if fn == "Symbol" else _float_bits(text, where)
            elif fn == "Float" and first is not None and _const_int(first) is not None:
                bits = check(first, depth)
            else:
                raise Reject(f"{where}: bad {fn} literal in {shown!r}")
            for a in args:
                check(a, depth)
            return bits
        if fn in _EXPONENT_ARG:
            if len(args) != 2:
                raise Reject(f"{where}: {fn} takes two arguments in {shown!r}")
            base = check(args[0], depth)
            check(args[1], depth)
            times = exponent(args[1], fn)
            if fn in ("LShift", "RoundDecimal"):
                return base + 4 * times
            return base if fn == "RShift" else base * times
        if fn == "Integer" and len(args) != 1:
            raise Reject(f"{where}: Integer takes one argument in {shown!r}")
        sizes = [check(a, depth) for a in args]
        # sums, products, quotients, max/min of values: at most the sum of their sizes
        return 1 if fn in _BOOL_CALLS else sum(sizes) + len(sizes)

    try:
        check(tree.body, 0)
    except RecursionError as e:
        raise Reject(f"{where}: symbolic expression nested too deeply") from e


_GUARD_CALLS = frozenset({"max", "min", "abs", "int", "float"})
_GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt", "isnan", "isinf"})
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})


def check_guard(code: str, where: str) -> None:  # noqa: C901 - the allow-list of guard forms reads best whole
    """guards_code strings are pasted into a function body and exec()d by
    ExportedProgram.module() (torch/export/_unlift.py:_convert_guards_code_to_fn).
    Accept only comparisons/arithmetic over L['input'].size()[i]-style accessors."""
    if len(code) > _MAX_EXPR_LEN:
        raise Reject(f"{where}: guard too long")
    try:
        tree = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise Reject(f"{where}: unparsable guard") from e
    shown = _clip(code)

    def source(node: ast.expr, depth: int) -> int:  # L['x'] / L['x'][0] / L['x'].attr
        if depth > MAX_EXPR_DEPTH:
            raise Reject(f"{where}: guard nested deeper than the limit of {MAX_EXPR_DEPTH} "
                         "levels")
        if isinstance(node, ast.Name) and node.id == "L":
            return _SYMBOL_BITS  # an input's size, stride or int value
        if isinstance(node, ast.Subscript):
            key = node.slice
            if not isinstance(key, ast.Constant) or not (
                type(key.value) is int
                or (isinstance(key.value, str) and SYMBOL_NAME_RE.fullmatch(key.value))
            ):
                raise Reject(f"{where}: subscript not allowed in guard {shown!r}")
            return source(node.value, depth + 1)
        if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
            return source(node.value, depth + 1)
        raise Reject(f"{where}: expression not allowed in guard {shown!r}")

    def check(node: ast.expr, depth: int) -> int:
        return _bounded(node, depth, value_bits, where, "guard", f"guard {shown!r}")

    def value_bits(node: ast.expr, depth: int) -> int:  # noqa: C901 - a branch per allowed node kind
        if isinstance(node, ast.Constant):
            v = node.value
            if type(v) not in (int, float, bool) or (type(v) is int and abs(v) > _MAX_INT):
                raise Reject(f"{where}: constant not allowed in guard {shown!r} (integer "
                             "literals are limited to 2**64)")
            return int(abs(v)).bit_length() + 1 if type(v) is not float else 1
        if isinstance(node, ast.Name) and node.id == "inf":
            return 1  # the exec namespace defines inf; other names are not allowed
        if isinstance(node, ast.BoolOp):
            for v in node.values:
                check(v, depth)
            return 1
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            return check(node.operand, depth)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (*_BIN_OPS, ast.Pow)):
            left, right = check(node.left, depth), check(node.right, depth)
            if isinstance(node.op, ast.Pow):
                exponent = _const_int(node.right)
                if exponent is None or abs(exponent) > _MAX_EXPONENT:
                    raise Reject(f"{where}: exponent not allowed in guard {shown!r}: only an "
                                 f"integer literal up to {_MAX_EXPONENT}")
                return left * max(1, abs(exponent))
            return left + right + 1
        if isinstance(node, ast.Compare):
            for sub in (node.left, *node.comparators):
                check(sub, depth)
            return 1
        if isinstance(node, ast.Call) and not node.keywords:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in _GUARD_METHODS and not node.args:
                return source(f.value, depth)
            if (isinstance(f, ast.Name) and f.id in _GUARD_CALLS) or (
                isinstance(f, ast.Attribute)
                and f.attr in _GUARD_MATH
                and isinstance(f.value, ast.Name)
                and f.value.id == "math"
            ):
                return sum(check(a, depth) for a in node.args) + 1
            raise Reject(f"{where}: call not allowed in guard {shown!r}")
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call):
            if not isinstance(node.slice, ast.Constant) or type(node.slice.value) is not int:
                raise Reject(f"{where}: subscript not allowed in guard {shown!r}")
            return check(node.value, depth)  # L['x'].size()[0]
        if isinstance(node, (ast.Subscript, ast.Attribute, ast.Name)):
            return source(node, depth)  # L['n'], L['x'].attr
        raise Reject(f"{where}: {type(node).__name__} not allowed in guard {shown!r}")

    try:
        check(tree.body, 0)
    except RecursionError as e:
        raise Reject(f"{where}: guard nested too deeply") from e


_SAFE_DEFAULT_FACTORIES = frozenset({"list", "dict", "set", "int", "float", "str", "tuple"})


def check_treespec(spec: str, where: str) -> None:  # noqa: C901 - a branch per tree-spec form
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
