"""A language model's plan priced for a generation: its prefill and decode steps apart
(partitioner/phases.py), on hand-built graphs (no torch) and a tiny exported Llama."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from partitioner.cost import CostModel
from partitioner.costgraph import CostGraph, CostNode, Edge
from partitioner.phases import Generation, combined, shapes
from partitioner.plan import Plan, plan_model
from partitioner.profile import DeviceProfile
from partitioner.schedule import objective, simulate
from partitioner.synthetic import random_chain, sample_devices

ROOT = Path(__file__).resolve().parents[2]


def layers(tokens: int, n: int = 6, weight: int = 50_000_000) -> CostGraph:
    """A decoder's chain at `tokens` positions: each layer reads its weights once and does
    2 FLOPs per weight per position (compute-bound at a prompt's length, memory-bound at
    one token)."""
    act = 4096 * tokens
    nodes = [CostNode(f"layer{v}", category="matmul", flops=2.0 * weight / 4 * tokens,
                      bytes_read=weight + act, bytes_written=act, out_bytes=act,
                      params=(f"w{v}",), inputs=("x",) if v == 0 else ()) for v in range(n)]
    nodes[-1].output_bytes = act
    return CostGraph(nodes, [Edge(v - 1, v, act) for v in range(1, n)],
                     param_bytes={f"w{v}": weight for v in range(n)}, input_bytes={"x": act})


# A host CPU that reads memory fast, and an NPU with 10x its compute but a third of its
# bandwidth (a laptop SoC's shares the DRAM): a prompt wants the NPU, a decode step the CPU.
SOC = [
    DeviceProfile(id="cpu0", kind="cpu", memory_gb=32, peak_gflops={"fp32": 500.0},
                  mem_bw_gbs=90.0, link_bw_gbs=0, link_latency_us=0, launch_us=2,
                  runtimes=["torch"]),
    DeviceProfile(id="npu0", kind="npu", memory_gb=32, peak_gflops={"fp32": 5000.0},
                  mem_bw_gbs=30.0, link_bw_gbs=30.0, link_latency_us=20, launch_us=50,
                  runtimes=["openvino"]),
]


def test_a_generation_costs_its_prefill_runs_and_its_decode_steps() -> None:
    """The combined model's every time is runs x a prefill's + generated x a step's: for a
    chain (parts one after another) the sum is exact, on any assignment."""
    devices = sample_devices("cpu,gpu")
    prefill, decode = random_chain(30, 1), random_chain(30, 1)
    for node in decode.nodes:  # the same graph at one token: less of everything
        node.flops, node.bytes_written = node.flops / 100, node.bytes_written // 100
    decode = CostGraph(decode.nodes, [Edge(e.src, e.dst, e.bytes // 100)
                                      for e in decode.edges], decode.param_bytes,
                       decode.input_bytes)
    gen = Generation(prompt=96, generated=40, chunk=32)
    first, step = CostModel(prefill, devices), CostModel(decode, devices)
    whole = combined(first, step, gen)
    for assign in ([0] * 30, [1] * 30, [v % 2 for v in range(30)], [v // 10 % 2
                                                                       for v in range(30)]):
        want = 3 * simulate(first, assign).latency_ms + 40 * simulate(step, assign).latency_ms
        assert math.isclose(objective(whole, assign), want, rel_tol=1e-9), assign
    # memory is one run's (the prefill's), not a sum over runs
    assert whole.peak_bytes([0] * 30) == first.peak_bytes([0] * 30)


def test_the_prefill_and_the_decode_steps_are_priced_apart() -> None:
    """Priced for one prompt-length pass, the layers go to the NPU (its compute); priced for
    a generation of 128 tokens, to the CPU (a step reads every weight, and the CPU reads 3x
    faster); priced for a long prompt and one token, back to the NPU. The plan's parts are a
    decode step's and `phases` gives both phases for the plan and each device alone."""
    prompt, step = layers(512), layers(1)
    one_pass = plan_model(prompt, SOC)
    assert {p.device for p in one_pass.parts} == {"npu0"} and not one_pass.phases
    gen = Generation(prompt=512, generated=128, chunk=512)
    plan = plan_model((prompt, step), SOC, generation=gen)
    assert {p.device for p in plan.parts} == {"cpu0"}, plan.notes
    assert plan.notes[0].startswith("priced for a generation, a 512-token prompt in one run")
    phases = plan.phases
    assert set(phases["alone"]) == {"cpu0", "npu0"}
    assert phases["plan"] == phases["alone"]["cpu0"]
    npu, cpu = phases["alone"]["npu0"], phases["alone"]["cpu0"]
    assert npu["prefill_ms"] < cpu["prefill_ms"] and npu["step_ms"] > cpu["step_ms"]
    for p in (npu, cpu):
        assert math.isclose(p["total_ms"], p["prefill_ms"] + 128 * p["step_ms"])
    assert math.isclose(plan.predicted_ms, cpu["step_ms"], rel_tol=1e-9)
    long_prompt = plan_model((prompt, step), SOC, generation=Generation(512, 1, 512))
    assert {p.device for p in long_prompt.parts} == {"npu0"}


