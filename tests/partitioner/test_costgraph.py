"""CostGraph from torch.export graphs: FLOPs against hand formulas, bytes, lifetimes, metadata."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.costgraph import ANNOTATION_KEY, Annotation, CostGraph, CostNode, Edge
from partitioner.fxgraph import build_costgraph as costgraph

ROOT = Path(__file__).resolve().parents[2]


def export(module: nn.Module, *inputs: torch.Tensor, dynamic=None) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module.eval(), inputs, dynamic_shapes=dynamic)


def only(graph: CostGraph, op: str) -> CostNode:
    found = [n for n in graph.nodes if n.op == op]
    assert len(found) == 1, [n.op for n in graph.nodes]
    return found[0]


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_flops(bias: bool) -> None:
    b, s, cin, cout = 4, 7, 32, 48
    graph = costgraph(export(nn.Linear(cin, cout, bias=bias), torch.randn(b, s, cin)))
    node = only(graph, "linear")
    assert node.flops == 2 * b * s * cin * cout + (b * s * cout if bias else 0)
    assert node.category == "matmul"
    weights = cout * cin * 4 + (cout * 4 if bias else 0)
    assert sum(graph.param_bytes.values()) == weights
    assert node.bytes_read == b * s * cin * 4 + weights
    assert node.bytes_written == node.out_bytes == b * s * cout * 4


@pytest.mark.parametrize(
    "conv, x",
    [
        (nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.randn(2, 8, 15, 15)),
        (nn.Conv2d(8, 16, (3, 5), padding=(1, 2), groups=4, bias=False), torch.randn(1, 8, 9, 9)),
        (nn.Conv1d(4, 6, 5), torch.randn(3, 4, 20)),
        (nn.Conv3d(2, 4, 3, padding=1), torch.randn(1, 2, 6, 6, 6)),
    ],
)
def test_conv_flops(conv: nn.Module, x: torch.Tensor) -> None:
    node = only(costgraph(export(conv, x)), f"conv{x.dim() - 2}d")
    out = conv(x)
    per_output = 2 * (conv.in_channels // conv.groups) * torch.tensor(conv.kernel_size).prod()
    expected = out.numel() * int(per_output) + (out.numel() if conv.bias is not None else 0)
    assert node.flops == expected
    assert node.out_bytes == out.numel() * 4


def test_conv_transpose_flops() -> None:
    conv = nn.ConvTranspose2d(8, 4, 3, stride=2)
    x = torch.randn(1, 8, 5, 5)
    node = only(costgraph(export(conv, x)), "conv_transpose2d")
    out = conv(x)
    # each input element is multiplied into (out/groups) * k * k outputs
    assert node.flops == 2 * x.numel() * 4 * 9 + out.numel()


def test_matmul_family_flops() -> None:
    a, b = torch.randn(3, 5, 7), torch.randn(3, 7, 2)
    assert only(costgraph(export(Fn(torch.matmul), a, b)), "matmul").flops == 2 * 3 * 5 * 7 * 2
    assert only(costgraph(export(Fn(torch.bmm), a, b)), "bmm").flops == 2 * 3 * 5 * 7 * 2
    m1, m2, bias = torch.randn(6, 4), torch.randn(4, 9), torch.randn(9)
    assert only(costgraph(export(Fn(torch.mm), m1, m2)), "mm").flops == 2 * 6 * 4 * 9
    addmm = only(costgraph(export(Fn(torch.addmm), bias, m1, m2)), "addmm")
    assert addmm.flops == 2 * 6 * 4 * 9 + 6 * 9


def test_attention_flops() -> None:
    q = torch.randn(2, 4, 16, 8)
    k = torch.randn(2, 4, 24, 8)
    v = torch.randn(2, 4, 24, 8)
    sdpa = nn.functional.scaled_dot_product_attention
    node = only(costgraph(export(Fn(sdpa), q, k, v)), "scaled_dot_product_attention")
    scores = 2 * 4 * 16 * 24
    assert node.flops == 2 * scores * 8 + 5 * scores + 2 * scores * 8
    assert node.category == "attention"


def test_other_categories() -> None:
    def body(x):
        y = nn.functional.layer_norm(x, (x.shape[-1],))
        y = torch.softmax(y, -1) + torch.relu(x)
        y = nn.functional.max_pool2d(y, 2)
        return y.permute(0, 1, 3, 2).sum()

    graph = costgraph(export(Fn(body), torch.randn(2, 3, 8, 8)))
    n = 2 * 3 * 8 * 8
    assert only(graph, "layer_norm").flops == 8 * n
    assert only(graph, "softmax").flops == 5 * n
    assert only(graph, "relu").flops == n
    assert only(graph, "max_pool2d").flops == (n // 4) * 4
    assert only(graph, "permute").flops == 0 and only(graph, "permute").bytes_written == 0
    assert only(graph, "sum").category == "reduction"


def test_decompositions_keep_the_matmul_and_conv_flops() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    ep = export(model, torch.randn(2, 3, 8, 8))

    def heavy(graph: CostGraph) -> float:
        return sum(n.flops for n in graph.nodes if n.category in ("conv", "matmul"))

    assert heavy(costgraph(ep)) == heavy(costgraph(ep.run_decompositions()))


def test_symbolic_batch_costs_the_example_size() -> None:
    batch = torch.export.Dim("batch", min=1, max=1024)
    ep = export(nn.Linear(16, 32), torch.randn(5, 16), dynamic=({0: batch},))
    node = only(costgraph(ep), "linear")
    assert node.flops == 2 * 5 * 16 * 32 + 5 * 32
    assert node.out_bytes == 5 * 32 * 4


class TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x)
        b = torch.sigmoid(x)
        return a @ w + b


def test_edges_lifetimes_inputs_outputs() -> None:
    graph = costgraph(export(TwoInputs(), torch.randn(4, 4), torch.randn(4, 4)))
    names = [n.name for n in graph.nodes]
    assert names == ["relu", "sigmoid", "matmul", "add"]
    assert graph.input_bytes == {"x": 64, "w": 64}
    assert graph.nodes[0].inputs == ("x",) and set(graph.nodes[2].inputs) == {"w"}
    assert {(e.src, e.dst, e.bytes) for e in graph.edges} == {(0, 2, 64), (1, 3, 64), (2, 3, 64)}
    assert graph.lifetimes() == [(0, 2), (1, 3), (2, 3), (3, 4)]
    assert graph.nodes[3].output_bytes == 64 and not graph.nodes[2].is_output


def test_tuple_results_fold_their_getitems() -> None:
    ep = export(nn.Sequential(nn.LayerNorm(8), nn.ReLU()), torch.randn(2, 8)).run_decompositions()
    graph = costgraph(ep)
    ln = only(graph, "native_layer_norm")
    assert ln.aliases and all(name.startswith("getitem") for name in ln.aliases)
    relu = graph.index["relu"]
    edge = graph.edge_at[(graph.index[ln.name], relu)]
    assert edge.bytes == 2 * 8 * 4 and edge.tensors[0].startswith("getitem")
    compute = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    listed = [name for node in graph.nodes for name in (node.name, *node.aliases)]
    assert sorted(listed) == sorted(compute)


def test_annotation_is_read_from_node_meta() -> None:
    ep = export(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4))
    for node in ep.graph.nodes:
        if node.name == "relu":
            node.meta.setdefault("custom", {})[ANNOTATION_KEY] = {
                "device": "npu", "precision": "fp16", "strict": False,
            }  # fmt: skip
    graph = costgraph(ep)
    assert graph.nodes[graph.index["relu"]].annotation == Annotation("npu", "fp16", False)
    assert graph.nodes[graph.index["linear"]].annotation is None


def test_bad_annotation_is_named() -> None:
    with pytest.raises(ValueError, match="precision"):
        Annotation.from_meta({"device": "gpu", "precision": "fp8"})
    with pytest.raises(ValueError, match="unknown keys"):
        Annotation.from_meta({"device": "gpu", "where": 1})


def test_costgraph_needs_topological_order() -> None:
    nodes = [CostNode("a"), CostNode("b")]
    with pytest.raises(ValueError, match="topological"):
        CostGraph(nodes, [Edge(1, 0, 4)])
    with pytest.raises(ValueError, match="unique"):
        CostGraph([CostNode("a"), CostNode("a")], [])


def test_planning_imports_no_torch() -> None:
    code = (
        "import sys; import partitioner.plan, partitioner.synthetic, partitioner.profile;"
        "from partitioner.plan import plan_model; from partitioner.synthetic import *;"
        "plan_model(random_dag(20, 0), sample_devices());"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
