"""``quantize q8_0`` and ``quantize q4_0``: weights in GGUF's (llama.cpp's) Q8_0 and Q4_0 blocks.

Each row of a weight is cut into blocks of :data:`BLOCK` (32) inputs; a block holds one float16
scale ``d`` and 32 small integers ``q``, and stands for the values ``q * d``:

- Q8_0: ``d = amax / 127``, ``q = round(w / d)`` (half away from zero) in -127..127 (int8);
- Q4_0: ``d = m / -8`` where ``m`` is the block's value of largest magnitude (its sign kept),
  ``q = trunc(w / d + 8.5)`` clamped to 0..15, standing for ``(q - 8) * d``.

The arithmetic is ggml's reference quantizer's (``ggml-quants.c``, and the ``gguf`` package's
``gguf.quants``), in float32 step for step, so the bytes :func:`q8_0_bytes`/:func:`q4_0_bytes`
produce for a weight are the bytes ``gguf.quants.quantize`` writes for it (tested): a GGUF export
holds these layers exactly, and the model checked here is the model llama.cpp runs.

The layers save plain tensors, the same on every device: ``weight`` (Q8_0: int8, out x in; Q4_0:
uint8, out x in/2, each block's 16 bytes as GGUF orders them: byte ``j`` holds ``q[j]`` in its low
nibble and ``q[j + 16]`` in its high one), ``weight_scale`` (float16, out x in/32) and ``bias``.
Each call dequantizes the weight into the input's dtype (a block of rows at a time for a large
weight, :mod:`..common.blocked`) and runs the ordinary matmul.

>>> layer = Q8_0Linear.build(torch.linspace(-1, 1, 64).reshape(2, 32), None)
>>> layer._buffers["weight"].dtype, layer.weight_scale.dtype, tuple(layer.weight_scale.shape)
(torch.int8, torch.float16, (2, 1))
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..common import blocked
from ..common.stored_weight import StoredWeight

#: Inputs per block (GGUF's QK8_0 and QK4_0).
BLOCK = 32
#: Bytes per block in a GGUF file: the float16 scale, then the values.
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}
#: Rows quantized at a time: bounds the float32 working copy.
_CHUNK_ELEMENTS = 1 << 22


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as C's ``roundf`` (and ``gguf.quants.np_roundf``)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``1 / d``, and 0 where ``d`` is 0 (an all-zero block)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _chunks(weight: torch.Tensor):
    rows, cols = weight.shape
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield start, weight[start:start + step].detach().to(torch.float32).reshape(-1, cols // BLOCK, BLOCK)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 (out, in), d float16 (out, in/32))`` for an ``(out, in)`` float weight (read, never
    written); ``in`` must be a multiple of 32.  On meta, empty tensors of those shapes."""
    rows, cols = weight.shape
    values = torch.empty(rows, cols, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, cols // BLOCK, dtype=torch.float16, device=weight.device)
    if weight.is_meta:
        return values, scale
    for start, blocks in _chunks(weight):
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        q = _roundf(blocks * _inverse(d))
        values[start:start + len(blocks)] = q.reshape(len(blocks), cols).to(torch.int8)
        scale[start:start + len(blocks)] = d.squeeze(-1).to(torch.float16)
    return values, scale


def quantize_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 (out, in/2) in GGUF's nibble order, d float16 (out, in/32))``."""
    rows, cols = weight.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, cols // BLOCK, dtype=torch.float16, device=weight.device)
    if weight.is_meta:
        return packed, scale
    for start, blocks in _chunks(weight):
        index = blocks.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes, as numpy's
        d = torch.gather(blocks, -1, index) / -8
        q = torch.trunc(blocks * _inverse(d) + 8.5).clamp_(0, 15).to(torch.uint8)
        nibbles = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
        packed[start:start + len(blocks)] = nibbles.reshape(len(blocks), cols // 2)
        scale[start:start + len(blocks)] = d.squeeze(-1).to(torch.float16)
    return packed, scale


def unpack_q4_0(packed: torch.Tensor) -> torch.Tensor:
    """(out, in/2) packed bytes -> (out, in) values 0..15."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, -1, BLOCK // 2)
    return torch.cat((blocks & 0xF, blocks >> 4), dim=-1).reshape(rows, -1)


def block_bytes(values: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """A layer's tensors as GGUF's block bytes: ``(out, blocks * bytes per block)`` uint8 (each
    block its float16 scale, little-endian, then its values as stored)."""
    rows, groups = scale.shape
    data = values.detach().cpu().contiguous().view(torch.uint8).reshape(rows, groups, -1)
    d = scale.detach().cpu().contiguous().view(torch.uint8).reshape(rows, groups, 2)
    return torch.cat((d, data), dim=-1).reshape(rows, -1).numpy()


def from_block_bytes(data: np.ndarray, kind: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`block_bytes`: ``(values, scale)`` as a ``kind`` layer stores them."""
    per = BLOCK_BYTES[kind]
    raw = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // BLOCK, per).copy())
    scale = raw[..., :2].contiguous().view(torch.float16).reshape(rows, cols // BLOCK)
    values = raw[..., 2:].contiguous().reshape(rows, -1)
    return (values.view(torch.int8) if kind == "q8_0" else values), scale


class BlockQuantizedLinear(StoredWeight):
    """A linear layer whose weight is GGUF blocks (drop-in for ``nn.Linear``); subclasses say which."""

    #: ``"q8_0"`` or ``"q4_0"``.
    kind: str = ""
    weight_scale: torch.Tensor

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, groups = scale.shape
        self.in_features = groups * BLOCK
        self.weight_dtype = weight_dtype
        self.register_buffer("weight", values)  # saved under the key "weight"
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> BlockQuantizedLinear:
        """Quantize an ``(out, in)`` float weight (left untouched); on meta, the empty structure."""
        values, scale = cls.quantize(weight)
        return cls(values, scale, bias, weight.dtype)

    @property
    def stored_weight(self) -> torch.Tensor:
        """The stored values (saved as ``weight``)."""
        try:
            return self._buffers["weight"]
        except KeyError:  # before __init__ registered it: an AttributeError, as for any attribute
            raise AttributeError("stored_weight") from None

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight in :attr:`weight_dtype` (dequantized on each read)."""
        return self.dequantize().to(self.weight_dtype)

    def values(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the block values as signed numbers (float32, out x in)."""
        raise NotImplementedError

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the float32 weight: ``q * d``, block by block (ggml's dequantization)."""
        end = self.out_features if end is None else end
        q = self.values(start, end).reshape(end - start, -1, BLOCK)
        return (q * self.weight_scale[start:end].float()[..., None]).reshape(end - start, self.in_features)

    def gguf_bytes(self) -> np.ndarray:
        """The weight as the GGUF tensor's bytes (see :func:`block_bytes`)."""
        return block_bytes(self.stored_weight, self.weight_scale)

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` moves the stored tensors; ``.to(dtype)`` changes what :attr:`weight`
        reads as and the bias, never the stored values or their float16 scales."""
        scale = self._buffers["weight_scale"]
        super()._apply(fn, recurse)
        after = self._buffers["weight_scale"]
        if after is not None and after.dtype != scale.dtype:
            self._buffers["weight_scale"] = scale.to(after.device)
        probe = fn(torch.empty(0, dtype=self.weight_dtype, device=self._buffers["weight"].device))
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        x = input
        dtype = x.dtype if x.is_floating_point() else self.weight_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        if blocked.by_blocks(x, self.out_features, dtype, bias=self.bias):
            def cast(start: int, end: int, buffer: torch.Tensor) -> torch.Tensor:
                return buffer.copy_(self.dequantize(start, end))

            return blocked.linear_by_blocks(x, self.out_features, dtype, cast, bias=bias)
        return F.linear(x.to(dtype), self.dequantize().to(dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight={self.kind} (GGUF blocks of {BLOCK})")


class Q8_0Linear(BlockQuantizedLinear):
    """GGUF Q8_0: int8 values, one float16 scale per 32 inputs."""

    kind = "q8_0"

    @classmethod
    def quantize(cls, weight):
        return quantize_q8_0(weight)

    def values(self, start=0, end=None):
        return self.stored_weight[start:end].float()


class Q4_0Linear(BlockQuantizedLinear):
    """GGUF Q4_0: 4-bit values (two per byte) standing for ``q - 8``, one float16 scale per 32 inputs."""

    kind = "q4_0"

    @classmethod
    def quantize(cls, weight):
        return quantize_q4_0(weight)

    def values(self, start=0, end=None):
        return unpack_q4_0(self.stored_weight[start:end]).float() - 8


#: Layer class per mode.
LAYERS = {"q8_0": Q8_0Linear, "q4_0": Q4_0Linear}
