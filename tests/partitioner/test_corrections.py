"""The learning rule of the cost model's corrections, on synthetic measurements (no torch)."""

from __future__ import annotations

import json
import random

import pytest

from partitioner.corrections import KEEP, Corrections, Prior
from partitioner.cost import CostModel
from partitioner.costgraph import CostGraph, CostNode, Edge
from partitioner.plan import plan_model
from partitioner.profile import DeviceProfile

CALL_MS = 0.05
START = Prior(CALL_MS, 0.0)  # a CPU's prior: its call, no kernel cost


def part(rng: random.Random) -> dict[str, float]:
    """Roofline ms per class of a compute-bound part of random size."""
    return {"conv": rng.uniform(1, 20), "elementwise": rng.uniform(0.05, 1)}


def true_ms(class_ms: dict[str, float], slow: float, rng: random.Random | None = None,
            noise: float = 0.0) -> float:
    jitter = 1 + (rng.uniform(-noise, noise) if rng else 0.0)
    return (CALL_MS + slow * sum(class_ms.values())) * jitter


def test_a_consistently_2x_slow_runtime_is_predicted_2x_after_feedback() -> None:
    rng = random.Random(0)
    learned = Corrections()
    first = part(rng)
    assert learned.price("cpu0", "openvino", first, 0, START) == pytest.approx(
        CALL_MS + sum(first.values()))  # nothing learned: the roofline
    learned.observe("cpu0", "openvino", first, 0, START, true_ms(first, 2.0))
    for _ in range(5):  # parts it has never seen are predicted 2x too
        unseen = part(rng)
        assert learned.price("cpu0", "openvino", unseen, 0, START) == pytest.approx(
            true_ms(unseen, 2.0), rel=0.01)
    assert learned.scale("cpu0", "openvino", "conv") == pytest.approx(2.0, rel=0.01)
    # the lesson stays with its device and runtime
    assert learned.scale("cpu0", "onnxruntime", "conv") == 1.0
    assert learned.scale("npu0", "openvino", "conv") == 1.0


def test_noise_and_an_outlier_do_not_swing_it() -> None:
    rng = random.Random(1)
    learned = Corrections()
    for _ in range(KEEP):
        p = part(rng)
        learned.observe("cpu0", "openvino", p, 0, START, true_ms(p, 2.0, rng, noise=0.3))
    settled = learned.scale("cpu0", "openvino", "conv")
    assert settled == pytest.approx(2.0, rel=0.15)
    p = part(rng)
    learned.observe("cpu0", "openvino", p, 0, START, 10 * true_ms(p, 2.0))  # one bad run
    assert learned.scale("cpu0", "openvino", "conv") == pytest.approx(settled, rel=0.1)


def test_an_overhead_dominated_part_teaches_the_call_not_the_scale() -> None:
    learned = Corrections()
    tiny = {"matmul": 0.01}
    start = Prior(0.005, 0.0)
    learned.observe("cpu0", "onnxruntime", tiny, 1, start, 0.30)  # ORT's call, not its matmul
    assert learned.overhead("cpu0", "onnxruntime", start).call_ms == pytest.approx(0.29)
    assert learned.scale("cpu0", "onnxruntime", "matmul") == 1.0
    assert learned.price("cpu0", "onnxruntime", tiny, 1, start) == pytest.approx(0.30)
    # a large part on the same runtime then learns its scale with that call cost taken off
    big = {"matmul": 10.0}
    learned.observe("cpu0", "onnxruntime", big, 1, start, 0.29 + 15.0)
    assert learned.scale("cpu0", "onnxruntime", "matmul") == pytest.approx(1.5)


def test_round_trip_and_bad_files() -> None:
    learned = Corrections()
    learned.observe("cpu0", "torch", {"conv": 2.0}, 0, START, 4.0)
    again = Corrections.from_dict(json.loads(json.dumps(learned.to_dict())))
    assert again.scale("cpu0", "torch", "conv") == learned.scale("cpu0", "torch", "conv")
    with pytest.raises(ValueError, match="malformed"):
        Corrections.from_dict({"cpu0-torch-conv": {"samples": [1.0], "weights": [1.0]}})


def test_placement_prices_devices_at_their_best_learned_runtime() -> None:
    """Two CPU runtimes learned at 3x and 1.5x: the cost model prices the CPU at 1.5x (auto
    would pick that runtime), and a plan says which corrections it used."""
    cpu = DeviceProfile(id="cpu0", kind="cpu", peak_gflops={"fp32": 100.0}, mem_bw_gbs=10.0,
                        link_bw_gbs=10.0, launch_us=5, runtimes=["openvino", "onnxruntime"])
    nodes = [CostNode(f"n{i}", op="conv2d", category="conv", flops=1e9, bytes_read=1000,
                      bytes_written=1000, out_bytes=1000) for i in range(3)]
    graph = CostGraph(nodes, [Edge(0, 1, 1000), Edge(1, 2, 1000)])
    learned = Corrections()
    learned.observe("cpu0", "openvino", {"conv": 10.0}, 0, Prior(0.005, 0.0), 30.005)
    learned.observe("cpu0", "onnxruntime", {"conv": 10.0}, 0, Prior(0.005, 0.0), 15.005)
    plain, corrected = CostModel(graph, [cpu]), CostModel(graph, [cpu], corrections=learned)
    assert corrected.node_ms[0][0] == pytest.approx(1.5 * plain.node_ms[0][0])
    assert corrected.roofline_ms == plain.roofline_ms
    plan = plan_model(graph, [cpu], corrections=learned)
    assert plan.parts[0].class_ms == {"conv": pytest.approx(30.0)}  # 3 x 1 GFLOP at 100
    assert any("cpu0/onnxruntime/conv x1.50" in note for note in plan.notes)
    assert plan_model(graph, [cpu]).notes == [n for n in plan.notes if "corrections" not in n]
