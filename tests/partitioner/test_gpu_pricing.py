"""GPU parts priced from what they are made of: `call + kernels x kernel + roofline`
(partitioner/corrections.py), learned with the priors as anchors, and the lent H200's
recorded parts replayed through it (tests/partitioner/h200_replay.py; no GPU needed)."""

from __future__ import annotations

import json

import pytest

from partitioner.corrections import BAND, Corrections, Prior, prior
from partitioner.profile import DeviceProfile

MEASURED = Prior(0.030, 0.004, measured=True)  # timed through compiled parts at profiling


def spent(kernels: int, call: float = 0.050, kernel: float = 0.010) -> float:
    return call + kernels * kernel


def test_the_prior_is_the_profiles_measured_parts_else_its_launch() -> None:
    gpu = DeviceProfile(id="gpu0", kind="gpu", launch_us=11.2)
    assert prior(gpu) == Prior(0.0112, 0.0112, False)
    gpu.call_us, gpu.kernel_us = 30.0, 4.0
    assert prior(gpu) == Prior(0.030, 0.004, True)
    assert prior(DeviceProfile(id="npu0", kind="npu", launch_us=80.0)) == Prior(0.08, 0.0)


def test_parts_of_several_kernel_counts_fit_call_and_kernel_apart() -> None:
    """Three models' launch-bound parts of 5, 20 and 40 kernels (one an outlier run): the
    fit finds the call and the per-kernel cost, moved from a measured prior by 3 / 5."""
    learned = Corrections()
    start = Prior(0.050, 0.010, measured=True)  # the truth: no shrink can hide a bad fit
    for kernels, model in ((5, "a"), (20, "b"), (40, "c"), (20, "b")):
        learned.observe("gpu0", "triton", {"conv": 0.001}, kernels, start, spent(kernels), model)
    learned.observe("gpu0", "triton", {"conv": 0.001}, 20, start, 3 * spent(20), "b")
    fit = learned.overhead("gpu0", "triton", start)
    assert fit.call_ms == pytest.approx(0.050, rel=0.05)
    assert fit.kernel_ms == pytest.approx(0.010, rel=0.05)


def test_one_kernel_count_teaches_the_kernels_not_the_call() -> None:
    """The H200's mistake: parts of ~43 kernels at 2.1 ms learned as a 1.6 ms call. Parts of
    one kernel count leave the call at its prior; the rest is the kernels'."""
    learned = Corrections()
    start = Prior(0.0112, 0.0112)  # launch_us stands in: not a measured prior
    learned.observe("gpu0", "triton", {"conv": 0.09}, 43, start, 2.13, "resnet18")
    fit = learned.overhead("gpu0", "triton", start)
    assert fit.call_ms == pytest.approx(0.0112)
    assert fit.kernel_ms == pytest.approx((2.13 - 0.09 - 0.0112) / 43)
    # a part of 3 kernels (an MLP) is priced at its own launches, not at resnet18's time
    assert learned.price("gpu0", "triton", {"matmul": 0.02}, 3, start) < 0.2


def test_a_measured_prior_is_shrunk_toward_and_bounded() -> None:
    """One model says the kernels cost 10x the measured prior: the fit moves a third of the
    way (one model against the prior's two) and never past BAND x the prior."""
    learned = Corrections()
    learned.observe("gpu0", "triton", {}, 20, MEASURED, 0.030 + 20 * 0.040, "a")
    one = learned.overhead("gpu0", "triton", MEASURED)
    assert one.kernel_ms == pytest.approx(0.004 + (0.040 - 0.004) / 3)
    for model in "bcdefgh":
        learned.observe("gpu0", "triton", {}, 20, MEASURED, 0.030 + 20 * 0.040, model)
    many = learned.overhead("gpu0", "triton", MEASURED)
    assert many.kernel_ms == pytest.approx(BAND * 0.004)


def test_a_call_is_never_larger_than_the_smallest_part_measured() -> None:
    learned = Corrections()
    start = Prior(0.005, 0.0)  # an NPU: a call overhead, no kernel cost
    learned.observe("npu0", "openvino", {}, 0, start, 0.8, "a")
    learned.observe("npu0", "openvino", {"matmul": 0.5}, 0, start, 0.6, "b")  # compute-bound
    assert learned.overhead("npu0", "openvino", start).call_ms == pytest.approx(0.6)


def test_a_device_without_a_kernel_prior_fits_its_kernels_where_parts_span_them() -> None:
    """An NPU or CPU runtime (no kernel cost in its prior) learns one call where its parts
    all have about as many kernels; parts of 0 to 25 kernels (a model's head alone, whole
    models) fit call and kernel apart, as on a GPU. Else the head's 0.07 ms, the smallest
    part, caps the call that every 20-kernel part is then priced at (0.3-0.9 ms measured):
    an emulated NPU seen so looked 3x cheaper than the CPU it runs on."""
    start = Prior(0.005, 0.0)
    learned = Corrections()
    for model, kernels in enumerate([17, 20, 22, 25]):
        learned.observe("npu0", "openvino", {}, kernels, start, spent(kernels, 0.06, 0.015),
                        f"m{model}")
    alike = learned.overhead("npu0", "openvino", start)  # no span: one call, capped by
    assert alike.kernel_ms == 0.0  # the smallest part
    assert alike.call_ms == pytest.approx(spent(17, 0.06, 0.015))
    learned.observe("npu0", "openvino", {}, 0, start, 0.06, "head")
    fit = learned.overhead("npu0", "openvino", start)
    assert fit.call_ms == pytest.approx(0.06) and fit.kernel_ms == pytest.approx(0.015)
    assert learned.price("npu0", "openvino", {}, 20, start) == pytest.approx(spent(20, 0.06,
                                                                                   0.015))


def test_an_old_one_constant_call_is_dropped_and_the_new_form_round_trips() -> None:
    old = {"gpu0/triton/@call": {"samples": [1.645], "weights": [1.0]},
           "gpu0/triton/conv": {"samples": [1.2], "weights": [1.0]}}
    read = Corrections.from_dict(old)
    assert read.overhead("gpu0", "triton", MEASURED) == MEASURED
    assert read.scale("gpu0", "triton", "conv") == pytest.approx(1.2)
    read.observe("gpu0", "triton@bf16", {}, 20, MEASURED, 0.2, "a")  # one overhead per runtime
    again = Corrections.from_dict(json.loads(json.dumps(read.to_dict())))
    assert again.overhead("gpu0", "triton", MEASURED) == read.overhead("gpu0", "triton",
                                                                       MEASURED)
    with pytest.raises(ValueError, match="malformed"):
        Corrections.from_dict({"gpu0/triton/@overhead": {"kernels": [1], "spent_ms": []}})


@pytest.mark.slow
def test_the_h200s_parts_replayed() -> None:
    """Learned from its daemon's first two GPU parts, every recorded H200 part is predicted
    within 0.5-2x of what it measured, and the models loaded next stay on the GPU: the MLP
    by price, the bf16 ResNet-18 by the load timing both plans (the lessons moved it)."""
    import h200_replay

    corrections, devices = h200_replay.learned()
    for row in h200_replay.parts(corrections, devices):
        assert 0.5 <= row["learned_over_measured"] <= 2.0, row
    placed = h200_replay.placed(corrections, devices)
    assert placed["mlp 2048 b16"]["served_on"] == "gpu0", placed
    assert placed["resnet18 bf16"]["served_on"] == "gpu0", placed
