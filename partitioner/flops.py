"""FLOPs and bytes of one aten op, from the shapes of its inputs and output.

Conventions (so tests can state hand formulas): a multiply-add is 2 FLOPs, a bias add is 1 FLOP
per output element, data movement (views, copies, indexing) is 0 FLOPs. Shapes arrive here as
plain tuples of ints: symbolic sizes were already replaced by their hints by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

Shape = tuple[int, ...]

MATMUL = {"mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "linear", "mv", "dot"}
CONV = {
    "conv1d", "conv2d", "conv3d", "convolution", "_convolution",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "mkldnn_convolution", "cudnn_convolution",
}  # fmt: skip
ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}
# Recurrent layers: every step multiplies its input and state by all weight matrices.
RNN = {"lstm", "gru", "rnn_tanh", "rnn_relu"}
# FLOPs per element of the normalised tensor (mean, centre, variance, scale, affine).
NORM = {
    "batch_norm": 4, "_native_batch_norm_legit_no_training": 4, "_native_batch_norm_legit": 4,
    "native_batch_norm": 4, "instance_norm": 8, "layer_norm": 8, "native_layer_norm": 8,
    "group_norm": 8, "native_group_norm": 8, "rms_norm": 5, "_fused_rms_norm": 5,
}  # fmt: skip
SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
REDUCTION = {
    "sum": 1, "mean": 1, "amax": 1, "amin": 1, "max": 1, "min": 1, "prod": 1, "argmax": 1,
    "argmin": 1, "any": 1, "all": 1, "cumsum": 1, "logsumexp": 4, "norm": 2,
    "linalg_vector_norm": 2, "var": 3, "std": 3, "var_mean": 3, "std_mean": 3,
}  # fmt: skip
POOL = {
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
    "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d", "avg_pool3d",
}  # fmt: skip
ADAPTIVE_POOL = {
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d",
}  # fmt: skip
# Views and metadata ops: no FLOPs and no bytes moved (they alias their input).
VIEW = {
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "expand_as",
    "squeeze", "unsqueeze", "flatten", "unflatten", "alias", "detach", "slice", "select",
    "narrow", "split", "split_with_sizes", "chunk", "unbind", "as_strided", "view_as",
    "movedim", "getitem", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
    "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size",
    "lift_fresh", "dropout", "feature_dropout", "identity",
}  # fmt: skip
# Data movement: no FLOPs, but the bytes are read and written.
COPY = {
    "clone", "contiguous", "cat", "concat", "stack", "copy", "copy_", "_to_copy", "to",
    "index", "index_select", "gather", "scatter", "embedding", "pad", "constant_pad_nd",
    "repeat", "roll", "flip", "zeros", "ones", "full", "arange", "zeros_like", "ones_like",
    "full_like", "empty", "empty_like", "new_zeros", "new_ones", "new_full", "new_empty",
    "lift_fresh_copy", "index_put", "slice_scatter", "select_scatter", "tril", "triu",
    "repeat_interleave", "masked_select", "tile", "_unsafe_index", "scalar_tensor",
}  # fmt: skip
# Elementwise ops that cost more than one FLOP per element.
TRANSCENDENTAL = {
    "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "exp": 4, "log": 4, "erf": 4, "softplus": 4,
    "mish": 8, "elu": 4, "hardswish": 3, "hardsigmoid": 2, "pow": 2, "rsqrt": 2, "sqrt": 2,
    "reciprocal": 1, "sin": 4, "cos": 4, "log_sigmoid_forward": 4,
}  # fmt: skip


def category(op: str) -> str:
    """Coarse kind of an op (matmul, conv, attention, norm, ...), used for costs and reports."""
    for name, table in (
        ("matmul", MATMUL), ("conv", CONV), ("attention", ATTENTION), ("rnn", RNN),
        ("norm", NORM), ("softmax", SOFTMAX), ("reduction", REDUCTION), ("pool", POOL),
        ("pool", ADAPTIVE_POOL), ("view", VIEW), ("copy", COPY),
    ):  # fmt: skip
        if op in table:
            return name
    return "elementwise"


def op_flops(op: str, inputs: Sequence[Shape | None], out: Shape | None, args: Sequence) -> float:  # noqa: C901 - a branch per op family
    """FLOPs of `op` given its tensor input shapes (None for non-tensors) and output shape.

    `args` are the op's positional arguments with tensors replaced by their shapes, for the ops
    whose cost depends on a flag (the `transposed` of aten.convolution).
    """
    kind = category(op)
    out_n = prod(out) if out is not None else 0
    shapes = [s for s in inputs if s is not None]
    if kind in ("view", "copy"):
        return 0.0
    if kind == "matmul":
        return _matmul_flops(op, inputs, out_n)
    if kind == "conv":
        return _conv_flops(op, inputs, out_n, args)
    if kind == "attention":
        return _attention_flops(shapes)
    if kind == "rnn" and shapes:
        # 2 FLOPs per weight per step per sequence; biases and gate math are small beside it
        weights = sum(prod(s) for s in shapes[1:] if len(s) == 2)
        return float(2 * weights * prod(shapes[0][:-1]))
    in_n = prod(shapes[0]) if shapes else out_n
    if kind == "norm":
        return float(NORM[op] * in_n)
    if kind == "softmax":
        return 5.0 * in_n
    if kind == "reduction":
        return float(REDUCTION[op] * in_n)
    if kind == "pool":
        if op in ADAPTIVE_POOL:
            return float(in_n)
        kernel = args[1] if len(args) > 1 else (1,)
        kernel = kernel if isinstance(kernel, (list, tuple)) else (kernel,)
        return float(out_n * prod(int(k) for k in kernel))
    return float(TRANSCENDENTAL.get(op, 1) * out_n)


def _matmul_flops(op: str, inputs: Sequence[Shape | None], out_n: int) -> float:
    if op in ("addmm", "baddbmm", "addbmm"):
        a, bias_add = inputs[1], out_n  # (bias, m1, m2): the bias is added once per output
    elif op == "linear":
        a, bias_add = inputs[0], out_n if len(inputs) > 2 and inputs[2] is not None else 0
    else:
        a, bias_add = inputs[0], 0
    if a is None or not a:
        return float(bias_add)
    k = a[-1]
    if op == "addbmm":  # sums over the batch: each output element takes batch * k multiply-adds
        return float(2 * out_n * k * a[0] + bias_add)
    if op == "dot":
        return float(2 * k)
    return float(2 * out_n * k + bias_add)


def _conv_flops(op: str, inputs: Sequence[Shape | None], out_n: int, args: Sequence) -> float:
    x, weight = inputs[0], inputs[1]
    has_bias = len(inputs) > 2 and inputs[2] is not None
    if x is None or weight is None:
        return 0.0
    transposed = op.startswith("conv_transpose")
    if op in ("convolution", "_convolution") and len(args) > 6:
        transposed = bool(args[6])
    # weight is [out, in/groups, *k] (or [in, out/groups, *k] when transposed): prod(weight[1:])
    # is the multiply-adds one output (or, transposed, one input) element takes.
    per_element = prod(weight[1:])
    driving = prod(x) if transposed else out_n
    return float(2 * driving * per_element + (out_n if has_bias else 0))


def _attention_flops(shapes: Sequence[Shape]) -> float:
    if len(shapes) < 3:
        return 0.0
    q, k, v = shapes[0], shapes[1], shapes[2]
    length, e = q[-2], q[-1]
    source, ev = k[-2], v[-1]
    batch = prod(q[:-2])
    scores = batch * length * source
    # Q @ K^T, softmax over the scores (max, subtract, exp, sum, divide), scores @ V
    return float(2 * scores * e + 5 * scores + 2 * scores * ev)
