"""Tensors over shared memory in a worker, as torch tensors or, in a worker that never
imported torch, as numpy arrays.

A worker whose parts were all restored from the cache on OpenVINO or ONNX Runtime (a load
record's, cuvild/load/warm.py) runs them on numpy views: importing torch would cost it
~1.5 s of start and ~220 MB of memory for nothing. Once torch is imported (a part is built,
or runs on torch), new views are torch tensors; both kinds may meet in one run, and the
runtimes take either (runtimes/base.py `as_array`, `like_inputs`).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from cuvild.core.dtypes import NUMPY

NUMPY_RUNTIMES = {"openvino", "onnxruntime"}  # they take numpy arrays and answer in kind


def lean(dtype: str) -> bool:
    """Whether a view of this dtype is a numpy array (torch not imported, and numpy has the
    dtype: bfloat16 has none, so it imports torch)."""
    return "torch" not in sys.modules and dtype in NUMPY


def frombuffer(raw: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    if lean(dtype):
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    import torch

    return torch.frombuffer(raw, dtype=getattr(torch, dtype)).view(shape)


def empty(dtype: str, shape: tuple[int, ...]) -> Any:
    if lean(dtype):
        return np.empty(shape, dtype=dtype)
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype))


def wrap(raw: Any, dtype: str, shape: tuple[int, ...], numpy: bool = False) -> Any:
    """A tensor over `raw` (None: an empty one): with `numpy`, a numpy array where numpy has
    the dtype (for the runtimes that take them), else as `frombuffer` makes it."""
    if numpy and dtype in NUMPY:
        return np.empty(shape, dtype) if raw is None else np.frombuffer(raw, dtype).reshape(shape)
    return empty(dtype, shape) if raw is None else frombuffer(raw, dtype, shape)


def as_numpy(value: Any) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.detach().numpy()


def copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src, unless the runtime wrote its output in place."""
    if isinstance(dst, np.ndarray) or isinstance(src, np.ndarray):
        dst, src = as_numpy(dst), as_numpy(src)
        if not np.shares_memory(dst, src):
            np.copyto(dst, src, casting="unsafe")
    elif dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def as_bytes(value: Any, dtype: str) -> memoryview:
    """The value's bytes in C order at `dtype`."""
    if isinstance(value, np.ndarray):
        return memoryview(np.ascontiguousarray(value, dtype=dtype)).cast("B")
    import torch

    data = value.to(getattr(torch, dtype)).contiguous().reshape(-1)
    return memoryview(data.view(torch.uint8).numpy())
