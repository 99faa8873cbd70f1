"""The one dtype table: a tensor's torch dtype name, its Open Inference Protocol datatype, its
size in bytes, the typed-contents field of the protocol that carries it, and whether numpy
holds it (views without torch, JSON data over HTTP).

The engine sizes slots with it, the OIP servicer checks requests with it and the client packs
requests with it, so it imports nothing heavy: no torch, no gRPC.
"""

from __future__ import annotations

from typing import NamedTuple


class DType(NamedTuple):
    name: str  # torch's name, e.g. "float32" (the engine's and the worker's)
    oip: str | None  # the protocol's datatype, e.g. "FP32"; None: not served over OIP
    itemsize: int
    contents: str | None  # InferTensorContents field; None: raw bytes only
    numpy: bool = False  # numpy has it, by the same name (bfloat16: no)


TABLE = (
    DType("bool", "BOOL", 1, "bool_contents", True),
    DType("uint8", "UINT8", 1, "uint_contents", True),
    DType("int8", "INT8", 1, "int_contents", True),
    DType("int16", "INT16", 2, "int_contents", True),
    DType("int32", "INT32", 4, "int_contents", True),
    DType("int64", "INT64", 8, "int64_contents", True),
    DType("float16", "FP16", 2, None, True),
    DType("bfloat16", "BF16", 2, None),
    DType("float32", "FP32", 4, "fp32_contents", True),
    DType("float64", "FP64", 8, "fp64_contents", True),
    DType("uint16", None, 2, None),
    DType("uint32", None, 4, None),
    DType("uint64", None, 8, None),
    DType("complex64", None, 8, None),
    DType("complex128", None, 16, None),
)
BY_NAME = {d.name: d for d in TABLE}
BY_OIP = {d.oip: d for d in TABLE if d.oip}
NUMPY = frozenset(d.name for d in TABLE if d.numpy)  # torch names numpy holds as they are


def oip_name(dtype: str) -> str:
    """The protocol's datatype for a torch dtype name (its upper-case name when OIP has none)."""
    d = BY_NAME.get(dtype)
    return d.oip if d is not None and d.oip else dtype.upper()


def itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name; dtypes outside the table ask torch once."""
    d = BY_NAME.get(dtype)
    if d is None:
        import torch

        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        d = BY_NAME[dtype] = DType(dtype, None, size, None)
    return d.itemsize


def nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    n = itemsize(dtype)
    for d in shape:
        n *= d
    return n
