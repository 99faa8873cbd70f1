"""Input and output tree specs kept as data: the containers a model takes and returns.

A `torch.export` archive names the container types of its inputs and outputs in its tree
specs ("transformers.modeling_outputs.BaseModelOutput", a user's dataclass, a namedtuple).
torch's deserializer resolves each name in the pytree registry of the process that loads it,
so a daemon without the model's library refuses the archive, and one that imported a library
for it would run that library's code. The daemon does neither: `plain_spec` rewrites every
container that is not a builtin one into a dict of the same fields, in order, so the
program it deserializes returns the same leaves under the same names; the original spec
stays as a string of JSON (ModelRecord.out_spec), read only by `leaf_names` and, in the
client, to rebuild the model's own container (cuvild/client/trees.py).

A type name is never imported or resolved here. One that does not look like a class (a
dotted path of identifiers ending in a capitalised name, no dunder part but a leading
`__main__`) is refused all the same: no model returns `os.system`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cuvild.intake.grammar import Reject

# Containers torch's pytree registers itself (kept as they are; grammar.check_treespec
# still checks their contexts).
PLAIN_TYPES = frozenset({
    "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict",
    "collections.defaultdict", "collections.deque", "torch.fx.immutable_collections."
    "immutable_list", "torch.fx.immutable_collections.immutable_dict",
})
_SEQUENCES = frozenset({"builtins.tuple", "builtins.list", "collections.deque",
                        "torch.fx.immutable_collections.immutable_list"})
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_CLASS_NAME_RE = re.compile(rf"{_IDENT}(?:\.{_IDENT})*\.[A-Z]\w*")


def _nodes(spec: str, where: str) -> Any:
    try:
        protocol, root = json.loads(spec)
    except (ValueError, TypeError, RecursionError) as e:
        raise Reject(f"{where}: malformed tree spec") from e
    if protocol != 1:
        raise Reject(f"{where}: tree spec protocol {protocol!r} not supported")
    return root


def _fields(node: dict[str, Any], namedtuples: dict[str, list[str]], where: str) -> list[Any]:
    """The field names of a container node, in the order of its children."""
    typ, children = node.get("type"), node.get("children_spec")
    if not isinstance(children, list):
        raise Reject(f"{where}: malformed tree spec node")
    if typ == "collections.namedtuple":
        fields = namedtuples.get(node.get("context"))  # type: ignore[arg-type]
        if fields is None:
            raise Reject(f"{where}: namedtuple {node.get('context')!r} has no field names in "
                         "the archive")
    else:
        if not isinstance(typ, str) or not _CLASS_NAME_RE.fullmatch(typ) or any(
                part.startswith("__") for part in typ.removeprefix("__main__.").split(".")):
            raise Reject(f"{where}: tree spec type {typ!r} does not name a container class")
        try:
            context = json.loads(node.get("context"))  # type: ignore[arg-type]
        except (ValueError, TypeError, RecursionError):
            context = None
        # A ModelOutput's context is its keys; a registered dataclass's is
        # [fields with values, fields that are None].
        if isinstance(context, list) and len(context) == 2 and all(
                isinstance(c, list) for c in context) and len(context[0]) == len(children):
            context = context[0]
        fields = context
    if not (isinstance(fields, list) and len(fields) == len(children)
            and all(isinstance(f, str) for f in fields) and len(set(fields)) == len(fields)):
        raise Reject(f"{where}: tree spec type {typ!r}: its context does not list one field "
                     "name per child (cuvild takes dataclass-like outputs such as "
                     "ModelOutput, namedtuples, dicts, lists and tuples)")
    return fields


def plain_spec(spec: str, namedtuples: dict[str, list[str]], where: str) -> str:
    """`spec` with every non-builtin container rewritten to a dict of its fields (the same
    leaves, in the same order). Reject if a container's fields cannot be read."""

    def visit(node: Any) -> Any:
        if not isinstance(node, dict) or node.get("type") is None:
            return node  # leaves, and what check_treespec refuses as malformed
        children = [visit(c) for c in node.get("children_spec") or []]
        if node["type"] in PLAIN_TYPES:
            return {**node, "children_spec": children}
        fields = _fields(node, namedtuples, where)
        return {"type": "builtins.dict", "context": json.dumps(fields),
                "children_spec": children}

    try:
        return json.dumps([1, visit(_nodes(spec, where))])
    except RecursionError as e:
        raise Reject(f"{where}: tree spec nested too deeply") from e


def leaf_names(spec: str, namedtuples: dict[str, list[str]] | None = None) -> list[str]:
    """The name of every leaf of an output spec, in order: its field path joined by "."
    (`logits`, `hidden_states.0`); positions of a top-level tuple or list, or a lone
    tensor, are `output0`, `output1`, ... (`output1.mask` below them)."""
    namedtuples = namedtuples or {}
    names: list[str] = []

    def visit(node: Any, path: list[str]) -> None:
        typ = node.get("type")
        children = node.get("children_spec") or []
        if typ is None:
            names.append(".".join(path) if path else "output0")
            return
        if typ in _SEQUENCES:
            keys = [f"output{i}" if not path else str(i) for i in range(len(children))]
        elif typ in PLAIN_TYPES:
            context = json.loads(node["context"])
            if typ == "collections.defaultdict":
                context = context["dict_context"]
            keys = [str(k) for k in context]
        else:
            keys = _fields(node, namedtuples, "tree spec")
        for key, child in zip(keys, children, strict=True):
            visit(child, [*path, key])

    visit(_nodes(spec, "tree spec"), [])
    return names


def plain_program(program: Any) -> dict[str, str]:
    """Rewrite the tree specs of every module call signature of a parsed (not yet checked)
    `schema.ExportedProgram` with `plain_spec`; return the root call's original specs
    ({"in_spec": ..., "out_spec": ...}, {} if it has none). What is not of the schema's
    types is left for the schema walk to refuse."""
    gm = getattr(program, "graph_module", None)
    named = getattr(gm, "treespec_namedtuple_fields", None)
    namedtuples = {k: list(getattr(v, "field_names", None) or [])
                   for k, v in named.items()} if isinstance(named, dict) else {}
    originals: dict[str, str] = {}
    entries = getattr(gm, "module_call_graph", None)
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        sig = getattr(entry, "signature", None)
        for key in ("in_spec", "out_spec"):
            spec = getattr(sig, key, None)
            if not isinstance(spec, str):
                continue
            if getattr(entry, "fqn", None) == "" and key not in originals:
                originals[key] = spec
            setattr(sig, key, plain_spec(
                spec, namedtuples,
                f"ExportedProgram.graph_module.module_call_graph[{i}].signature.{key}"))
    return originals
