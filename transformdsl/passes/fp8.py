"""``fp8 storage`` and ``fp8 native``: weights in float8, upcast per layer or multiplied natively.

``fp8 storage`` replaces each selected ``Linear``/``Conv``/``Embedding`` (and GPT-2's ``Conv1D``)
with a module that keeps its weight as a float8 *buffer* plus one float32 scale per output
channel, and upcasts the weight to the ``compute`` dtype inside ``forward``.  Keeping the
fp8 tensor as a plain buffer and doing the cast in ``forward`` (not in a hook) is what lets
``torch.compile(fullgraph=True)`` trace it; a buffer rather than a ``Parameter`` keeps
diffusers' ``ModelMixin.dtype`` (its first floating *parameter*) at the model's real dtype.

``fp8 native`` replaces each selected ``nn.Linear`` with :class:`FP8Linear` in native mode:
float8 e4m3 weight with a tensor-wise or row-wise scale, activations quantized dynamically
at every call, and ``torch._scaled_mm``.  Where that cannot run it falls back to the same
upcast as storage, and the plan says so:

- a layer whose shapes break the CUDA kernel rules (:func:`cuda_scaled_mm_problems`) is
  stored in fp8 and upcast (listed in the plan with the reason; an error with ``strict=true``);
- a device without fp8 tensor cores (CPU, CUDA before compute capability 8.9, ROCm) upcasts
  every native layer (a plan note; an error with ``strict=true``).  On CPU,
  :data:`CPU_SCALED_MM` (or :func:`cpu_scaled_mm`) runs ``torch._scaled_mm``'s CPU reference
  instead: slow, but the exact code path a GPU takes, after the CUDA rules are checked here
  (the CPU kernel itself accepts layouts and sizes that CUDA rejects).

Every module here returns its output in its *input's* dtype, so a layer can be dropped into a
model of any dtype; ``compute`` is the dtype the matmul (or convolution) runs in.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoadError
from ..options import option
from ..registry import register
from ..tree import ModuleInfo, ModuleTree, class_names
from . import _blocked
from ._stored_weight import StoredWeight
from .base import ApplyContext, Transform
from .option_rules import NativeOptions  # torch-free: `check` runs its rules
from .quantize import QUANTIZED_CLASS_NAMES

#: diffusers' layerwise-casting defaults (``diffusers.hooks.layerwise_casting.DEFAULT_SKIP_MODULES_PATTERN``
#: in diffusers 0.42: ``("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")``, matched with
#: ``re.search`` on the module path).  The words match the same names here; the anchored regexes
#: stay regexes.  Excluding a module excludes its subtree, as in diffusers.
DEFAULT_EXCEPT = ("norm", "pos_embed", "patch_embed", "re:^proj_in$", "re:^proj_out$")
#: What the model declares, as diffusers' ``enable_layerwise_casting`` honours it: its own skip
#: patterns and the modules kept in float32 (transformers' too); see ``declarations.py``.
DECLARATIONS = ("_skip_layerwise_casting_patterns", "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")

#: float8 formats by option value.
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: The format ``fp8 native`` uses for weights and activations (the one every fp8 GEMM accepts).
NATIVE_DTYPE = torch.float8_e4m3fn
#: Lower bound on ``amax`` before dividing by it: an all-zero row gets scale ~0, values 0.
_TINY = 1e-12

#: Run ``torch._scaled_mm``'s CPU reference for ``fp8 native`` layers on CPU (else upcast).
#: Read at every forward (``torch.compile`` guards on it).  See :func:`cpu_scaled_mm`.
CPU_SCALED_MM = False


@contextlib.contextmanager
def cpu_scaled_mm(enabled: bool = True):
    """Within the block, native layers on CPU run ``torch._scaled_mm``'s CPU reference.

    >>> with cpu_scaled_mm():
    ...     has_fp8_matmul(torch.device("cpu"))
    True
    >>> has_fp8_matmul(torch.device("cpu"))
    False
    """
    global CPU_SCALED_MM
    previous, CPU_SCALED_MM = CPU_SCALED_MM, enabled
    try:
        yield
    finally:
        CPU_SCALED_MM = previous


# --------------------------------------------------------------------------- quantization


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(tensor: torch.Tensor, dtype: torch.dtype, dims: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scale)`` with ``values * scale ≈ tensor``; new tensors, ``tensor`` untouched.

    ``dims`` are the dimensions reduced for one scale (``None``: one scale for the whole
    tensor); the scale keeps every dimension (size 1 where reduced) so it broadcasts.  The
    scale maps the largest magnitude onto the format's maximum, which uses the whole range
    (e4m3 saturates at ±448 and turns subnormal below 2^-6, where many unscaled weights,
    typically ~0.02, would lose bits) and keeps e5m2 (max 57344) from overflowing to inf.

    Per output channel (every dim but the first reduced) and per tensor, it runs over blocks
    of rows (:data:`_CHUNK_ELEMENTS` values), each read once for its maximum and once for the
    scaled cast while it is in cache: no full-size float32 temporaries, so peak memory is the
    output plus one block.

    >>> v, s = quantize(torch.tensor([[1.0, -2.0], [0.0, 0.5]]), torch.float8_e4m3fn, dims=(1,))
    >>> (v.float() * s).tolist()
    [[1.0, -2.0], [0.0, 0.5]]
    """
    limit = fp8_max(dtype)
    source = tensor.detach()
    per_channel = dims is not None and tuple(sorted(dims)) == tuple(range(1, source.dim()))
    if source.dim() == 0 or not source.is_contiguous() or not (per_channel or dims is None):
        return _quantize_whole(source, dtype, dims, limit)
    rows = source.reshape(source.shape[0], -1)
    step = max(1, _CHUNK_ELEMENTS // max(rows.shape[1], 1))
    blocks = [(start, min(start + step, rows.shape[0])) for start in range(0, rows.shape[0], step)]
    values = torch.empty(rows.shape, dtype=dtype, device=source.device)
    if per_channel and len(blocks) == 1:  # a small weight: the scale is the block's (no copy)
        scale = _amax_rows(rows).float().clamp_(min=_TINY).div_(limit)
        torch.div(rows, scale, out=values)
    elif per_channel:
        scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=source.device)
        for start, end in blocks:
            block = rows[start:end]
            block_scale = _amax_rows(block).float().clamp_(min=_TINY).div_(limit)
            # One pass: read the block, divide in float32 (the scale's dtype) and cast straight into
            # the output (``out=``: no float32 temporary is allocated, faulted in and copied).
            # |block / scale| <= limit up to rounding, which the cast rounds onto the limit: no clamp.
            torch.div(block, block_scale, out=values[start:end])
            scale[start:end] = block_scale
    else:
        amax = torch.stack([_amax_rows(rows[start:end]).max() for start, end in blocks]).float()
        scale = amax.max().reshape(1, 1).clamp_(min=_TINY).div_(limit)
        for start, end in blocks:
            torch.div(rows[start:end], scale, out=values[start:end])
    keep = [source.shape[0]] + [1] * (source.dim() - 1) if per_channel else [1] * source.dim()
    return values.reshape(source.shape), scale.reshape(keep)


