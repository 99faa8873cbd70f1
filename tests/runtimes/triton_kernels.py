"""The project's own hand-written Triton kernel: a fused bias + GELU epilogue.

Inductor writes the GPU path's kernels (runtimes/triton.py). This one is ours, small and real:
the `Linear -> GELU` epilogue of the reference MLP (and of every transformer FFN), done in one
pass over memory instead of two. The runtime does not call it yet (inductor fuses this
epilogue by itself); it is how the Triton toolchain is checked on hosts without a GPU: the
same kernel runs under TRITON_INTERPRET=1 against torch, and compiles ahead of time to PTX for
chosen GPU architectures (`compile_ahead`), with no CUDA device present.

Importing this module imports triton; import it only where triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program; a multiple of 128 keeps loads vectorised on every arch


@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, n_elements, n_cols, BLOCK: tl.constexpr):
    """out = gelu(x + bias) with the exact (erf) GELU, as torch.nn.GELU() computes it.

    `x` is a contiguous (rows, n_cols) array flattened; `bias` has n_cols elements.
    """
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    # Compute in fp32 whatever the storage dtype: erf in bf16/fp16 loses too much.
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + offsets % n_cols, mask=mask, other=0.0).to(tl.float32)
    y = x + b
    out = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))  # 0.707... = 1/sqrt(2)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x + bias) in one kernel; `bias` broadcasts over x's last dimension.

    Runs on a CUDA device, or on the host when TRITON_INTERPRET=1 was set before triton
    was imported (slow: for checking only).
    """
    if x.shape[-1:] != bias.shape:
        raise ValueError(f"bias_gelu: bias must have shape {tuple(x.shape[-1:])} (x's last "
                         f"dimension), got {tuple(bias.shape)}")
    if x.device != bias.device:
        raise ValueError(f"bias_gelu: x is on {x.device} but bias on {bias.device}")
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, BLOCK),)
        bias_gelu_kernel[grid](x, bias.contiguous(), out, n, bias.numel(), BLOCK=BLOCK)
    return out


# Triton's name for each torch dtype in a kernel signature.
_TRITON_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_ahead(arch: int, dtype: torch.dtype = torch.float32) -> dict[str, str | bytes]:
    """`bias_gelu_kernel` compiled for sm_<arch> (80 = A100, 90 = H100/H200) without a GPU.

    Returns triton's stages by name: "ttir", "ttgir", "llir", "ptx" and, when ptxas is found
    (triton bundles one), "cubin". Ahead-of-time compilation needs no CUDA device or driver,
    so it proves the kernel lowers for an architecture this host does not have.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if dtype not in _TRITON_DTYPE:
        raise ValueError(f"compile_ahead: dtype must be one of {list(_TRITON_DTYPE)}, got {dtype}")
    ptr = "*" + _TRITON_DTYPE[dtype]
    source = ASTSource(
        fn=bias_gelu_kernel,
        signature={"x_ptr": ptr, "bias_ptr": ptr, "out_ptr": ptr, "n_elements": "i32",
                   "n_cols": "i32", "BLOCK": "constexpr"},
        constexprs={"BLOCK": BLOCK},
    )
    # FP fusion (a*b+c -> fma) stated, not left to a default that changes in Triton 3.10.
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"enable_fp_fusion": True})
    return dict(compiled.asm)
