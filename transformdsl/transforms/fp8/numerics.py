"""fp8 numerics: scales, quantizing weights and activations to float8, and decoding them back.

Pure functions of tensors, shared by every fp8 layer (:mod:`.layers`).
"""

from __future__ import annotations

import torch


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name (``"bfloat16"``)."""
    return getattr(torch, name)


#: float8 formats by option value.
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: The format ``fp8 native`` uses for weights and activations (the one every fp8 GEMM accepts).
NATIVE_DTYPE = torch.float8_e4m3fn
#: Lower bound on ``amax`` before dividing by it: an all-zero row gets scale ~0, values 0.
_TINY = 1e-12

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
