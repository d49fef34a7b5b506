"""Where ``torch._scaled_mm`` runs natively: CUDA's kernel rules, the device check, and the CPU switch.

``torch._scaled_mm`` on a CPU is permissive (it accepts layouts and sizes CUDA rejects), so the CUDA
rules are enforced here before a layer is called native.  On a CPU, native layers upcast unless
the runtime switch :data:`~transformdsl.transforms.fp8.CPU_SCALED_MM` asks for the CPU reference:

>>> with CPU_SCALED_MM.turned(True):
...     has_fp8_matmul(torch.device("cpu"))
True
>>> has_fp8_matmul(torch.device("cpu"))
False
"""

from __future__ import annotations

import functools

import torch

from ...capabilities import cuda_fp8_matmul
from . import CPU_SCALED_MM
from .numerics import NATIVE_DTYPE

# --------------------------------------------------------------------------- the CUDA rules


def cuda_scaled_mm_problems(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                            bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """What ``torch._scaled_mm`` on CUDA (cuBLASLt on sm89/sm90, CUTLASS row-wise) would reject.

    The CPU implementation accepts most of these, so a layer that passes on CPU could still
    fail on a GPU: this function is the single place the GPU rules live (torch 2.13,
    ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` and ``RowwiseScaledMM.cu``).  It only reads
    shapes, strides and dtypes, so it also works on meta tensors.

    >>> a = torch.empty(8, 40, dtype=torch.float8_e4m3fn, device="meta")
    >>> b = torch.empty(64, 40, dtype=torch.float8_e4m3fn, device="meta").t()
    >>> one = torch.empty(1, 1, device="meta")
    >>> cuda_scaled_mm_problems(a, b, one, one)
    ['inner dimension K=40 is not a multiple of 16']
    """
    problems = []
    if a.dim() != 2 or b.dim() != 2:
        return [f"operands must be 2-D matrices (got A {a.dim()}-D, B {b.dim()}-D)"]
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        return [f"shapes cannot be multiplied ({m}x{k} and {k2}x{n})"]
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if a.dtype not in fp8 or b.dtype not in fp8:
        problems.append(f"operands must be float8_e4m3fn or float8_e5m2 (got {a.dtype}, {b.dtype})")
    elif a.dtype == b.dtype == torch.float8_e5m2:
        problems.append("two float8_e5m2 operands are not supported")
    if k % 16:
        problems.append(f"inner dimension K={k} is not a multiple of 16")
    if n % 16:
        problems.append(f"outer dimension N={n} is not a multiple of 16")
    # Layout: cuBLASLt on sm90 only does row-major A times column-major B ("TN").
    if not (a.stride(1) == 1 and (m <= 1 or a.stride(0) >= k)):
        problems.append(f"A must be row-major (got strides {tuple(a.stride())})")
    if not (b.stride(0) == 1 and (n <= 1 or b.stride(1) >= k)):
        problems.append(f"B must be column-major, i.e. the transpose of a contiguous (N, K) weight "
                        f"(got strides {tuple(b.stride())})")
    problems.extend(_scale_problems(m, n, scale_a, scale_b, b, out_dtype))
    if bias is not None:
        if out_dtype == torch.float32:
            problems.append("a fused bias is not supported with a float32 output")
        elif bias.dtype != out_dtype or bias.dtype not in (torch.bfloat16, torch.float16):
            problems.append(f"the bias must be {out_dtype} like the output (got {bias.dtype})")
        if bias.dim() != 1 or bias.numel() != n:
            problems.append(f"the bias must have shape ({n},) (got {tuple(bias.shape)})")
    return problems


def _scale_problems(m: int, n: int, scale_a: torch.Tensor, scale_b: torch.Tensor, b: torch.Tensor,
                    out_dtype: torch.dtype) -> list[str]:
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        return [f"scales must be float32 (got {scale_a.dtype}, {scale_b.dtype})"]
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return []  # tensor-wise
    rowwise = (scale_a.dim() == 2 and tuple(scale_a.shape) == (m, 1) and scale_a.is_contiguous()
               and scale_b.dim() == 2 and tuple(scale_b.shape) == (1, n) and (n <= 1 or scale_b.stride(1) == 1))
    if not rowwise:
        return [f"scales must both be single values (tensor-wise) or ({m}, 1) and (1, {n}) contiguous (row-wise); "
                f"got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"]
    problems = []
    # Row-wise runs CUTLASS's f8f8bf16_rowwise on sm89 (and with cuBLAS < 12.9): bf16 out, e4m3 B.
    if out_dtype != torch.bfloat16:
        problems.append(f"row-wise scaling needs a bfloat16 output (got {out_dtype})")
    if b.dtype != torch.float8_e4m3fn:
        problems.append(f"row-wise scaling needs a float8_e4m3fn B (got {b.dtype})")
    return problems


def native_layer_problems(in_features: int, out_features: int, scaling: str, compute: torch.dtype,
                          bias: bool) -> list[str]:
    """The CUDA rules applied to the operands :class:`FP8Linear` builds for this layer shape.

    Checked on meta tensors shaped exactly as in :meth:`FP8Linear._scaled_mm_forward`, so the
    plan-time check and the runtime call cannot disagree.
    """
    return list(_native_layer_problems(in_features, out_features, scaling, compute, bias))


@functools.lru_cache(maxsize=256)
def _native_layer_problems(in_features: int, out_features: int, scaling: str, compute: torch.dtype,
                           bias: bool) -> tuple[str, ...]:
    # Cached: a model has a handful of distinct layer shapes, checked several times while planning.
    m = 16  # the token count is free; any M passes the rules
    a = torch.empty(m, in_features, dtype=NATIVE_DTYPE, device="meta")
    weight = torch.empty(out_features, in_features, dtype=NATIVE_DTYPE, device="meta")
    shape_a, shape_w = ((m, 1), (out_features, 1)) if scaling == "row" else ((1, 1), (1, 1))
    scale_a = torch.empty(shape_a, device="meta")
    scale_w = torch.empty(shape_w, device="meta")
    fused = torch.empty(out_features, dtype=compute, device="meta") if bias and fuses_bias(compute) else None
    return tuple(cuda_scaled_mm_problems(a, weight.t(), scale_a, scale_w.t(), fused, compute))


def fuses_bias(compute: torch.dtype) -> bool:
    """Whether the bias goes into the ``_scaled_mm`` epilogue (CUDA: bf16/fp16 outputs only)."""
    return compute in (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- devices


def _constant_under_compile(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (seconds) when
    this module is imported: that decorator only sets this marker, which dynamo reads when it traces
    a call (tests/test_first_hour.py checks that torch's decorator still sets the same one)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def _cuda_has_fp8_matmul(index: int) -> bool:
    """fp8 tensor cores (:func:`transformdsl.capabilities.cuda_fp8_matmul`: compute capability 8.9+, not
    ROCm, whose MI300 multiplies the *fnuz* fp8 variants these modules do not store); a constant to dynamo."""
    return cuda_fp8_matmul(index)


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether native layers run ``torch._scaled_mm`` on ``device`` (cheap; traceable by compile)."""
    if device.type == "cuda":
        return _cuda_has_fp8_matmul(device.index if device.index is not None else 0)
    return device.type == "cpu" and CPU_SCALED_MM.enabled


def device_fp8_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot run ``torch._scaled_mm`` natively, or ``None`` (for messages)."""
    if has_fp8_matmul(device):
        return None
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{index} (compute capability {major}.{minor}) has no fp8 matmul (needs 8.9+)"
    if device.type == "cpu":
        return "cpu has no fp8 matmul"
    return f"{device.type} has no fp8 matmul here"
