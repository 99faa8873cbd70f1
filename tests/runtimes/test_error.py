"""The one error metric (runtimes/base.py `relative_error`, its numpy form that a restored
model checks with, and `set_error` over a set of inputs): values that are not finite never
pass for accurate."""

from __future__ import annotations

import math

import numpy as np
import torch

from runtimes.base import relative_error, set_error, unusable

INF, NAN = float("inf"), float("nan")


def both(out: list[float], ref: list[float]) -> tuple[float, float]:
    """The error by the torch metric and by the set's, in numpy (as a restart reads it)."""
    t_out, t_ref = torch.tensor(out), torch.tensor(ref)
    return relative_error(t_out, t_ref), set_error([t_out.numpy()], [t_ref.numpy()])


def test_finite_outputs_measure_max_abs_over_max_abs() -> None:
    assert all(math.isclose(e, 0.05, rel_tol=1e-5) for e in both([1.0, 2.1], [1.0, 2.0]))


def test_nan_or_inf_where_eager_is_finite_is_infinitely_wrong() -> None:
    # Before: NaN made the error NaN, and max(0.0, nan) is 0.0: a NaN output passed as exact.
    assert both([NAN, 1.0], [1.0, 1.0]) == (INF, INF)
    assert both([INF, 1.0], [1.0, 1.0]) == (INF, INF)
    assert both([-INF, -INF], [5.0, -3.0]) == (INF, INF)
    assert "inf or NaN in 1 of 2 values of output 0" in unusable(torch.tensor([NAN, 1.0]),
                                                                 torch.tensor([1.0, 1.0]))


def test_where_eager_is_not_finite_the_output_must_match_it_there() -> None:
    # Masked logits: -inf in eager is no error when the runtime gives -inf too.
    torch_err, numpy_err = both([-INF, 2.02, NAN], [-INF, 2.0, NAN])
    assert math.isclose(torch_err, 0.01, rel_tol=1e-5)
    assert math.isclose(numpy_err, 0.01, rel_tol=1e-5)
    assert both([0.0, 2.0], [-INF, 2.0]) == (INF, INF)
    assert both([INF, 2.0], [-INF, 2.0]) == (INF, INF)
    assert both([-INF], [-INF]) == (0.0, 0.0)


def test_shapes_and_integers() -> None:
    assert relative_error(torch.zeros(2), torch.zeros(3)) == INF
    assert relative_error(torch.tensor([1, 2]), torch.tensor([1, 3])) == 1.0
    assert set_error([np.array([1, 2])], [np.array([1, 2])]) == 0.0
    assert "as torch.float32 (2,); torch eager's is torch.float32 (3,)" in unusable(
        torch.zeros(2), torch.zeros(3))


def test_over_a_set_the_error_is_read_against_the_sets_range() -> None:
    # ViT-B's case (runtimes/base.py set_error): the same 3e-3 rounding on every input, one
    # input's outputs near zero. Per input that one reads 1.5e-1; against the set's range 1e-2.
    refs = [torch.tensor([0.02, -0.01]), torch.tensor([0.3, -0.2]), torch.tensor([0.1, 0.25])]
    outs = [r + 3e-3 for r in refs]
    assert math.isclose(relative_error(outs[0], refs[0]), 0.15, rel_tol=1e-4)
    assert math.isclose(set_error(outs, refs), 0.01, rel_tol=1e-4)
    each = [relative_error(o, r) for o, r in zip(outs, refs, strict=True)]
    assert set_error(outs, refs) <= max(each)
    # one input is relative_error; tensors, arrays and sequences of them read alike
    assert set_error(outs[1:2], refs[1:2]) == relative_error(outs[1], refs[1])
    assert set_error([[o.numpy()] for o in outs], [[r.numpy()] for r in refs]) == \
        set_error(outs, refs)


def test_over_a_set_any_wrong_output_is_infinitely_wrong() -> None:
    refs = [torch.ones(2), torch.ones(2)]
    assert set_error([torch.ones(2), torch.tensor([1.0, NAN])], refs) == INF
    assert set_error([torch.ones(2), torch.ones(3)], refs) == INF
    assert set_error([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)], refs) == INF
    assert set_error([torch.ones(2)], refs) == INF  # an input missing
    assert set_error([torch.tensor([1, 2]), torch.tensor([1, 2])],
                     [torch.tensor([1, 2]), torch.tensor([1, 3])]) == 1.0
    assert set_error([], []) == 0.0
