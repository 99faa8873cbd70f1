"""Model intake: turn an uploaded archive into a registry summary, never running its code.

The archive is opened by cuvild/intake/safe_load.py (allow-listed entries, no pickle, built-in op
namespaces only); anything it refuses becomes INVALID_ARGUMENT naming the entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _spec(name: str, value: Any) -> dict[str, Any]:
    shape = [d if isinstance(d, int) else -1 for d in getattr(value, "shape", [])]
    dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
    return {"name": name, "dtype": dtype, "shape": shape}


def summarize(ep: Any) -> dict[str, Any]:
    """Node counts and the user-visible inputs/outputs (-1 for dynamic dims) of a program."""
    from partitioner.annotate import annotations

    nodes = {n.name: n for n in ep.graph.nodes}
    sig = ep.graph_signature
    inputs = [_spec(name, nodes[name].meta.get("val")) for name in sig.user_inputs]
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    outputs = []
    for i, arg in enumerate(output_node.args[0][: len(sig.user_outputs)]):
        value = arg.meta.get("val") if hasattr(arg, "meta") else None
        outputs.append(_spec(f"output{i}", value))
    return {
        "num_nodes": sum(1 for n in ep.graph.nodes if n.op == "call_function"),
        "annotated_nodes": len(annotations(ep)),
        "inputs": inputs,
        "outputs": outputs,
    }


def inspect_archive(path: Path, max_bytes: int) -> dict[str, Any]:
    """Load the archive safely and summarise it. Raises ValueError (UnsafeArchive) if refused."""
    from cuvild.intake.safe_load import load_exported_program

    return summarize(load_exported_program(path, max_bytes=max_bytes))