def test_a_model_larger_than_the_gpu_is_placed_for_both_phases() -> None:
    """Weights for half the layers fit the GPU: the plan for a generation fits, is no slower
    than the peers' memory-only rule (a row of its own) nor any device that holds it alone,
    and a device that cannot hold it says so."""
    devices = [DeviceProfile(**{**d.to_dict(), "memory_gb": 0.16}) if d.kind == "gpu" else d
               for d in sample_devices("cpu,gpu")]
    gen = Generation(prompt=128, generated=64, chunk=128)
    plan = plan_model((layers(128), layers(1)), devices, generation=gen)
    phases = plan.phases
    assert phases["alone"]["gpu0"] is None and phases["alone"]["cpu0"] is not None
    assert phases["memory_rule"]["device"] == "gpu0"
    assert phases["plan"]["total_ms"] <= phases["memory_rule"]["total_ms"] * (1 + 1e-9)
    assert phases["plan"]["total_ms"] < phases["alone"]["cpu0"]["total_ms"]
    assert plan.peak_bytes["gpu0"] <= 0.16e9
    from partitioner.report import explain

    text = explain(plan)
    assert "priced for a 128-token prompt in one run, then 64 decode step(s)" in text
    assert "memory-only rule (gpu0 first)" in text and "cannot hold or run it" in text


def test_the_program_decides_the_chunk() -> None:
    """A length exported dynamic: the prompt in one run, as long as the program takes; one
    exported for a token: the prompt token by token, at the example's shape."""
    gen, prefill, decode = shapes({"s0": (1, 63)}, Generation(128, 16))
    assert (gen.prompt, gen.chunk, gen.runs) == (63, 63, 1)
    assert prefill == {"s0": 63} and decode == {"s0": 1}
    gen, prefill, decode = shapes({}, Generation(128, 16))
    assert (gen.chunk, gen.runs, prefill, decode) == (1, 128, {}, {})
    assert gen.describe() == "a 128-token prompt token by token, then 16 decode step(s)"


def test_a_tiny_llama_is_priced_for_a_generation(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A causal LM exported with its cache as buffers is seen to keep state and priced for a
    generation; `cuvilctl partition FILE --profile ... --prompt-tokens/--generated-tokens`
    shows both phases, and the plan's JSON keeps them."""
    pytest.importorskip("transformers")
    import json

    import torch

    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import lm_models

    laptop = ROOT / "configs" / "profiles" / "laptop-8gb-gpu.yaml"
    ep = lm_models.export(lm_models.lm("llama"), dynamic=True)
    plan = plan_model(ep, laptop)
    assert plan.phases["prompt"] == lm_models.CONTEXT - 1 and plan.phases["runs"] == 1
    assert plan.phases["generated"] == 128
    # its few shape ops alone were faster on the GPU: a split no faster than the CPU alone
    assert [p.device for p in plan.parts] == ["cpu0"], plan.notes
    soc = plan_model(ep, ROOT / "configs" / "profiles" / "laptop-soc.yaml")  # an NPU beside
    assert any(n.startswith("npu0 cannot run 6 node(s): aten.copy_.default, "
                            "aten.index_copy_.default") for n in soc.notes), soc.notes
    archive = tmp_path / "lm.pt2"
    torch.export.save(ep, archive)
    from cuvild.client import cli

    assert cli.main(["--target", f"unix://{tmp_path}/none", "partition", str(archive),
                     "--profile", str(laptop), "--prompt-tokens", "32",
                     "--generated-tokens", "16"]) == 0
    done = capsys.readouterr()
    assert "priced for a 32-token prompt in one run, then 16 decode step(s)" in done.out
    assert "cpu0 alone" in done.out and "gpu0 alone" in done.out
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))  # (what --json prints)
    assert again.phases == plan.phases and again.phases["plan"]["step_ms"] > 0


def test_a_node_that_updates_state_stays_where_a_runtime_keeps_it() -> None:
    """A cache write (a node updating a buffer in place) never goes to an NPU, where no
    runtime keeps state, however fast it is there; an emulated NPU (on the host) may hold
    it, and the plan says what the NPU cannot run."""
    graph = layers(512)
    graph.nodes[2].updates_state = True
    plan = plan_model(graph, SOC)
    where = {name: p.device for p in plan.parts for name in p.nodes}
    assert where["layer2"] == "cpu0" and where["layer0"] == "npu0", where
    assert any(n.startswith("npu0 cannot run 1 node(s)") for n in plan.notes), plan.notes
    emulated = [SOC[0], DeviceProfile(**{**SOC[1].to_dict(), "emulated": True})]
    assert {p.device for p in plan_model(layers(512), emulated).parts} == {"npu0"}
    graph = layers(512)
    graph.nodes[2].updates_state = True
    assert {p.device for p in plan_model(graph, emulated).parts} == {"npu0"}


def test_a_split_that_gains_little_is_one_device() -> None:
    """A split predicted under SPLIT_GAIN faster than the best device alone gives way to
    that device (within what the cost model mispredicts); one that gains more stays split
    (and is timed against that device at the load's warm-up: tests/engine/test_guard.py)."""
    def with_head(tokens: int, flops: float) -> CostGraph:
        graph = layers(tokens)
        act = graph.nodes[-1].out_bytes
        graph.nodes[-1].output_bytes = 0
        head = CostNode("head", category="matmul", flops=flops, bytes_read=act,
                        bytes_written=4096, out_bytes=4096, output_bytes=4096)
        return CostGraph([*graph.nodes, head], [*graph.edges, Edge(5, 6, act)],
                         graph.param_bytes, graph.input_bytes)

    gen = Generation(prompt=512, generated=128, chunk=512)
    small = plan_model((with_head(512, 2e8), with_head(1, 2e8)), SOC, generation=gen)
    assert {p.device for p in small.parts} == {"cpu0"}, small.notes
    (note,) = [n for n in small.notes if n.startswith("one device: ")]
    assert "the split over cpu0, npu0 was predicted 1.0" in note and note.endswith(
        "cpu0 alone"), note
    big = plan_model((with_head(512, 2e9), with_head(1, 2e9)), SOC, generation=gen)
    assert {p.device for p in big.parts} == {"cpu0", "npu0"}, big.notes
    assert not [n for n in big.notes if n.startswith("one device: ")]
