"""CostGraph: what placement needs to know of a model, as plain numbers.

One CostNode per call_function node of a torch.export graph, in topological order, with its
FLOPs, bytes, dtype and annotation; edges carry the bytes of the tensors they move. The class
itself never touches torch, so tests and benchmarks build graphs by hand;
`partitioner.fxgraph.build_costgraph` is the bridge from a real model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

ANNOTATION_KEY = "cuvil.partition"
PRECISIONS = ("fp32", "bf16", "fp16", "int8")


@dataclass(frozen=True)
class Annotation:
    """A user's wish for a node: a device kind ("npu") or id ("npu0"), a precision, strictness."""

    device: str | None = None
    precision: str | None = None  # a dtype, or "auto": within the error budget
    strict: bool = True
    max_error: float | None = None  # the budget of an "auto" region (None: the model's)

    @classmethod
    def from_meta(cls, data: Any) -> Annotation | None:
        if data is None:
            return None
        if isinstance(data, Annotation):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"annotation {ANNOTATION_KEY!r} must be a dict, got {data!r}")
        unknown = set(data) - {"device", "precision", "strict", "max_error"}
        if unknown:
            raise ValueError(f"annotation {data!r}: unknown keys {sorted(unknown)}")
        precision = data.get("precision")
        if precision is not None and precision not in (*PRECISIONS, "auto"):
            raise ValueError(f"annotation {data!r}: precision must be one of {PRECISIONS} "
                             "or 'auto'")
        max_error = data.get("max_error")
        if max_error is not None and (isinstance(max_error, bool) or not isinstance(
                max_error, (int, float)) or not 0 < max_error < 1):
            raise ValueError(f"annotation {data!r}: max_error must be in (0, 1)")
        if data.get("device") is None and precision is None:
            return None
        return cls(data.get("device"), precision, bool(data.get("strict", True)),
                   None if max_error is None else float(max_error))

    def describe(self) -> str:
        kind = "strict" if self.strict else "preference"
        return f"device={self.device!r} precision={self.precision!r} ({kind})"


@dataclass
class CostNode:
    """One compute node. `bytes_read` includes parameters; `out_bytes` is what a cut moves."""

    name: str
    target: str = ""  # the op, e.g. "aten.conv2d.default"
    op: str = ""  # short op name, e.g. "conv2d"
    category: str = "elementwise"  # see flops.category
    flops: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    out_bytes: int = 0
    dtype: str = "fp32"
    params: tuple[str, ...] = ()  # parameter/buffer/constant placeholders it reads
    inputs: tuple[str, ...] = ()  # user-input placeholders it reads
    output_bytes: int = 0  # bytes of its value that are graph outputs
    output_names: tuple[str, ...] = ()  # which graph values those are (its own, or getitems)
    annotation: Annotation | None = None
    aliases: tuple[str, ...] = ()  # graph nodes folded into this one (getitem of a tuple result)
    updates_state: bool = False  # it updates a buffer in place (a language model's cache)
    fx_node: Any = field(default=None, repr=False, compare=False)

    @property
    def is_output(self) -> bool:
        return self.output_bytes > 0


@dataclass(frozen=True)
class Edge:
    """A dependency src -> dst (node indices) moving `bytes`; `tensors` name the values moved."""

    src: int
    dst: int
    bytes: int
    tensors: tuple[str, ...] = ()


class CostGraph:
    """Nodes in topological order, edges between them, and the sizes of graph inputs and params."""

    def __init__(
        self,
        nodes: list[CostNode],
        edges: Iterable[Edge | tuple[int, int, int]],
        param_bytes: dict[str, int] | None = None,
        input_bytes: dict[str, int] | None = None,
    ) -> None:
        self.nodes = nodes
        self.edges = [e if isinstance(e, Edge) else Edge(*e) for e in edges]
        self.param_bytes = dict(param_bytes or {})
        self.input_bytes = dict(input_bytes or {})
        self.index = {node.name: i for i, node in enumerate(nodes)}
        if len(self.index) != len(nodes):
            raise ValueError("CostGraph: node names must be unique")
        self.preds: list[list[int]] = [[] for _ in nodes]
        self.succs: list[list[int]] = [[] for _ in nodes]
        self.edge_bytes: dict[tuple[int, int], int] = {}
        self.edge_at: dict[tuple[int, int], Edge] = {}
        for e in self.edges:
            if not 0 <= e.src < e.dst < len(nodes):
                raise ValueError(
                    f"CostGraph: edge {e.src}->{e.dst} must go forward between 0 and "
                    f"{len(nodes) - 1}: nodes must be in topological order"
                )
            if (e.src, e.dst) in self.edge_bytes:
                raise ValueError(f"CostGraph: duplicate edge {e.src}->{e.dst}")
            self.edge_bytes[(e.src, e.dst)] = e.bytes
            self.edge_at[(e.src, e.dst)] = e
            self.preds[e.dst].append(e.src)
            self.succs[e.src].append(e.dst)
        for node in nodes:
            for name in node.params:
                self.param_bytes.setdefault(name, 0)
            for name in node.inputs:
                self.input_bytes.setdefault(name, 0)

    def __len__(self) -> int:
        return len(self.nodes)

    def lifetimes(self) -> list[tuple[int, int]]:
        """(producer index, last consumer index) per node; a graph output lives to len(graph)."""
        spans = []
        for i, node in enumerate(self.nodes):
            last = max(self.succs[i], default=i)
            spans.append((i, len(self.nodes) if node.is_output else last))
        return spans

    def describe(self, indices: Sequence[int], limit: int = 3) -> str:
        """A few node names for messages: "relu, add, mul, ... 7 more"."""
        shown = ", ".join(self.nodes[v].name for v in indices[:limit])
        return shown + (f", ... {len(indices) - limit} more" if len(indices) > limit else "")

    def total_flops(self) -> float:
        return sum(node.flops for node in self.nodes)

