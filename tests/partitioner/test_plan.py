"""Plans of reference models on the shipped machine shapes; Plan I/O, reports and profiles."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import refmodels
import torch
import yaml

from partitioner import plan_model
from partitioner.cost import CostModel, PlacementError
from partitioner.costgraph import ANNOTATION_KEY, CostGraph
from partitioner.fragments import fragments
from partitioner.fxgraph import build_costgraph
from partitioner.plan import Plan, build_plan
from partitioner.profile import load_profiles, load_shipped, shipped_profiles
from partitioner.report import explain, to_dot
from partitioner.schedule import objective, simulate
from partitioner.synthetic import random_dag, sample_devices

PROFILES = ["xeon-amx-h100", "laptop-soc", "ci-host"]
MODELS = list(refmodels.BUILDERS)


def part_order_is_topological(plan: Plan, graph) -> bool:
    part = {name: i for i, p in enumerate(plan.parts) for name in p.nodes}
    return all(part[graph.nodes[e.src].name] <= part[graph.nodes[e.dst].name] for e in graph.edges)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", MODELS)
def test_reference_models_get_sane_plans(name: str, profile: str) -> None:
    graph = refmodels.costgraph(name)
    devices = load_shipped(profile)
    plan = plan_model(graph, devices)
    listed = [n for p in plan.parts for n in p.nodes]
    compute = [n.name for n in refmodels.exported(name).graph.nodes if n.op == "call_function"]
    assert sorted(listed) == sorted(compute)  # every graph node in exactly one part
    assert part_order_is_topological(plan, graph)
    model = CostModel(graph, devices)
    single = min(objective(model, [d] * len(graph)) for d in range(len(devices)))
    assert plan.predicted_ms <= single * 1.01
    assert set(plan.peak_bytes) == {d.id for d in devices}
    # no part below break-even stays without a reason
    schedule = simulate(model, [_device_index(devices, plan, n.name) for n in graph.nodes])
    for p in fragments(model, schedule):
        first = graph.nodes[schedule.parts[p].nodes[0]].name
        assert any("stays on" in note and first in note for note in plan.notes)


def _device_index(devices, plan: Plan, node: str) -> int:
    device = next(p.device for p in plan.parts if node in p.nodes)
    return [d.id for d in devices].index(device)


@pytest.mark.parametrize("name", ["resnet18-like", "bert-2layer-256", "mlp-4x-linear"])
def test_heavy_ops_go_to_the_h100(name: str) -> None:
    plan = plan_model(refmodels.costgraph(name), load_shipped("xeon-amx-h100"))
    graph = refmodels.costgraph(name)
    # Heavy: 10 MFLOP and more. A classifier head of 1 MFLOP may run on the CPU after the
    # backbone (a GPU kernel costs a launch however small: partitioner/cost.py).
    heavy = [n.name for n in graph.nodes
             if n.category in ("conv", "matmul", "attention") and n.flops >= 1e7]
    on_gpu = {n for p in plan.parts if p.device == "gpu0" for n in p.nodes}
    assert heavy and set(heavy) <= on_gpu
    assert plan.predicted_ms < 1.0  # a few GFLOPs on an H100: well under a millisecond


def test_ci_host_keeps_one_request_on_the_cpu_and_runs_it_faster_than_the_npu() -> None:
    plan = plan_model(refmodels.costgraph("mlp-4x-linear"), load_shipped("ci-host"))
    assert [p.device for p in plan.parts] == ["cpu0"]  # equal speed, cheaper launch, no copies
    assert plan.method == "chain" and plan.proven_optimal


def test_throughput_objective_balances_devices() -> None:
    graph = random_dag(120, 11)
    latency = plan_model(graph, sample_devices(), objective="latency")
    throughput = plan_model(graph, sample_devices(), objective="throughput")
    assert throughput.objective == "throughput"
    assert throughput.period_ms <= latency.period_ms * 1.01
    assert throughput.predicted_ms == pytest.approx(throughput.period_ms)


def test_annotated_export_is_honoured_end_to_end() -> None:
    ep = refmodels.exported("mlp-4x-linear")
    ep = ep.run_decompositions()  # a fresh program: the cached one stays unannotated
    for node in ep.graph.nodes:
        if node.name.startswith("relu"):
            node.meta.setdefault("custom", {})[ANNOTATION_KEY] = {"device": "npu"}
    plan = plan_model(ep, load_shipped("laptop-soc"))
    for p in plan.parts:
        if any(n.startswith("relu") for n in p.nodes):
            assert p.device == "npu0"
    with pytest.raises(PlacementError, match="relu.*device='npu'"):
        plan_model(build_costgraph(ep), load_shipped("xeon-amx-h100"))


def test_a_fallen_back_fp32_region_is_one_part_with_the_rest() -> None:
    """A non-strict `npu` region asking fp32 on a host with no NPU lands on the CPU with the
    rest of the model: under an fp32 policy it asks nothing the policy does not, so it is one
    part, not two parts on cpu0 with a cut between them (issue 48). Under `auto` the fp32 pin
    differs from the policy, and the region stays a part of its own."""
    ep = refmodels.exported("mlp-4x-linear").run_decompositions()
    for node in ep.graph.nodes:
        if node.name.startswith("relu"):
            node.meta.setdefault("custom", {})[ANNOTATION_KEY] = {
                "device": "npu", "precision": "fp32", "strict": False}
    cpu_only = [d for d in load_shipped("xeon-amx-h100") if d.kind == "cpu"]
    plan = plan_model(ep, cpu_only)
    assert len(plan.parts) == 1 and plan.parts[0].precision == "fp32"
    assert any("placed on cpu0" in n for n in plan.notes), plan.notes
    assert len(plan_model(ep, cpu_only, precision="auto").parts) > 1


# ---- the Plan as data and as reports ---------------------------------------------------------


def test_plan_round_trips_through_json() -> None:
    plan = plan_model(refmodels.costgraph("bert-2layer-256"), load_shipped("laptop-soc"))
    data = json.loads(json.dumps(plan.to_dict()))
    assert set(data) >= {"parts", "cuts", "predicted_ms", "peak_bytes", "objective", "notes"}
    assert set(data["parts"][0]) >= {"id", "device", "runtime", "precision", "nodes",
                                     "predicted_ms"}
    assert Plan.from_dict(data) == plan


def test_explain_and_dot_describe_the_plan() -> None:
    graph = random_dag(60, 2)
    plan = plan_model(graph, sample_devices())
    text = explain(plan)
    for p in plan.parts:
        assert p.id in text and p.device in text
    assert "predicted latency" in text and "peak memory" in text
    dot = to_dot(plan)
    assert dot.startswith("digraph plan {") and dot.rstrip().endswith("}")
    assert all(f'"{p.id}"' in dot for p in plan.parts)
    assert to_dot(plan, nodes=True).count("cluster_") == len(plan.parts)


def test_explain_says_why_an_annotated_node_moved() -> None:
    graph = random_dag(20, 8)
    for node in graph.nodes:
        node.flops = 5e10
    from partitioner.costgraph import Annotation

    graph.nodes[5].annotation = Annotation("cpu", None, False)
    plan = plan_model(graph, sample_devices())
    assert "n5" in explain(plan) and "preference" in explain(plan)


def test_build_plan_names_cut_tensors() -> None:
    ep = refmodels.exported("resnet18-like")
    graph = refmodels.costgraph("resnet18-like")
    cost = CostModel(graph, load_shipped("xeon-amx-h100"))
    half = len(graph) // 2
    plan = build_plan(cost, [0] * half + [1] * (len(graph) - half))
    names = {n.name for n in ep.graph.nodes}
    inner = [c for c in plan.cuts if "host" not in (c.src, c.dst)]
    assert inner and all(t in names for c in inner for t in c.tensors)


# ---- profiles ----------------------------------------------------------------------------------


def test_shipped_profiles_load() -> None:
    assert set(shipped_profiles()) >= set(PROFILES)
    xeon = {d.id: d for d in load_shipped("xeon-amx-h100")}
    assert xeon["gpu0"].peak_gflops["bf16"] > xeon["cpu0"].peak_gflops["bf16"] > 0
    assert xeon["gpu0"].runtimes == ["triton"]
    assert xeon["cpu0"].runtimes == ["llvm-cpu", "openvino", "onnxruntime", "torch"]
    ci = {d.id: d for d in load_shipped("ci-host")}
    assert ci["npu0"].emulated and ci["npu0"].runtimes == ["openvino"]
    assert ci["cpu0"].cores == [0] and ci["npu0"].cores == [1]
    assert {d.kind for d in load_shipped("laptop-soc")} == {"cpu", "gpu", "npu"}


@pytest.mark.parametrize(
    "device, message",
    [
        ({"id": "x0", "kind": "cpu", "speed": 3}, r"devices\[0\] \(x0\): unknown key.*'speed'"),
        ({"kind": "cpu"}, r"key 'id' is required"),
        ({"id": "x0", "kind": "tpu"}, r"kind must be one of"),
        ({"id": "x0", "kind": "cpu", "mem_bw_gbs": "fast"}, r"key 'mem_bw_gbs' must be a number"),
        ({"id": "x0", "kind": "cpu", "peak_gflops": {"fp8": 1.0}}, r"unknown dtypes \['fp8'\]"),
        ({"id": "x0", "kind": "cpu", "peak_gflops": {"fp32": 0}}, r"'peak_gflops.fp32' must be"),
        ({"id": "x0", "kind": "cpu", "cores": 3}, r"key 'cores' must be a list"),
    ],
)
def test_bad_profiles_name_the_key(tmp_path: Path, device: dict, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"devices": [device]}))
    with pytest.raises(ValueError, match=message):
        load_profiles(path)


def test_profile_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("devices: [ {id: a")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_profiles(path)
    path.write_text(yaml.safe_dump({"device": []}))
    with pytest.raises(ValueError, match="unknown top-level keys"):
        load_profiles(path)
    path.write_text(yaml.safe_dump({"devices": [{"id": "a", "kind": "cpu"}] * 2}))
    with pytest.raises(ValueError, match="'a' appears twice"):
        load_profiles(path)


def test_plan_model_takes_a_yaml_path() -> None:
    plan = plan_model(random_dag(30, 1), shipped_profiles()["ci-host"])
    assert {p.device for p in plan.parts} <= {"cpu0", "npu0"}


def test_plan_model_takes_an_exported_program() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(torch.nn.Linear(8, 8), (torch.randn(2, 8),))
    plan = plan_model(ep, load_shipped("ci-host"))
    assert [n for p in plan.parts for n in p.nodes] == ["linear"]


@pytest.mark.parametrize("decompose", [False, True])
def test_plan_parts_split_the_real_program(decompose: bool) -> None:
    """Parts cover the graph and run in order: split along the plan, the result matches eager."""
    from partitioner.split import split_program

    ep = refmodels.exported("bert-2layer-256")
    if decompose:
        ep = ep.run_decompositions()  # tuple results (native_layer_norm) and their getitems
    norms = {"layer_norm", "native_layer_norm"}
    plan = plan_model(ep, load_shipped("xeon-amx-h100"), support={"gpu0": norms})
    assert {p.device for p in plan.parts} == {"cpu0", "gpu0"} and len(plan.parts) > 2
    split = split_program(ep, [(p.id, p.nodes) for p in plan.parts])
    ids = torch.randint(0, 30522, (8, 128))
    expected = ep.module()(ids)
    torch.testing.assert_close(split.run(ids)[0], expected)


def test_a_dynamic_size_used_by_another_part_is_computed_there_again() -> None:
    """A dynamic dimension's size (`sym_size`) and arithmetic on it are numbers, not tensors:
    the part that uses one computes it again from what it sizes (a model input here), and no
    number crosses parts (the arena holds tensors only: a split language model of a dynamic
    length failed to build for it)."""
    from partitioner.split import split_program

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x)
            return y.reshape(x.shape[0] * x.shape[1], -1) + 1

    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(Net(), (torch.randn(4, 3, 8),), dynamic_shapes=({0: batch},))
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    sizes = [n.name for n in nodes if isinstance(n.meta.get("val"), torch.SymInt)]
    assert sizes, [n.name for n in nodes]
    first = [n.name for n in nodes if n.name in sizes or n.target is torch.ops.aten.relu.default]
    split = split_program(ep, [("p0", first), ("p1", [n.name for n in nodes
                                                      if n.name not in first])])
    crossing = {n for part in split.parts for n in part.inputs + part.outputs}
    assert not crossing & set(sizes), crossing
    x = torch.randn(6, 3, 8)
    torch.testing.assert_close(split.run(x)[0], ep.module()(x))


def test_auto_prices_each_device_at_the_precision_it_would_run() -> None:
    """Placement sees a device's fast lower precision under `auto` (issue: placement priced at
    fp32 only, so a device whose bf16/fp16/int8 is fast was never the better home)."""
    from dataclasses import replace

    cpu, npu = load_shipped("ci-host")
    cpu = replace(cpu, peak_gflops={"fp32": 150.0, "bf16": 150.0})  # no fast bf16
    npu = replace(npu, peak_gflops={"fp32": 100.0, "fp16": 2000.0, "int8": 8000.0})
    graph = refmodels.costgraph("mlp-4x-linear")
    fp32 = plan_model(graph, [cpu, npu])
    assert [p.device for p in fp32.parts] == ["cpu0"]  # the faster fp32 device
    assert not any("priced at" in n for n in fp32.notes)
    auto = plan_model(graph, [cpu, npu], precision="auto")
    assert {p.device for p in auto.parts} == {"npu0"}, auto.parts
    assert "priced at the precision `auto` would run: npu0 at fp16" in auto.notes
    assert auto.predicted_ms < fp32.predicted_ms / 5
    calibrated = plan_model(graph, [cpu, npu], precision="auto", int8=True)
    assert "priced at the precision `auto` would run: npu0 at int8" in calibrated.notes
    model = CostModel(graph, [cpu, npu], precision="auto")
    node = next(n for n in graph.nodes if n.category == "matmul")
    assert model.run_precision(node, cpu) == "fp32"  # a tie keeps fp32
    # a model already in bf16 is priced at its own dtype under the fp32 policy, as before
    half = CostGraph([replace(n, dtype="bf16") for n in graph.nodes], graph.edges,
                     graph.param_bytes, graph.input_bytes)
    fast_bf16 = replace(cpu, peak_gflops={"fp32": 150.0, "bf16": 1500.0})
    (on_own,) = zip(*CostModel(half, [fast_bf16]).roofline_ms, strict=True)
    (at_fp32,) = zip(*CostModel(graph, [fast_bf16]).roofline_ms, strict=True)
    assert sum(on_own) < sum(at_fp32) / 2
