"""The layout holds: imports run one way between the rooms of the code, no module is in an
import circle, and no source file outgrows a sitting.

Every import statement counts, wherever it stands: at the top, inside a function, under
`if TYPE_CHECKING:`. A lazy import is still a dependency, and a circle through one is still a
circle for the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cuvild", "partitioner", "runtimes", "protos")
MAX_LINES = 600

# Which rooms a room may import, besides itself. A room is a package, or for the top of
# cuvild/ (its __init__ and config) "cuvild", and for the entry point "cuvild.__main__".
# The rooms stand in floors (FLOORS, top first): a room imports only rooms below its own,
# never one above or beside it, with no exception (test_rooms_stand_in_floors). ALLOWED
# narrows that further: a name with a dot after a room (cuvild.intake.safe_load) opens only
# that module to a room that may not import the whole of it.
FLOORS = [
    ["cuvild.__main__"],
    ["cuvild.serve"],  # the daemon's listeners and its start
    ["cuvild.engine"],  # composition: the workers, the runner and the builder, wired
    ["cuvild.load"],  # the control plane: the Builder, loads, buckets, load records
    ["cuvild.run"],  # the data plane: the Runner, a request's parts, bells, batching
    ["cuvild.workers"],  # the device workers and the daemon's end of them
    ["cuvild.client"],  # cuvilctl and the Python client (beside the daemon, never in it)
    ["cuvild.core"],  # the vocabulary every plane shares
    ["cuvild.intake"],  # untrusted archives in, registered models out
    ["cuvild"],  # its config and `cuvild.partition` / `cuvild.export`
    ["runtimes"],
    ["partitioner", "protos"],
]
ALLOWED: dict[str, set[str]] = {
    "cuvild.__main__": {"cuvild.serve"},
    # `from cuvild import partition, export`, lazily; config checks runtime names (no torch)
    "cuvild": {"partitioner", "runtimes.registry"},
    "cuvild.serve": {"cuvild", "cuvild.engine", "cuvild.load", "cuvild.run", "cuvild.workers",
                     "cuvild.core", "cuvild.intake", "partitioner", "runtimes", "protos"},
    "cuvild.engine": {"cuvild.load", "cuvild.run", "cuvild.workers", "cuvild.core",
                      "partitioner"},
    "cuvild.load": {"cuvild.run", "cuvild.workers", "cuvild.core", "cuvild.intake",
                    "partitioner", "runtimes", "protos.orders"},
    "cuvild.run": {"cuvild.workers", "cuvild.core", "protos.fastpath", "protos.shared",
                   "protos.orders"},
    "cuvild.workers": {"cuvild.core", "cuvild.intake", "partitioner", "runtimes", "protos"},
    # cuvilctl plans a local .pt2 offline: it opens it with the safe loader
    # and rebuilds a model's output container from its spec (cuvild/client/trees.py)
    "cuvild.client": {"cuvild", "cuvild.core.arena", "cuvild.core.dtypes", "cuvild.core.spin",
                      "cuvild.intake.safe_load", "cuvild.intake.trees",
                      "cuvild.intake.grammar", "partitioner", "protos"},
    "cuvild.core": {"partitioner", "protos.orders"},
    # (runtimes.cache: the key that signs the compile cache signs the inspection's verdicts)
    "cuvild.intake": {"partitioner", "runtimes.base", "runtimes.cache"},
    "runtimes": {"partitioner"},
    "partitioner": set(),
    "protos": set(),
}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports (for `from a import b`, a.b when that is a
    module, else a)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] in PACKAGES and t in known)
    found.discard(name)
    return found


def room(module: str) -> str:
    if module == "cuvild.__main__":
        return module
    parts = module.split(".")
    if parts[0] == "cuvild":
        return "cuvild." + parts[1] if len(parts) > 1 and parts[1] in {
            "serve", "engine", "load", "run", "workers", "core", "intake", "client"} else "cuvild"
    return parts[0]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, name, set(found)) for name, path in found.items()}


def opens(allowed: set[str], target: str) -> bool:
    return any(target == a or target.startswith(a + ".") for a in allowed)


def test_imports_run_one_way_between_rooms() -> None:
    wrong = []
    for module, targets in sorted(graph().items()):
        mine = room(module)
        assert mine in ALLOWED, f"{module}: room {mine} is not in ALLOWED"
        for target in sorted(targets):
            theirs = room(target)
            if theirs != mine and not opens(ALLOWED[mine], target):
                wrong.append(f"{module} imports {target} ({mine} -> {theirs})")
    assert not wrong, "imports against the direction of the rooms:\n" + "\n".join(wrong)


def test_rooms_stand_in_floors() -> None:
    """Folder level: every import runs down the floors, none up or sideways; so no two
    rooms import each other, whatever their modules do."""
    floor = {r: i for i, rooms in enumerate(FLOORS) for r in rooms}
    assert set(floor) == set(ALLOWED), "FLOORS and ALLOWED name other rooms"
    wrong = sorted({f"{room(m)} -> {room(t)} ({m} imports {t})"
                    for m, targets in graph().items() for t in targets
                    if room(t) != room(m) and floor[room(t)] <= floor[room(m)]})
    assert not wrong, "imports that do not run down the floors:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:  # noqa: C901 - the import walk and its report
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other, directly or around a circle:\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_the_walk_sees_what_it_checks() -> None:
    """Guard against a walk that passes because it finds nothing."""
    edges = graph()
    assert "protos.orders" in edges["cuvild.workers.worker"]
    assert "cuvild.intake.safe_load" in edges["cuvild.load.prepare"]  # a function-level one
    assert "cuvild.load.models" in edges["cuvild.serve.control"]  # under TYPE_CHECKING
    assert room("cuvild.config") == "cuvild" and room("cuvild.serve.oip") == "cuvild.serve"


def test_no_source_file_is_over_600_lines() -> None:
    long = []
    for folder in (*PACKAGES, "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            n = len(path.read_text().splitlines())
            if n > MAX_LINES:
                long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)