#: Values per block of :func:`quantize` (1 MiB as float32): large enough that the per-block
#: overhead is small, small enough to stay in cache (and below malloc's mmap threshold).
_CHUNK_ELEMENTS = 1 << 18


#: Float dtypes whose magnitude is their bit pattern without the sign bit, read as an integer
#: of the same width (IEEE layout: the order of non-negative floats is that of their bits).
_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.float32: (torch.int32, 0x7FFFFFFF)}


def _amax_rows(rows: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of each row, in ``rows``' dtype: one integer reduction over the bits with
    the sign cleared (half the memory traffic of ``amax`` and ``amin`` for 16-bit weights); NaN
    stays NaN (its bits exceed infinity's), as ``amax`` propagates it."""
    bits = _MAGNITUDE_BITS.get(rows.dtype)
    if bits is None or not rows.is_contiguous():
        return torch.maximum(rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_())
    integer, mask = bits
    return rows.view(integer).bitwise_and(mask).amax(dim=1, keepdim=True).view(rows.dtype)


def _quantize_whole(t: torch.Tensor, dtype: torch.dtype, dims: tuple[int, ...] | None,
                    limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` in one piece (other reductions, e.g. GPT-2's per-column scales)."""
    t32 = t.float()
    if dims is None:
        amax = t32.abs().amax().reshape([1] * t.dim())
    else:
        amax = t32.abs().amax(dim=dims, keepdim=True)
    scale = amax.clamp(min=_TINY) / limit
    values = (t32 / scale).clamp(-limit, limit).to(dtype).contiguous()
    return values, scale.contiguous()


def quantize_activation(a: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic e4m3 quantization of a 2-D activation: row-major values and a float32 scale
    of shape (1, 1) (``tensor``) or (M, 1) (``row``), as ``torch._scaled_mm`` wants them."""
    values, scale = quantize(a, NATIVE_DTYPE, dims=(1,) if scaling == "row" else None)
    # ``quantize`` keeps the input's strides when it is dense; CUDA wants A row-major.
    return values.contiguous(), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype`` (a new tensor): the cast and the multiply fuse under compile.
    ``scale=None`` (``fp8 storage scale=none``): the plain cast.  On the CPU, e4m3 values are
    decoded through their bits (:func:`_decode_e4m3`), to the same result."""
    decoded = _decode_e4m3(values, scale, dtype)
    if decoded is not None:
        return decoded
    if scale is None:
        return values.to(dtype)
    return values.to(dtype) * scale.to(dtype)


#: e4m3 codes decoded through their bits into these dtypes: the integer type of the same width,
#: where the 7 bits of magnitude go and where the sign goes.  Read back, the bits are the value
#: times 2^-120 (the exponent biases differ by 127 - 7, and an e4m3 subnormal lands on a subnormal
#: of the wide type the same way), which the multiply by the scale puts back exactly.
_E4M3_BITS = {torch.bfloat16: (torch.int16, 4, 8), torch.float32: (torch.int32, 20, 24)}
_E4M3_UNBIAS = 2.0 ** 120
#: Bytes of upcast weight from which a linear layer upcasts and multiplies block by block.
BLOCKED_FROM = 16 << 20
#: Below this many values the few extra calls cost more than torch's own conversion saves.
_DECODE_MIN = 1 << 14
_E4M3_NAN = 0x7F


def _decode_e4m3(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``values.to(dtype) * scale``, bit for bit, where torch's float8 conversion is slow (the CPU:
    ~3 ns a value into bfloat16, 7x the integer operations here); None where it does
    not apply (another format, device or dtype, under compile, a few values, a NaN code, a
    scale so large that times 2^120 it overflows, or subnormals flushed to zero), for the plain
    conversion."""
    spec = _E4M3_BITS.get(dtype)
    if (spec is None or not isinstance(values, torch.Tensor) or values.dtype != torch.float8_e4m3fn or values.device.type != "cpu"
            or values.numel() < _DECODE_MIN or torch.compiler.is_compiling()):
        return None
    if _flushes_denormals():  # e4m3 subnormals decode to subnormals of the wide type, which would read as 0
        return None
    integer, shift, sign_shift = spec
    code = values.view(torch.uint8).to(integer)
    magnitude = code & 0x7F
    if int(magnitude.max()) == _E4M3_NAN:  # NaN codes would decode as finite values: torch's way
        return None
    factor = _E4M3_UNBIAS if scale is None else scale.to(dtype) * _E4M3_UNBIAS
    if scale is not None and not bool(torch.isfinite(factor).all()):
        return None
    bits = magnitude.bitwise_left_shift_(shift).bitwise_or_(code.bitwise_and_(0x80).bitwise_left_shift_(sign_shift))
    decoded = bits.view(dtype)
    if isinstance(factor, torch.Tensor) and torch.broadcast_shapes(decoded.shape, factor.shape) != decoded.shape:
        return decoded * factor  # a scale of more dimensions than the values (as the plain product broadcasts)
    return decoded.mul_(factor)


def _flushes_denormals() -> bool:
    """Whether this thread's CPU arithmetic reads subnormals as zero (``torch.set_flush_denormal``)."""
    return bool(torch.tensor(2.0 ** -130, dtype=torch.float32, device="cpu").mul(1.0).item() == 0.0)


#: ``fp8 storage scale=``: what one scale covers.
SCALE_MODES = ("row", "tensor", "none")


def quantize_weight(weight: torch.Tensor, dtype: torch.dtype, row_dims: tuple[int, ...],
                    mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's weight for ``fp8 storage scale=mode``: one scale per output channel (``row``,
    over ``row_dims``), one for the tensor, or none at all (diffusers' plain cast)."""
    if mode == "none":
        return weight.detach().to(dtype).contiguous(), None
    return quantize(weight, dtype, dims=None if mode == "tensor" else row_dims)


def empty_scale(shape: tuple[int, ...], channel_dim: int, mode: str, device) -> torch.Tensor | None:
    """The scale :func:`quantize_weight` returns for a weight of ``shape``, uninitialised."""
    if mode == "none":
        return None
    kept = [1] * len(shape)
    if mode == "row":
        kept[channel_dim] = shape[channel_dim]
    return torch.empty(kept, dtype=torch.float32, device=device)


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
    fused = torch.empty(out_features, dtype=compute, device="meta") if bias and _fuses_bias(compute) else None
    return tuple(cuda_scaled_mm_problems(a, weight.t(), scale_a, scale_w.t(), fused, compute))


def _fuses_bias(compute: torch.dtype) -> bool:
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
    """fp8 tensor cores: compute capability 8.9 (Ada) or 9.0+ (Hopper, Blackwell).  ROCm's
    MI300 multiplies the *fnuz* fp8 variants instead, which these modules do not store."""
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index) >= (8, 9)


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether native layers run ``torch._scaled_mm`` on ``device`` (cheap; traceable by compile)."""
    if device.type == "cuda":
        return _cuda_has_fp8_matmul(device.index if device.index is not None else 0)
    return device.type == "cpu" and CPU_SCALED_MM


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


# --------------------------------------------------------------------------- modules


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class FP8Module(StoredWeight):
    """Base of the fp8 layers: the float8 weight (:attr:`fp8_weight`, a buffer saved under the
    state-dict key ``weight``), ``weight_scale`` (float32 buffer, one value per output channel or
    per tensor, shaped to broadcast against the weight) and an optional ``bias`` (the original
    parameter, unchanged).

    State-dict keys: ``weight``, ``weight_scale`` and ``bias``, whatever the dtype, so a saved
    model reloads with ``load_state_dict(..., assign=True)`` into :meth:`empty` skeletons.

    A drop-in for the layer it replaces: model code that reads ``layer.weight`` (its dtype to
    cast inputs, its shape or device) gets the effective weight, dequantized on each read into
    :attr:`weight_dtype` (the dtype of the weight it replaced, following ``model.to(dtype)``),
    never a float8 tensor.
    """

    weight_scale: torch.Tensor

    def _init_fp8(self, weight: torch.Tensor, scale: torch.Tensor | None, bias: nn.Parameter | None,
                  compute: torch.dtype) -> None:
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = bias
        self.compute_dtype = compute
        #: The dtype of the weight this layer replaced: what :attr:`weight` reads as (the
        #: constructors set it from the source layer).
        self.weight_dtype = compute

    @property
    def fp8_weight(self) -> torch.Tensor:
        """The stored float8 weight (saved as ``weight``)."""
        try:
            return self._buffers["weight"]
        except KeyError:  # before _init_fp8: an AttributeError, as for a missing attribute
            raise AttributeError("fp8_weight") from None

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight in :attr:`weight_dtype` (a new tensor, computed on each read)."""
        return dequantize(self.fp8_weight, self.weight_scale, self.weight_dtype)

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` moves the fp8 weight and its scale; ``.to(dtype)``, ``.half()``... leave
        their dtypes alone (diffusers pipelines call ``pipe.to("cuda", torch.bfloat16)``, which
        would otherwise upcast every stored weight and round the float32 scales).  The bias
        follows the model's dtype as usual, and so does :attr:`weight_dtype`."""
        kept = {name: self._buffers[name] for name in ("weight", "weight_scale")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and before is not None and after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)  # the device move only, from the original
        probe = fn(torch.empty(0, dtype=self.weight_dtype, device=self._buffers["weight"].device))
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return self

    def upcast_weight(self) -> torch.Tensor:
        return dequantize(self.fp8_weight, self.weight_scale, self.compute_dtype)

    def _bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(dtype)

    def extra_repr(self) -> str:
        scale = "none" if self.weight_scale is None else tuple(self.weight_scale.shape)
        return (f"weight={self.fp8_weight.dtype}{tuple(self.fp8_weight.shape)}, scale={scale}, "
                f"compute={self.compute_dtype}")


class FP8Linear(FP8Module):
    """``nn.Linear`` with a float8 weight.

    ``native=False``: upcast the weight and run ``F.linear`` in ``compute``.
    ``native=True``: quantize the input (e4m3, ``scaling`` tensor/row) and run
    ``torch._scaled_mm`` where the device has an fp8 matmul, else upcast (or raise if ``strict``).
    """

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, scale: torch.Tensor,
                 bias: nn.Parameter | None, compute: torch.dtype, native: bool = False, scaling: str = "row",
                 strict: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self._init_fp8(weight, scale, bias, compute)
        self.native = native
        self.scaling = scaling
        self.strict = strict

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype, compute: torch.dtype, *, native: bool = False,
                    scaling: str = "row", strict: bool = False, scale: str = "row") -> FP8Linear:
        """Quantize ``linear``'s weight (left untouched) into a new layer.

        The weight gets one scale per output row, except a native layer with ``scaling="tensor"``
        (one scale: what tensor-wise ``_scaled_mm`` takes); ``scale`` is storage's option.
        """
        if native:
            weight, scale = quantize(linear.weight, dtype, dims=None if scaling == "tensor" else (1,))
        else:
            weight, scale = quantize_weight(linear.weight, dtype, (1,), scale)
        layer = cls(linear.in_features, linear.out_features, weight, scale, linear.bias, compute,
                    native=native, scaling=scaling, strict=strict)
        layer.weight_dtype = linear.weight.dtype
        return layer

    @classmethod
    def empty(cls, linear: nn.Module, dtype: torch.dtype, compute: torch.dtype, *, native: bool = False,
              scaling: str = "row", strict: bool = False, scale: str = "row") -> FP8Linear:
        """A skeleton on ``linear``'s device (meta when loading): shapes and dtypes only."""
        device = linear.weight.device
        weight = torch.empty(linear.out_features, linear.in_features, dtype=dtype, device=device)
        mode = "tensor" if native and scaling == "tensor" else "row" if native else scale
        scale = empty_scale(tuple(weight.shape), 0, mode, device)
        layer = cls(linear.in_features, linear.out_features, weight, scale, linear.bias, compute,
                    native=native, scaling=scaling, strict=strict)
        layer.weight_dtype = linear.weight.dtype
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        if self.native:
            if has_fp8_matmul(input.device):
                return self._scaled_mm_forward(input)
            if self.strict:
                raise RuntimeError(f"fp8 native (strict=true): {device_fp8_problem(input.device)}")
        return self._upcast_forward(input)

    def _upcast_forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.compute_dtype
        # a large weight: upcast a block of rows at a time (decoding makes integer temporaries of
        # the block's size, which then stay in cache too)
        if _blocked.by_blocks(x, self.out_features, c, BLOCKED_FROM, self.bias):
            values, scale = self.fp8_weight, self.weight_scale
            rows = scale is not None and scale.shape[0] > 1

            def upcast(start: int, end: int, _buffer) -> torch.Tensor:
                return dequantize(values[start:end], scale[start:end] if rows else scale, c)

            return _blocked.linear_by_blocks(x, self.out_features, c, upcast, self._bias(c),
                                             buffered=False).to(x.dtype)
        return F.linear(x.to(c), self.upcast_weight(), self._bias(c)).to(x.dtype)

    def _scaled_mm_forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        a = x.reshape(-1, self.in_features)
        if a.shape[0] == 0:  # amax of nothing is undefined; the product is empty anyway
            return x.new_empty(*lead, self.out_features)
        a8, scale_a = quantize_activation(a, self.scaling)
        b = self.fp8_weight.t()  # (K, N) column-major: the transpose of the contiguous (N, K) weight
        scale_b = self.weight_scale.t()  # (1, 1) or (1, N)
        fused = _fuses_bias(self.compute_dtype) and self.bias is not None
        bias = self._bias(self.compute_dtype) if fused else None
        if x.device.type != "cuda" and not torch.compiler.is_compiling():
            # The CPU kernel is permissive: hold it to the GPU's rules so what runs here runs there.
            problems = cuda_scaled_mm_problems(a8, b, scale_a, scale_b, bias, self.compute_dtype)
            if problems:
                raise RuntimeError("torch._scaled_mm operands a GPU would reject: " + "; ".join(problems))
        out = torch._scaled_mm(a8, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=self.compute_dtype)
        if self.bias is not None and not fused:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        mode = f"native, scaling={self.scaling}" if self.native else "upcast"
        return f"in_features={self.in_features}, out_features={self.out_features}, {mode}, " + super().extra_repr()


class FP8Conv(FP8Module):
    """``nn.Conv1d/2d/3d`` with a float8 weight, upcast per forward (all padding modes)."""

    def __init__(self, conv: nn.Module, weight: torch.Tensor, scale: torch.Tensor, compute: torch.dtype):
        super().__init__()
        self.dims = len(conv.kernel_size)
        for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                     "padding_mode", "_reversed_padding_repeated_twice"):
            setattr(self, name, getattr(conv, name))
        self._init_fp8(weight, scale, conv.bias, compute)
        self.weight_dtype = conv.weight.dtype

    @classmethod
    def from_conv(cls, conv: nn.Module, dtype: torch.dtype, compute: torch.dtype, scale: str = "row") -> FP8Conv:
        weight, scale = quantize_weight(conv.weight, dtype, tuple(range(1, conv.weight.dim())), scale)
        return cls(conv, weight, scale, compute)

    @classmethod
    def empty(cls, conv: nn.Module, dtype: torch.dtype, compute: torch.dtype, scale: str = "row") -> FP8Conv:
        w = conv.weight
        return cls(conv, torch.empty(w.shape, dtype=dtype, device=w.device),
                   empty_scale(tuple(w.shape), 0, scale, w.device), compute)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.ConvNd.forward's name)
        x = input
        c = self.compute_dtype
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
        padding = self.padding
        inp = x.to(c)
        if self.padding_mode != "zeros":  # as nn.ConvNd._conv_forward does
            inp = F.pad(inp, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0
        out = conv(inp, self.upcast_weight(), self._bias(c), self.stride, padding, self.dilation, self.groups)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                + super().extra_repr())


class FP8Embedding(FP8Module):
    """``nn.Embedding`` with float8 rows and one scale per row: gathers fp8 rows, then upcasts
    only those (the table is never upcast as a whole)."""

    def __init__(self, embedding: nn.Embedding, weight: torch.Tensor, scale: torch.Tensor, compute: torch.dtype):
        super().__init__()
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self._init_fp8(weight, scale, None, compute)
        self.weight_dtype = embedding.weight.dtype

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, dtype: torch.dtype, compute: torch.dtype,
                       scale: str = "row") -> FP8Embedding:
        weight, scale = quantize_weight(embedding.weight, dtype, (1,), scale)
        return cls(embedding, weight, scale, compute)

    @classmethod
    def empty(cls, embedding: nn.Embedding, dtype: torch.dtype, compute: torch.dtype,
              scale: str = "row") -> FP8Embedding:
        w = embedding.weight
        return cls(embedding, torch.empty(w.shape, dtype=dtype, device=w.device),
                   empty_scale(tuple(w.shape), 0, scale, w.device), compute)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Embedding.forward's name)
        """The rows in :attr:`weight_dtype`, as the original embedding returned them."""
        rows = F.embedding(input, self.fp8_weight)
        scale = self.weight_scale
        if scale is not None and scale.shape[0] > 1:
            scale = F.embedding(input, scale)  # the rows' own scales (a tensor-wise one broadcasts)
        return dequantize(rows, scale, self.weight_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()


class FP8Conv1D(FP8Module):
    """transformers' ``Conv1D`` (GPT-2: a linear layer with its weight stored as (in, out))."""

    def __init__(self, conv1d: nn.Module, weight: torch.Tensor, scale: torch.Tensor, compute: torch.dtype):
        super().__init__()
        self.nf = conv1d.nf
        self.nx = conv1d.weight.shape[0]
        self._init_fp8(weight, scale, conv1d.bias, compute)
        self.weight_dtype = conv1d.weight.dtype

    @classmethod
    def from_conv1d(cls, conv1d: nn.Module, dtype: torch.dtype, compute: torch.dtype,
                    scale: str = "row") -> FP8Conv1D:
        weight, scale = quantize_weight(conv1d.weight, dtype, (0,), scale)  # row: one per output column
        return cls(conv1d, weight, scale, compute)

    @classmethod
    def empty(cls, conv1d: nn.Module, dtype: torch.dtype, compute: torch.dtype, scale: str = "row") -> FP8Conv1D:
        w = conv1d.weight
        return cls(conv1d, torch.empty(w.shape, dtype=dtype, device=w.device),
                   empty_scale(tuple(w.shape), 1, scale, w.device), compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.compute_dtype
        return F.linear(x.to(c), self.upcast_weight().t(), self._bias(c)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"nx={self.nx}, nf={self.nf}, " + super().extra_repr()


# --------------------------------------------------------------------------- which layers


#: Convolutions ``fp8 storage`` converts (ConvTranspose is not: its forward takes an output size).
_CONV_CLASSES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _kind(cls: type) -> str | None:
    """The layer kind fp8 knows for this class, by the same rule as ``quantize``: ``nn.Linear``
    and its subclasses (Falcon's ``FalconLinear``...), except layers that already hold quantized
    weights (bitsandbytes'); convolutions and embeddings, and their subclasses that keep the
    base class's computation (a subclass with its own ``forward``, e.g. a causal-padding
    convolution, would lose it); GPT-2's ``Conv1D``."""
    if issubclass(cls, nn.Linear):
        return None if QUANTIZED_CLASS_NAMES.intersection(class_names(cls)) else "linear"
    for base in _CONV_CLASSES:
        if issubclass(cls, base) and _same_computation(cls, base, ("forward", "_conv_forward")):
            return "conv"
    if issubclass(cls, nn.Embedding) and _same_computation(cls, nn.Embedding, ("forward",)):
        return "embedding"
    if cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers."):
        return "conv1d"
    return None


def _same_computation(cls: type, base: type, methods: tuple[str, ...]) -> bool:
    return all(getattr(cls, name, None) is getattr(base, name, None) for name in methods)


def _weight_owners(tree: ModuleTree) -> dict[int, list[str]]:
    """id(weight tensor) → paths of the live modules holding it (to spot tied weights)."""
    owners: dict[int, list[str]] = {}
    for info in tree:
        module = info.module
        weight = module._parameters.get("weight") if module is not None else None
        if weight is not None:
            owners.setdefault(id(weight), []).append(info.path)
    return owners


def _shared_with(info: ModuleInfo, tree: ModuleTree, cache: dict) -> list[str]:
    key = id(tree)
    if cache.get("tree") != key:
        cache.clear()
        cache.update(tree=key, owners=_weight_owners(tree))
    weight = info.module._parameters.get("weight") if info.module is not None else None
    if weight is None:
        return []
    return [p for p in cache["owners"].get(id(weight), []) if p != info.path]


def _layer_reason(info: ModuleInfo, tree: ModuleTree, cache: dict, kinds: tuple[str, ...], verb: str) -> str | None:
    """Why a selected module cannot get an fp8 weight (a near miss), or ``None``."""
    if info.module is not None and isinstance(info.module, FP8Module):
        return "already has a float8 weight"
    kind = _kind(info.cls)
    if kind not in kinds:
        names = {"linear": "Linear", "conv": "Conv1d/2d/3d", "embedding": "Embedding", "conv1d": "Conv1D"}
        return f"{verb} changes {', '.join(names[k] for k in kinds)} layers, not {info.cls.__name__}"
    module = info.module
    dtype = info.facts.get("dtype") if module is None else getattr(module, "weight", None).dtype
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"weight dtype {dtype} is not float32/bfloat16/float16"
    shared = _shared_with(info, tree, cache)
    if shared:
        return f"weight is tied to {', '.join(shared[:2])}: an fp8 copy would keep both in memory"
    if kind == "embedding" and module is not None and module.max_norm is not None:
        return "Embedding with max_norm renormalises its weight in place at forward"
    return None


def _features(info: ModuleInfo) -> tuple[int, int]:
    """(in_features, out_features) of a Linear, from the live module or planning facts."""
    if info.module is not None:
        return info.module.in_features, info.module.out_features
    facts = info.facts
    if "in_features" in facts and "out_features" in facts:
        return facts["in_features"], facts["out_features"]
    out_features, in_features = facts["weight_shape"]
    return in_features, out_features


def _has_bias(info: ModuleInfo) -> bool:
    return info.module is None or info.module.bias is not None


def _model_device(tree: ModuleTree, targets: list[str]) -> torch.device | None:
    for path in [*targets, ""]:
        info = tree.get(path)
        module = info.module if info is not None else None
        if module is None:
            continue
        for tensor in module.parameters():
            # Weights still to be read (convert) are read to the CPU.
            return torch.device("cpu") if tensor.is_meta and tree.weights_pending else tensor.device
    return None


def _fp8_bytes(info: ModuleInfo, scale_values: int) -> int:
    """Bytes of the layer once converted: 1 per weight, 4 per scale, the bias unchanged."""
    shape = info.facts.get("weight_shape")
    if shape is None and info.module is not None:
        shape = tuple(info.module.weight.shape)
    if shape is None:
        return info.own_bytes
    weight = 1
    for d in shape:
        weight *= d
    bias = info.module.bias if info.module is not None and getattr(info.module, "bias", None) is not None else None
    bias_bytes = bias.numel() * bias.element_size() if bias is not None else 0
    return weight + 4 * scale_values + bias_bytes


def _channel_count(info: ModuleInfo) -> int:
    """Number of per-output-channel scales storage keeps for this layer."""
    shape = info.facts.get("weight_shape") or (tuple(info.module.weight.shape) if info.module is not None else (1,))
    return shape[1] if _kind(info.cls) == "conv1d" else shape[0]


#: The weight dtypes a layer's record may name (the dtype of the weight it replaced).
_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _with_weight_dtype(layer: FP8Module, spec: dict, path: str) -> FP8Module:
    """The layer with the weight dtype its record names (records before it was kept: the
    skeleton's dtype, which the constructor took)."""
    name = spec.get("weight_dtype")
    if name is not None:
        if name not in _WEIGHT_DTYPES:
            from ..errors import LoadError

            raise LoadError(f"fp8: the record of '{path}' names weight dtype {str(name)[:40]!r}; expected one of "
                            f"{', '.join(_WEIGHT_DTYPES)}")
        layer.weight_dtype = _WEIGHT_DTYPES[name]
    return layer


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path`` on a skeleton (loading: no undo log needed)."""
    root.set_submodule(path, module)


def _ratio_note(before: int, after: int) -> str:
    from ..explain import human_bytes

    ratio = after / before if before else 1.0
    return f"selected layers: {human_bytes(before)} → {human_bytes(after)} ({ratio:.2f}x)"


# --------------------------------------------------------------------------- fp8 storage


@dataclass(frozen=True)
class StorageOptions:
    dtype: str = option("e4m3", "float8 format of the stored weights", choices=("e4m3", "e5m2"))
    compute: str = option("bfloat16", "dtype weights are upcast to for the forward", kind="dtype")
    scale: str = option("row", "one float32 scale per output channel (row), per weight (tensor), or none "
                        "(a plain cast, as diffusers' layerwise casting)", choices=SCALE_MODES)


@register
class FP8Storage(Transform):
    verb = "fp8"
    mode = "storage"
    summary = "store weights in float8, upcast per layer at forward"
    Options = StorageOptions
    default_target = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding", "Conv1D")
    default_except = DEFAULT_EXCEPT
    honoured_declarations = DECLARATIONS
    runs_after = ("fuse *",)
    exclusive = "weights"

    KINDS = ("linear", "conv", "embedding", "conv1d")
    #: Bounds per format and metric (spec.md "Numerical guard").
    BOUNDS = {"e4m3": {"kl": 0.4, "top1": 0.3, "rms": 0.2, "max": 0.2},
              "e5m2": {"kl": 0.8, "top1": 0.4, "rms": 0.4, "max": 0.4}}

    @property
    def error_bound(self) -> dict:  # depends on the options (see Transform.error_bound)
        return self.BOUNDS[self.options.dtype]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cache: dict = {}

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        return _layer_reason(info, tree, self._cache, self.KINDS, "fp8 storage")

    def scale_count(self, info: ModuleInfo) -> int:
        """Scales kept for this layer under the ``scale`` option."""
        return {"row": _channel_count(info), "tensor": 1, "none": 0}[self.options.scale]

    def plan_effect(self, tree: ModuleTree, targets: list[str]) -> None:
        for path in targets:
            info = tree[path]
            tree.replace(path, info.cls, own_bytes=_fp8_bytes(info, self.scale_count(info)))

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        if not targets:
            return []
        fmt = FP8_DTYPES[self.options.dtype]
        before = sum(tree[p].own_bytes for p in targets)
        after = sum(_fp8_bytes(tree[p], self.scale_count(tree[p])) for p in targets)
        scales = {"row": "a float32 scale per output channel", "tensor": "one float32 scale per weight",
                  "none": "no scale (a plain cast)"}[self.options.scale]
        return [f"weights stored as {str(fmt).removeprefix('torch.')} with {scales}, "
                f"upcast to {self.options.compute} at each forward; " + _ratio_note(before, after)]

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        fmt, compute = FP8_DTYPES[self.options.dtype], _dtype(self.options.compute)
        layers = {}
        for path in ctx.progress(targets, total=len(targets), desc="fp8 storage"):
            old = ctx.root.get_submodule(path)
            kind = _kind(type(old))
            ctx.edit.replace(ctx.root, path, _convert(old, kind, fmt, compute, self.options.scale))
            layers[path] = {"kind": kind, "weight_dtype": _dtype_name(old.weight.dtype)}
        return {"format": 1, "dtype": self.options.dtype, "compute": self.options.compute,
                "scale": self.options.scale, "layers": layers}

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: Any) -> None:
        fmt, compute = FP8_DTYPES[record["dtype"]], _dtype(record["compute"])
        scale = record.get("scale", "row")  # saves from before the option are per-row
        if scale not in SCALE_MODES:
            raise LoadError(f"fp8 storage: unknown scale {str(scale)[:40]!r} in the record (expected one of "
                            f"{', '.join(SCALE_MODES)})")
        for path, spec in record["layers"].items():
            layer = _empty(root.get_submodule(path), spec["kind"], fmt, compute, scale)
            _set(root, path, _with_weight_dtype(layer, spec, path))


def _layer_class(kind: str) -> type[FP8Module]:
    """The fp8 module class for a layer kind (``linear``, ``conv``, ``embedding``, ``conv1d``)."""
    return {"linear": FP8Linear, "conv": FP8Conv, "embedding": FP8Embedding}.get(kind, FP8Conv1D)


def _convert(old: nn.Module, kind: str, fmt: torch.dtype, compute: torch.dtype, scale: str = "row") -> FP8Module:
    """A new fp8 module computed from ``old`` (which is left untouched)."""
    build = {FP8Linear: FP8Linear.from_linear, FP8Conv: FP8Conv.from_conv,
             FP8Embedding: FP8Embedding.from_embedding, FP8Conv1D: FP8Conv1D.from_conv1d}[_layer_class(kind)]
    return build(old, fmt, compute, scale=scale)


def _empty(old: nn.Module, kind: str, fmt: torch.dtype, compute: torch.dtype, scale: str = "row") -> FP8Module:
    """The same structure, nothing computed (for loading)."""
    return _layer_class(kind).empty(old, fmt, compute, scale=scale)


# --------------------------------------------------------------------------- fp8 native


@register
class FP8Native(Transform):
    verb = "fp8"
    mode = "native"
    summary = "keep fp8 weights and multiply natively with torch._scaled_mm"
    Options = NativeOptions
    default_target = ("Linear",)
    default_except = DEFAULT_EXCEPT
    honoured_declarations = DECLARATIONS
    runs_after = ("fuse *",)
    # The planner lets a statement give modules up only to one that claimed them *earlier*:
    # running first is what makes ``overrides`` take ``fp8 storage``'s shared layers.
    runs_before = ("fp8 storage",)
    exclusive = "weights"
    overrides = ("fp8 storage",)
    #: Bounds per metric (spec.md "Numerical guard"); weight and input both in e4m3.
    error_bound = {"kl": 0.4, "top1": 0.3, "rms": 0.2, "max": 0.15}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cache: dict = {}

    @property
    def compute(self) -> torch.dtype:
        return _dtype(self.options.compute)

    def layer_problems(self, info: ModuleInfo) -> list[str]:
        """Why this Linear cannot run ``torch._scaled_mm`` on a GPU (empty if it can)."""
        in_features, out_features = _features(info)
        return native_layer_problems(in_features, out_features, self.options.scaling, self.compute,
                                     _has_bias(info))

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        return _layer_reason(info, tree, self._cache, ("linear",), "fp8 native")

    def check(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        if not self.options.strict:
            return None
        problems = self.layer_problems(info)
        if problems:
            return "; ".join(problems) + " (strict=true: no upcast fallback)"
        device = _model_device(tree, [info.path])
        problem = device_fp8_problem(device) if device is not None else None
        if problem:
            return f"{problem} (strict=true: no upcast fallback)"
        return None

    def scale_count(self, info: ModuleInfo) -> int:
        """Scales kept for this layer: one per output row (row-wise, or a fallback layer) or one."""
        if self.options.scaling == "row" or self.layer_problems(info):
            return _features(info)[1]
        return 1

    def plan_effect(self, tree: ModuleTree, targets: list[str]) -> None:
        for path in targets:
            info = tree[path]
            tree.replace(path, info.cls, own_bytes=_fp8_bytes(info, self.scale_count(info)))

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        # GPT-2's projections are linear layers that are not nn.Linear: say so, never skip silently.
        conv1d = [i.path for i in tree if "Conv1D" in i.class_names and i.path not in targets]
        unhandled = ([f"{len(conv1d)} transformers Conv1D layer(s) (linear layers with a transposed weight, "
                      f"e.g. {conv1d[0]}) are not nn.Linear and do not run natively; 'fp8 storage' handles them"]
                     if conv1d else [])
        if not targets:
            return unhandled
        fallback = {p: self.layer_problems(tree[p]) for p in targets}
        fallback = {p: r for p, r in fallback.items() if r}
        native = len(targets) - len(fallback)
        notes = [f"{native} layer(s) native: torch._scaled_mm on e4m3 weights and inputs, {self.options.scaling}-wise "
                 f"scales (dynamic for inputs), {self.options.compute} output"]
        if fallback:
            shown = "; ".join(f"{p}: {', '.join(r)}" for p, r in list(fallback.items())[:4])
            more = f" (+{len(fallback) - 4} more)" if len(fallback) > 4 else ""
            notes.append(f"{len(fallback)} layer(s) cannot run torch._scaled_mm on a GPU and are stored in fp8 "
                         f"with upcast instead: {shown}{more}")
        before = sum(tree[p].own_bytes for p in targets)
        after = sum(_fp8_bytes(tree[p], self.scale_count(tree[p])) for p in targets)
        notes.append(_ratio_note(before, after))
        return unhandled + notes

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        device = _model_device(tree, targets)
        problem = device_fp8_problem(device) if device is not None and device.type != "meta" else None
        if not problem:
            return None
        hint = (" (set transformdsl.passes.fp8.CPU_SCALED_MM = True to run torch._scaled_mm's slow CPU "
                "reference instead)") if device.type == "cpu" else ""
        from ..capabilities import fp8_cost

        cost = fp8_cost() if device.type == "cpu" else None
        measured = f", measured {cost}; fp8 saves memory here, not time" if cost else ""
        return (f"fallback: {problem}; native layers upcast their fp8 weights to {self.options.compute} "
                f"on it{measured}{hint}; strict=true makes this an error")

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        layers = {}
        for path in ctx.progress(targets, total=len(targets), desc="fp8 native"):
            old = ctx.root.get_submodule(path)
            problems = native_layer_problems(old.in_features, old.out_features, self.options.scaling,
                                             self.compute, old.bias is not None)
            # A layer that cannot run natively is plain storage-with-upcast (per-row scales).
            new = FP8Linear.from_linear(old, NATIVE_DTYPE, self.compute, native=not problems,
                                        scaling=self.options.scaling, strict=self.options.strict)
            ctx.edit.replace(ctx.root, path, new)
            layers[path] = {"kind": "linear", "native": not problems, "weight_dtype": _dtype_name(old.weight.dtype)}
            if problems:
                layers[path]["fallback"] = "; ".join(problems)
        return {"format": 1, "scaling": self.options.scaling, "compute": self.options.compute,
                "strict": self.options.strict, "layers": layers}

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: Any) -> None:
        compute, scaling = _dtype(record["compute"]), record["scaling"]
        for path, spec in record["layers"].items():
            layer = FP8Linear.empty(root.get_submodule(path), NATIVE_DTYPE, compute, native=spec["native"],
                                    scaling=scaling, strict=record["strict"])
            _set(root, path, _with_weight_dtype(layer, spec, path))
