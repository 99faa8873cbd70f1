"""cuvild/load/precision.py `refuse_unusable`: a plan whose outputs, at every part's own
precision, hold NaN or inf where torch eager's are finite is refused, naming the input and
the parts; a finite error, however large, is left to the budgets. The runner here is a
stand-in: every part's own build is checked on its samples first (two where one holds a
padded row: cuvild/workers/build.py), so no runtime of this host gives such a plan on demand
(tests/runtimes/test_masks.py shows the build refusing one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cuvild.core.errors import InferError
from cuvild.core.loaded import Route
from cuvild.load.precision import check, refuse_unusable

INPUTS = [[torch.full((2, 3), float(i))] for i in range(4)]
EAGER = [[x[0] * 2] for x in INPUTS]
MODEL = SimpleNamespace(routes=[Route("p0", "cpu0", "fp32", ["x"], ["y"], runtime="openvino"),
                                Route("p1", "npu0", "fp32", ["y"], ["z"], runtime="torch")])


def nan_on(bad: int):  # noqa: ANN201
    def run(model: object, x: list[torch.Tensor]) -> list[torch.Tensor]:
        out = x[0] * 2
        if int(x[0][0, 0]) == bad:
            out[1, 2] = float("nan")
        return [out]
    return run


def test_nan_where_eager_is_finite_is_refused_naming_the_input_and_the_parts() -> None:
    run = nan_on(2)
    first = check(run, MODEL, INPUTS, EAGER)
    assert first.error == float("inf")
    with pytest.raises(InferError) as e:
        refuse_unusable(run, MODEL, INPUTS, EAGER, first)
    text = str(e.value)
    assert "inf or NaN in 1 of 6 values of output 0" in text
    assert "check input 2 of 4" in text
    assert "p0 on cpu0 (openvino, fp32), p1 on npu0 (torch, fp32)" in text
    assert "engine.runtimes" in text


def test_a_finite_error_is_left_to_the_budgets() -> None:
    def off(model: object, x: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x[0] * 2 + 0.5]

    first = check(off, MODEL, INPUTS, EAGER)
    assert 0 < first.error < float("inf")
    refuse_unusable(off, MODEL, INPUTS, EAGER, first)  # no error
