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
A call dequantizes the weight into the input's dtype (a block of rows at a time for a large
weight, :mod:`..common.blocked`) and runs the ordinary matmul, except for decoding: on a CPU with
the packed int4 kernel, inputs of at most :data:`PACKED_MAX_ROWS` rows multiply with
``aten._weight_int4pack_mm_for_cpu`` (see :data:`PACKED_INPUTS` for what that rounds), from a packed
copy made when the layer is built, loaded or moved (never saved; 0.5 byte per weight for Q4_0, 1 for
Q8_0, which is two 4-bit halves: ``q = 16 * hi + lo``).

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
from . import kernels

#: Inputs per block (GGUF's QK8_0 and QK4_0).
BLOCK = 32
#: Bytes per block in a GGUF file: the float16 scale, then the values.
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2, "q4_1": 4 + BLOCK // 2, "q5_0": 2 + 4 + BLOCK // 2,
               "q5_1": 4 + 4 + BLOCK // 2}
#: Q4_K's super-block: 256 inputs in 8 sub-blocks of 32, stored in 144 bytes (float16 ``d`` and
#: ``dmin``, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of 4-bit values).
SUPER = 256
Q4_K_BYTES = 4 + 12 + SUPER // 2
#: Q6_K's super-block: 256 inputs in 16 groups of 16, stored in 210 bytes (128 bytes of low 4 bits, 64 of high
#: 2 bits, 16 int8 group scales, the float16 ``d``).
Q6_K_BYTES = SUPER // 2 + SUPER // 4 + SUPER // 16 + 2
#: Q5_K's super-block: Q4_K's plus each value's fifth bit (32 bytes of ``qh``): 176 bytes (float16 ``d`` and
#: ``dmin``, the 12 scale bytes, ``qh``, the 128 bytes of low 4 bits).
Q5_K_BYTES = 4 + 12 + SUPER // 8 + SUPER // 2
#: Bytes per super-block, per K-quant kind.
SUPER_BYTES = {"q4_k": Q4_K_BYTES, "q5_k": Q5_K_BYTES, "q6_k": Q6_K_BYTES}
#: ggml's ``GROUP_MAX_EPS``: a group whose largest magnitude is below it quantizes to zeros.
_GROUP_MAX_EPS = 1e-15
#: Rows quantized at a time: bounds the float32 working copy.
_CHUNK_ELEMENTS = 1 << 22
#: Inputs of at most this many rows (decoding) take the packed int4 CPU kernel.  Measured against
#: dequantizing into a float32 matmul (AMD EPYC with avx512_bf16, one thread, SmolLM2's 576 x 1536
#: and a 4096 x 4096 layer): Q4_0 0.07x / 0.04x the time at one row and 0.15x / 0.10x at 8, Q8_0
#: 0.30x / 0.18x at one row; at 64 rows the kernel is no faster than the float32 matmul.
PACKED_MAX_ROWS = 8
#: Activation dtypes that take the packed kernel.  It multiplies bfloat16 activations by bfloat16
#: scales: a float32 input is rounded to bfloat16 for it (and the output back), and the float16
#: block scales are rounded to bfloat16, which puts the relative error of an output at ~0.3% of
#: the exact product of the stored blocks (measured 2.7e-3 to 3.4e-3, as a bfloat16 matmul of the
#: dequantized weight), beside the 4 or 8-bit rounding's larger one.  float16 stays exact.
PACKED_INPUTS = (torch.bfloat16, torch.float32)
#: The packed layout takes ``out_features`` in multiples of 16; other layers always dequantize.
PACKED_OUT_MULTIPLE = 16


def _rows(start: int | torch.Tensor, end: int | None):
    """The row selector of the layers' ``values``/``dequantize``: ``start:end``, or the rows an index tensor
    given as ``start`` names (an embedding's lookup: :meth:`BlockQuantizedLinear.dequantize_rows`)."""
    return start if isinstance(start, torch.Tensor) else slice(start, end)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as C's ``roundf`` (and ``gguf.quants.np_roundf``)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``1 / d``, and 0 where ``d`` is 0 (an all-zero block)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def round_activations(x: torch.Tensor, sums: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (..., in) rounded per block of 32 inputs as llama.cpp's CPU backend rounds activations
    (ggml's ``quantize_row_q8_0_ref``: ``d = amax / 127``, ``q = roundf(x / d)``, ``d`` stored as float16):
    ``(q * d`` in float32, and with ``sums`` Q8_1's block sums ``s = float16(d * sum(q))``, else None).
    What ``activations=int8`` layers compute with where no kernel of ours runs (and are tested against)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127
    q = _roundf(blocks * _inverse(d)[..., None])
    s = (q.sum(-1) * d).half().float() if sums else None
    return (q * d.half().float()[..., None]).reshape(x.shape), s


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


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 (out, in/2) in GGUF's nibble order, (d, m) float16 (out, in/32, 2))``: GGUF Q4_1, a
    block's values ``q * d + m`` with ``m`` its minimum and ``d = (max - min) / 15``."""
    rows, cols = weight.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, cols // BLOCK, 2, dtype=torch.float16, device=weight.device)
    if weight.is_meta:
        return packed, scale
    for start, blocks in _chunks(weight):
        low = blocks.amin(dim=-1, keepdim=True)
        d = (blocks.amax(dim=-1, keepdim=True) - low) / 15
        q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp_(0, 15).to(torch.uint8)
        nibbles = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
        packed[start:start + len(blocks)] = nibbles.reshape(len(blocks), cols // 2)
        scale[start:start + len(blocks)] = torch.cat((d, low), dim=-1).to(torch.float16)
    return packed, scale


def quantize_q5_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint8 (out, in/2) as Q4_0's, d float16 (out, in/32), high uint8 (out, in/32, 4))``: GGUF Q5_0,
    ``d = m / -16`` (``m`` as Q4_0's), ``q = trunc(w / d + 16.5)`` at most 31, standing for ``(q - 16) * d``; the
    low 4 bits in the nibbles, the fifth bits as each block's little-endian word ``qh`` (bit ``j``: input ``j``)."""
    rows, cols = weight.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, cols // BLOCK, dtype=torch.float16, device=weight.device)
    high = torch.empty(rows, cols // BLOCK, 4, dtype=torch.uint8, device=weight.device)
    if weight.is_meta:
        return packed, scale, high
    for start, blocks in _chunks(weight):
        index = blocks.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes, as ggml's strict <
        d = torch.gather(blocks, -1, index) / -16
        q = torch.trunc(blocks * _inverse(d) + 16.5).clamp_(0, 31).to(torch.int64)
        count = len(blocks)
        packed[start:start + count], high[start:start + count] = _pack_q5(q, cols)
        scale[start:start + count] = d.squeeze(-1).to(torch.float16)
    return packed, scale, high


def _pack_q5(q: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """5-bit values (rows, in/32, 32) int64 -> (the low 4 bits as Q4_0's nibbles (rows, in/2), each block's fifth bits
    as GGUF's little-endian ``qh`` word (rows, in/32, 4)), uint8: Q5_0's and Q5_1's layout."""
    nibbles = (q[..., :BLOCK // 2] & 0xF) | ((q[..., BLOCK // 2:] & 0xF) << 4)
    word = ((q >> 4) << torch.arange(BLOCK, device=q.device)).sum(-1, keepdim=True)
    high = (word >> torch.tensor([0, 8, 16, 24], device=q.device)) & 0xFF
    return nibbles.to(torch.uint8).reshape(len(q), cols // 2), high.to(torch.uint8)


def quantize_q5_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint8 (out, in/2) as Q4_0's, (d, m) float16 (out, in/32, 2), high uint8 (out, in/32, 4))``: GGUF
    Q5_1, a block's values ``q * d + m`` with ``m`` its minimum, ``d = (max - min) / 31`` and ``q = trunc((w - m) / d +
    0.5)``; the low 4 bits in the nibbles, the fifth bits as Q5_0's ``qh`` word (ggml's ``quantize_row_q5_1_ref``)."""
    rows, cols = weight.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, cols // BLOCK, 2, dtype=torch.float16, device=weight.device)
    high = torch.empty(rows, cols // BLOCK, 4, dtype=torch.uint8, device=weight.device)
    if weight.is_meta:
        return packed, scale, high
    for start, blocks in _chunks(weight):
        low = blocks.amin(dim=-1, keepdim=True)
        d = (blocks.amax(dim=-1, keepdim=True) - low) / 31
        q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp_(0, 31).to(torch.int64)
        count = len(blocks)
        packed[start:start + count], high[start:start + count] = _pack_q5(q, cols)
        scale[start:start + count] = torch.cat((d, low), dim=-1).to(torch.float16)
    return packed, scale, high


def unpack_q5_0(packed: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """(out, in/2) nibbles and (out, in/32, 4) fifth bits -> (out, in) values 0..31 (uint8: byte arithmetic only,
    as a prefill dequantizes every call)."""
    rows = packed.shape[0]
    # bit j of the little-endian word is bit j % 8 of byte j // 8
    bits = (high.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=high.device)) & 1
    low = unpack_q4_0(packed).reshape(rows, -1, BLOCK)
    return (low | (bits.reshape(rows, -1, BLOCK) << 4)).reshape(rows, -1)


def unpack_q4_0(packed: torch.Tensor) -> torch.Tensor:
    """(out, in/2) packed bytes -> (out, in) values 0..15."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, -1, BLOCK // 2)
    return torch.cat((blocks & 0xF, blocks >> 4), dim=-1).reshape(rows, -1)


def block_bytes(values: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """A layer's tensors as GGUF's block bytes: ``(out, blocks * bytes per block)`` uint8 (each
    block its float16 scale, little-endian, then its values as stored)."""
    rows, groups = scale.shape[:2]
    data = values.detach().cpu().contiguous().view(torch.uint8).reshape(rows, groups, -1)
    d = scale.detach().cpu().contiguous().view(torch.uint8).reshape(rows, groups, -1)  # d (and Q4_1's m)
    return torch.cat((d, data), dim=-1).reshape(rows, -1).numpy()


def from_block_bytes(data: np.ndarray, kind: str, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`block_bytes` (and of the layers' ``gguf_bytes``): the tensors a ``kind`` layer
    stores, in its constructor's order (``values, scale`` and, for Q4_K, ``sub``; Q5_K: ``sub, high``; Q5_0 and
    Q5_1: ``high``; Q6_K: ``high, sub``)."""
    if kind == "q6_k":
        raw = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // SUPER, Q6_K_BYTES).copy())
        low, high = SUPER // 2, SUPER // 2 + SUPER // 4
        return (raw[..., :low].contiguous().reshape(rows, cols // 2), raw[..., -2:].contiguous().view(torch.float16)
                .reshape(rows, cols // SUPER), raw[..., low:high].contiguous().reshape(rows, cols // 4),
                raw[..., high:-2].contiguous().view(torch.int8))
    if kind in ("q5_0", "q5_1"):  # d (and Q5_1's m), the 4 qh bytes, the 16 nibble bytes
        raw = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // BLOCK, BLOCK_BYTES[kind]).copy())
        header = 2 if kind == "q5_0" else 4
        scale = raw[..., :header].contiguous().view(torch.float16).reshape(rows, cols // BLOCK, *((2,) if header == 4 else ()))
        return (raw[..., header + 4:].contiguous().reshape(rows, cols // 2), scale,
                raw[..., header:header + 4].contiguous())
    if kind in ("q4_k", "q5_k"):
        raw = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // SUPER, SUPER_BYTES[kind])
                               .copy())
        scale = raw[..., :4].contiguous().view(torch.float16).reshape(rows, cols // SUPER, 2)
        values = raw[..., -SUPER // 2:].contiguous().reshape(rows, cols // 2)
        if kind == "q5_k":  # d, dmin, the 12 scale bytes, the 32 qh bytes, the 128 low-bit bytes
            return values, scale, raw[..., 4:16].contiguous(), raw[..., 16:48].contiguous().reshape(rows, cols // 8)
        return values, scale, raw[..., 4:16].contiguous()
    per = BLOCK_BYTES[kind]
    header = 4 if kind == "q4_1" else 2  # float16 d (and Q4_1's m) before the values
    raw = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // BLOCK, per).copy())
    scale = raw[..., :header].contiguous().view(torch.float16).reshape(rows, cols // BLOCK, *(() if header == 2 else (2,)))
    values = raw[..., header:].contiguous().reshape(rows, -1)
    return (values.view(torch.int8) if kind == "q8_0" else values), scale


def packed_kernel_available() -> bool:
    """Whether this torch has the packed int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``)."""
    from ...capabilities import packed_cpu_kernels

    return "int4" in packed_cpu_kernels()


def _int4pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One operand of the packed kernel, which multiplies by ``(codes - 8) * scale + zero`` per
    block: ``codes`` 0..15 (out x in), ``scale``/``zero`` float32 (out x in/32)."""
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return weight, torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()


class _PackedLayout:
    """The packed kernel's operands for one layer (not tensor attributes: never saved)."""

    def __init__(self):
        #: The stored tensor they were made from (a loader that replaces it makes them stale).
        self.source: torch.Tensor | None = None
        #: ``(weight, scales_and_zeros)`` per part: the layer's output is their products' sum.
        self.parts: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


class BlockQuantizedLinear(StoredWeight):
    """A linear layer whose weight is GGUF blocks (drop-in for ``nn.Linear``); subclasses say which."""

    #: ``"q8_0"``, ``"q4_0"``, ``"q4_1"`` or ``"q4_k"``.
    kind: str = ""
    #: ``"float"``: inputs multiply the stored blocks as they are (the exact product); ``"int8"``
    #: (``quantize q4_0 activations=int8``; q8_0, q4_0, q4_1, q5_0): rounded first per 32 inputs, as llama.cpp
    #: rounds them (:func:`round_activations`), then multiplied as integers where our kernel runs.
    activations: str = "float"
    #: Inputs per entry along ``weight_scale``'s second dimension: a block (Q4_K: a super-block).
    block_inputs: int = BLOCK
    weight_scale: torch.Tensor

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 weight_dtype: torch.dtype = torch.float32, extra: dict[str, torch.Tensor] | None = None):
        """``extra``: more stored tensors a kind keeps (registered before the packed operands are made)."""
        super().__init__()
        self.out_features, groups = scale.shape[:2]
        self.in_features = groups * self.block_inputs
        self.weight_dtype = weight_dtype
        self.register_buffer("weight", values)  # saved under the key "weight"
        self.register_buffer("weight_scale", scale)
        for name, tensor in (extra or {}).items():
            self.register_buffer(name, tensor)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._packed = _PackedLayout()
        self.register_load_state_dict_post_hook(lambda module, _: module.repack())
        self.repack()

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def pack(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The packed kernel's operands for the stored blocks (see :class:`_PackedLayout`)."""
        raise NotImplementedError

    def repack(self) -> None:
        """Make the packed operands from the stored tensors (after build, load and moves); none
        where the kernel is missing, the layer is not on the CPU or its shape does not fit."""
        layout = self._packed
        stored = self._buffers["weight"]
        layout.source, layout.parts = stored, ()
        #: Whether decode-sized inputs take our kernel (:mod:`.kernels`), which reads the stored blocks
        #: themselves: then no packed copy is made.
        self._row_limit = PACKED_MAX_ROWS * self.in_features
        self.row_kernel = (self.kind in kernels.BLOCK_KINDS and stored.device.type == "cpu"
                           and not stored.is_meta and stored.is_contiguous()
                           and all(self._buffers[name].is_contiguous() for name in self._buffers if name != "weight")
                           and kernels.available())
        if (self.row_kernel or stored.is_meta or stored.device.type != "cpu"
                or self.out_features % PACKED_OUT_MULTIPLE or not packed_kernel_available()):
            return
        layout.parts = self.pack()

    @property
    def packed_kernel(self) -> bool:
        """Whether decode-sized inputs multiply with the packed CPU kernel."""
        return bool(self._packed.parts)

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
        return self._scaled(start, end)

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 rows an integer tensor names, ``(len(index), in)`` (what a tied embedding looks up:
        :class:`BlockEmbedding`), dequantized as :meth:`dequantize` does."""
        return self.dequantize(index)

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
        if self._packed.source is not self._buffers["weight"]:
            self.repack()
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        x = input
        layout = self._packed
        if not torch.compiler.is_compiling() and layout.source is not self._buffers["weight"]:
            self.repack()  # the stored tensors were replaced (a loader that assigns them directly)
        if (self.row_kernel and x.numel() <= self._row_limit and x.is_floating_point() and x.device.type == "cpu"
                and not (x.requires_grad and torch.is_grad_enabled())):  # the kernel has no derivative
            # decoding: the blocks read as stored (kernels/rows.c), float32 activations (the exact product) or
            # activations=int8's integer products
            return self._row_product(x)
        if self.activations == "int8":
            return self._int8_forward(x)
        if (layout.parts and x.dtype in PACKED_INPUTS and x.device.type == "cpu"
                and x.numel() <= PACKED_MAX_ROWS * self.in_features
                and not (torch.is_grad_enabled() and x.requires_grad)):  # the kernel has no derivative
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            out = None
            for weight, scales_and_zeros in layout.parts:  # summed in float32
                part = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, BLOCK, scales_and_zeros).float()
                out = part if out is None else out.add_(part)
            if self.bias is not None:
                out = out.add_(self.bias)
            return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        dtype = x.dtype if x.is_floating_point() else self.weight_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        if blocked.by_blocks(x, self.out_features, dtype, bias=self.bias):
            def cast(start: int, end: int, buffer: torch.Tensor) -> torch.Tensor:
                return buffer.copy_(self.dequantize(start, end))

            return blocked.linear_by_blocks(x, self.out_features, dtype, cast, bias=bias)
        return F.linear(x.to(dtype), self.dequantize().to(dtype), bias)

    def _row_product(self, x: torch.Tensor) -> torch.Tensor:
        """Our decode kernel on ``x`` (a few rows): the stored blocks as they are."""
        return kernels.rows(self.kind, x, self._buffers["weight"], self._buffers["weight_scale"], self.bias,
                            activations=self.activations)

    def _int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``activations=int8`` where our integer kernel does not run (larger inputs such as a prefill, other
        devices, machines without the kernels): the same arithmetic in float32 (within its rounding)."""
        rounded, sums = round_activations(x, sums=self.kind == "q4_1")
        bias = None if self.bias is None else self.bias.float()
        if blocked.by_blocks(rounded, self.out_features, torch.float32, bias=self.bias):
            def cast(start: int, end: int, buffer: torch.Tensor) -> torch.Tensor:
                return buffer.copy_(self._scaled(start, end))

            out = blocked.linear_by_blocks(rounded, self.out_features, torch.float32, cast, bias=bias)
        else:
            out = F.linear(rounded, self._scaled(), bias)
        if sums is not None:  # Q4_1's minimum times Q8_1's block sums of x, as ggml's vec_dot_q4_1_q8_1
            out = out + sums @ self.weight_scale[..., 1].float().T
        return out.to(x.dtype) if x.is_floating_point() else out

    def _scaled(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of ``q * d`` (float32): the weight without Q4_1's minimum."""
        values = self.values(start, end)
        count = values.shape[0]
        q = values.reshape(count, -1, BLOCK)
        d = self.weight_scale[_rows(start, end)].float()
        d = d[..., 0] if d.dim() == 3 else d
        return (q * d[..., None]).reshape(count, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight={self.kind} (GGUF blocks of {BLOCK}), "
                f"activations={self.activations}, packed_kernel={self.packed_kernel}, row_kernel={self.row_kernel}")


class Q8_0Linear(BlockQuantizedLinear):
    """GGUF Q8_0: int8 values, one float16 scale per 32 inputs."""

    kind = "q8_0"

    @classmethod
    def quantize(cls, weight):
        return quantize_q8_0(weight)

    def values(self, start=0, end=None):
        return self.stored_weight[_rows(start, end)].float()

    def pack(self):
        q = self.stored_weight.to(torch.int32)
        low = q & 0xF  # q = 16 * high + low: high -8..7 (stored as 0..15 standing for -8..7), low 0..15
        high = (q - low) // 16 + 8
        d = self.weight_scale.float()
        # 16d * (high - 8) + (d * (low - 8) + 8d) = d * q; bfloat16(16d) and bfloat16(8d) are 16 and 8
        # times bfloat16(d), so both parts round the block's scale the same way
        return (_int4pack(high, 16 * d, torch.zeros_like(d)), _int4pack(low, d, 8 * d))


class Q4_0Linear(BlockQuantizedLinear):
    """GGUF Q4_0: 4-bit values (two per byte) standing for ``q - 8``, one float16 scale per 32 inputs."""

    kind = "q4_0"

    @classmethod
    def quantize(cls, weight):
        return quantize_q4_0(weight)

    def values(self, start=0, end=None):
        return unpack_q4_0(self.stored_weight[_rows(start, end)]).float() - 8

    def pack(self):
        d = self.weight_scale.float()
        return (_int4pack(unpack_q4_0(self.stored_weight), d, torch.zeros_like(d)),)


class Q4_1Linear(BlockQuantizedLinear):
    """GGUF Q4_1: 4-bit values (two per byte, as Q4_0's) standing for ``q * d + m``; per 32 inputs a float16
    ``d`` and ``m`` (``weight_scale``: out x in/32 x 2)."""

    kind = "q4_1"

    @classmethod
    def quantize(cls, weight):
        return quantize_q4_1(weight)

    def values(self, start=0, end=None):
        return unpack_q4_0(self.stored_weight[_rows(start, end)]).float()

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        m = self.weight_scale[_rows(start, end)][:, :, 1].float()
        scaled = self._scaled(start, end)
        return (scaled.reshape(scaled.shape[0], -1, BLOCK) + m[..., None]).reshape(scaled.shape[0], self.in_features)

    def pack(self):
        d, m = self.weight_scale.float().unbind(-1)
        return (_int4pack(unpack_q4_0(self.stored_weight), d, m + 8 * d),)  # (q - 8) * d + (m + 8d)


def _nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int``, bit for bit: add 1.5 * 2^23 in float32 and read the low mantissa bits
    (round half to even within 2^22; past that, the same bits ggml gets)."""
    bits = (x + 12582912.0).view(torch.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _over(value: float, tensor: torch.Tensor) -> torch.Tensor:
    """``value / tensor`` divided in float32 as C divides (torch computes a scalar over a tensor as a
    reciprocal times the scalar, which differs in the last bit for a quarter of the values)."""
    return torch.full_like(tensor, value) / tensor


def _make_qkx2_quants(x: torch.Tensor, weights: torch.Tensor, nmax: int = 15, rmin: float = -1.0,
                      nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's ``make_qkx2_quants(32, nmax, x, weights, L, &the_min, Laux, rmin, 0.1, nstep, false)`` for every
    sub-block at once (``x``, ``weights``: (B, 32) float32): ``(scale (B,), the_min (B,), L (B, 32) int32)``.
    Q4_K calls it with ``(15, -1, 20)``, Q5_K with ``(31, -0.5, 15)``.

    Every sum runs in ggml's order, one input at a time, each product and sum rounded to float32 as C
    computes it (ggml-base is built without FMA contraction), so the search picks what ggml picks.  The
    inputs are held transposed, (32, B): input ``i`` of every sub-block is one contiguous row."""
    x, weights = x.t().contiguous(), weights.t().contiguous()
    n = x.shape[0]
    low, high = x[0].clone(), x[0].clone()
    sum_w = weights[0].clone()
    sum_x = sum_w * x[0]
    for i in range(1, n):
        xi, w = x[i], weights[i]
        low = torch.where(xi < low, xi, low)
        high = torch.where(xi > high, xi, high)
        sum_w = sum_w + w
        sum_x = sum_x + w * xi
    low = torch.where(low > 0, torch.zeros_like(low), low)
    flat = high == low
    spread = torch.where(flat, torch.ones_like(high), high - low)
    iscale = _over(float(nmax), spread)
    scale = _over(1.0, iscale)
    levels = _nearest_int(iscale * (x - low)).clamp_(0, nmax)
    best = torch.zeros_like(scale)
    for i in range(n):
        diff = scale * levels[i].float() + low - x[i]
        best = best + weights[i] * (diff * diff)
    for step in range(nstep + 1):
        # ggml divides by ``max - min`` with the best ``min`` found so far, not the first one
        spread = torch.where(flat, torch.ones_like(high), high - low)
        factor = np.float32(rmin) + np.float32(0.1) * np.float32(step) + np.float32(nmax)
        aux = _nearest_int(_over(float(factor), spread) * (x - low)).clamp_(0, nmax)
        levels_f = aux.float()
        sum_l = torch.zeros_like(scale)
        sum_l2 = torch.zeros_like(scale)
        sum_xl = torch.zeros_like(scale)
        for i in range(n):
            w_l = weights[i] * levels_f[i]
            sum_l = sum_l + w_l
            sum_l2 = sum_l2 + w_l * levels_f[i]
            sum_xl = sum_xl + w_l * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        error = torch.zeros_like(scale)
        for i in range(n):
            diff = this_scale * levels_f[i] + this_min - x[i]
            error = error + weights[i] * (diff * diff)
        better = (det > 0) & (error < best)
        levels = torch.where(better, aux, levels)
        best = torch.where(better, error, best)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_min, low)
    levels = torch.where(flat, torch.zeros_like(levels), levels)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -low, levels.t()


def quantize_q4_k(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values uint8 (out, in/2), d and dmin float16 (out, in/256, 2), packed 6-bit scales uint8
    (out, in/256, 12))`` for an ``(out, in)`` float weight, ``in`` a multiple of 256: ggml's reference
    quantizer (``quantize_row_q4_K_ref``, what llama.cpp's ``llama-quantize`` runs without an importance
    matrix), step for step in float32.  On meta, empty tensors of those shapes."""
    levels, scale, sub = _quantize_k(weight, 15, -1.0, 20)
    rows, cols = weight.shape
    if weight.is_meta:
        return torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device), scale, sub
    pairs = levels.reshape(rows, -1, 4, 2, BLOCK)  # (sub-blocks 2c, 2c + 1) of each 64 inputs: one byte each
    return (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, cols // 2), scale, sub


def quantize_q5_k(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(low 4 bits uint8 (out, in/2) as Q4_K's values, d and dmin float16 (out, in/256, 2), packed 6-bit scales
    uint8 (out, in/256, 12), fifth bits uint8 (out, in/8: each super-block's 32 ``qh`` bytes, bit ``s`` of byte
    ``l`` for input ``32 s + l``))``: ggml's reference quantizer (``quantize_row_q5_K_ref``: Q4_K's search with
    31 levels, ``rmin = -0.5`` and 15 steps), step for step in float32.  On meta, empty tensors of those shapes."""
    levels, scale, sub = _quantize_k(weight, 31, -0.5, 15)
    rows, cols = weight.shape
    if weight.is_meta:
        return (torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device), scale, sub,
                torch.empty(rows, cols // 8, dtype=torch.uint8, device=weight.device))
    blocks = levels.reshape(rows, -1, 8, BLOCK)
    pairs = (blocks & 0xF).reshape(rows, -1, 4, 2, BLOCK)
    low = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, cols // 2)
    shifts = torch.arange(8, dtype=torch.uint8, device=weight.device)[:, None]
    high = ((blocks >> 4) << shifts).sum(dim=2, dtype=torch.uint8)  # bits of distinct places: a sum is an or
    return low, scale, sub, high.reshape(rows, cols // 8)


def _quantize_k(weight: torch.Tensor, nmax: int, rmin: float, nstep: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's shared reference steps: ``(levels uint8 (out, in) in 0..nmax, d and dmin float16
    (out, in/256, 2), packed 6-bit scales uint8 (out, in/256, 12))``; on meta, levels is None."""
    rows, cols = weight.shape
    supers = cols // SUPER
    scale = torch.empty(rows, supers, 2, dtype=torch.float16, device=weight.device)
    sub = torch.empty(rows, supers, 12, dtype=torch.uint8, device=weight.device)
    if weight.is_meta:
        return None, scale, sub
    values = torch.empty(rows, cols, dtype=torch.uint8, device=weight.device)
    step = max(1, (_CHUNK_ELEMENTS // 4) // max(cols, 1))
    for start in range(0, rows, step):
        x = weight[start:start + step].detach().to(torch.float32).reshape(-1, BLOCK)  # (sub-blocks, 32)
        count = x.shape[0] // (SUPER // BLOCK)
        sum_x2 = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        for i in range(BLOCK):
            sum_x2 = sum_x2 + x[:, i] * x[:, i]
        # sqrtf, correctly rounded: torch's float32 sqrt is not (seen 1 ulp off), a float64 one rounded is
        weights = torch.sqrt((sum_x2 / 32).double()).float()[:, None] + x.abs()
        scales, mins, levels = _make_qkx2_quants(x, weights, nmax, rmin, nstep)
        scales, mins = scales.reshape(count, 8), mins.reshape(count, 8)
        # C starts both at +0 and takes a value only if it is larger: never -0, never below 0
        max_scale = scales.amax(dim=1)
        max_scale = torch.where(max_scale > 0, max_scale, torch.zeros_like(max_scale))
        max_min = mins.amax(dim=1)
        max_min = torch.where(max_min > 0, max_min, torch.zeros_like(max_min))
        inv_scale = torch.where(max_scale > 0, _over(63.0, max_scale), torch.zeros_like(max_scale))
        inv_min = torch.where(max_min > 0, _over(63.0, max_min), torch.zeros_like(max_min))
        # uint8 of an int, then at most 63, as C's ``uint8_t ls = nearest_int(...); ls = MIN(63, ls)``
        ls = (_nearest_int(inv_scale[:, None] * scales) & 0xFF).clamp_(max=63)
        lm = (_nearest_int(inv_min[:, None] * mins) & 0xFF).clamp_(max=63)
        d = (max_scale / 63.0).to(torch.float16)
        dmin = (max_min / 63.0).to(torch.float16)
        packed = torch.empty(count, 12, dtype=torch.int32, device=x.device)
        packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
        packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
        packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
        # the final values on the rounded scales; a sub-block whose scale rounds to 0 keeps the search's
        multiplier = d.float()[:, None] * ls.float()
        offset = dmin.float()[:, None] * lm.float()
        blocks = x.reshape(count, 8, BLOCK)
        final = _nearest_int((blocks + offset[..., None]) / multiplier[..., None]).clamp_(0, nmax)
        levels = torch.where((multiplier != 0)[..., None], final, levels.reshape(count, 8, BLOCK))
        end = start + count // supers
        values[start:end] = levels.to(torch.uint8).reshape(end - start, cols)
        scale[start:end] = torch.stack((d, dmin), dim=-1).reshape(end - start, supers, 2)
        sub[start:end] = packed.to(torch.uint8).reshape(end - start, supers, 12)
    return values, scale, sub


def q4_k_scales(sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit sub-block scales and mins ``(sc, m)``, each (..., 8) uint8, from Q4_K's 12 packed bytes
    (..., 12): ggml's ``get_scale_min_k4``, as ``gguf.quants.Q4_K.get_scale_min`` unpacks them."""
    d, m, md = sub[..., 0:4], sub[..., 4:8], sub[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mins


class Q4_KLinear(BlockQuantizedLinear):
    """GGUF Q4_K, as a GGUF file holds it (llama.cpp's ``Q4_K_M``/``Q4_K_S`` files are mostly Q4_K).

    Each row is cut into super-blocks of 256 inputs, each into 8 sub-blocks of 32 that stand for
    ``d * sc * q - dmin * m`` (``q`` 0..15; ``sc``, ``m`` 6-bit per sub-block; ``d``, ``dmin`` float16 per
    super-block).  Stored as GGUF orders them: ``weight`` uint8 (out x in/2: each super-block's 128 value
    bytes, byte ``j`` of a 32-byte chunk holding sub-block ``2c``'s ``q[j]`` low and ``2c+1``'s high),
    ``weight_scale`` float16 (out x in/256 x 2: ``d``, ``dmin``), ``weight_sub`` uint8 (out x in/256 x 12).

    Built by :func:`quantize_q4_k` (llama.cpp's reference quantizer, byte for byte) or read from a GGUF
    file (``load("file.gguf")``); either way ``format="gguf"`` writes the bytes as they are.
    """

    kind = "q4_k"
    block_inputs = SUPER
    weight_sub: torch.Tensor

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor, bias: torch.Tensor | None,
                 weight_dtype: torch.dtype = torch.float32):
        super().__init__(values, scale, bias, weight_dtype, extra={"weight_sub": sub})

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Q4_KLinear:
        """Quantize an ``(out, in)`` float weight (left untouched) with ggml's reference quantizer; on
        meta, the empty structure."""
        return cls(*quantize_q4_k(weight), bias, weight.dtype)

    def _codes(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the 4-bit values, (rows, in/256, 8, 32) uint8 in input order."""
        packed = self.stored_weight[_rows(start, end)]
        chunks = packed.reshape(packed.shape[0], -1, 4, 1, BLOCK)
        return torch.cat((chunks & 0xF, chunks >> 4), dim=3).reshape(packed.shape[0], -1, 8, BLOCK)

    def _scales(self, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start:end``: each sub-block's multiplier ``d * sc`` and offset ``dmin * m``, float32
        (rows, in/256, 8), computed as ggml (and the gguf package) computes them."""
        sc, mins = q4_k_scales(self.weight_sub[_rows(start, end)])
        scale = self.weight_scale[_rows(start, end)].float()
        return scale[..., :1] * sc.float(), scale[..., 1:] * mins.float()

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the float32 weight: ``(d * sc) * q - dmin * m``, sub-block by sub-block."""
        multiplier, offset = self._scales(start, end)
        out = multiplier[..., None] * self._codes(start, end).float() - offset[..., None]
        return out.reshape(out.shape[0], self.in_features)

    def values(self, start=0, end=None):
        raise NotImplementedError("Q4_K values have an offset per sub-block; use dequantize()")

    def _row_product(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return kernels.q4_k(x, buffers["weight"], buffers["weight_scale"], buffers["weight_sub"], self.bias)

    def pack(self):
        # the kernel multiplies by (q - 8) * scale + zero: scale = d * sc, zero = 8 * d * sc - dmin * m
        multiplier, offset = self._scales()
        scale = multiplier.reshape(self.out_features, -1)
        codes = self._codes().reshape(self.out_features, self.in_features)
        return (_int4pack(codes, scale, 8 * scale - offset.reshape(self.out_features, -1)),)

    def gguf_bytes(self) -> np.ndarray:
        """The weight as the GGUF tensor's bytes: per super-block ``d``, ``dmin``, the 12 scale bytes, the
        128 value bytes."""
        rows, supers, _ = self.weight_scale.shape
        d = self.weight_scale.detach().cpu().contiguous().view(torch.uint8).reshape(rows, supers, 4)
        values = self.stored_weight.detach().cpu().reshape(rows, supers, SUPER // 2)
        return torch.cat((d, self.weight_sub.detach().cpu(), values), dim=-1).reshape(rows, -1).numpy()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=q4_k (GGUF super-blocks of {SUPER}), "
                f"packed_kernel={self.packed_kernel}")


class Q5_KLinear(Q4_KLinear):
    """GGUF Q5_K, as a GGUF file holds it (llama.cpp's ``Q5_K_M``/``Q5_K_S`` files are mostly Q5_K): Q4_K's
    super-blocks with a fifth bit per value, standing for ``d * sc * q - dmin * m`` with ``q`` 0..31.

    Stored as GGUF orders them: ``weight`` uint8 (out x in/2: the low 4 bits, as Q4_K's values),
    ``weight_scale`` float16 (out x in/256 x 2: ``d``, ``dmin``), ``weight_sub`` uint8 (out x in/256 x 12: the
    packed 6-bit scales and mins, as Q4_K's), ``weight_high`` uint8 (out x in/8: each super-block's 32 ``qh``
    bytes, bit ``s`` of byte ``l`` the fifth bit of input ``32 s + l``).  Built by :func:`quantize_q5_k` (llama.cpp's
    reference quantizer, byte for byte) or read from a GGUF file; ``format="gguf"`` writes the bytes as they are.
    No packed-kernel fallback (5-bit values would take two packed copies): where our kernel does not run, a call
    dequantizes.
    """

    kind = "q5_k"
    weight_high: torch.Tensor

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor, high: torch.Tensor,
                 bias: torch.Tensor | None, weight_dtype: torch.dtype = torch.float32):
        BlockQuantizedLinear.__init__(self, values, scale, bias, weight_dtype,
                                      extra={"weight_sub": sub, "weight_high": high})

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Q5_KLinear:
        """Quantize an ``(out, in)`` float weight (left untouched) with ggml's reference quantizer; on meta, the
        empty structure."""
        return cls(*quantize_q5_k(weight), bias, weight.dtype)

    def _codes(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the 5-bit values, (rows, in/256, 8, 32) uint8 in input order."""
        low = super()._codes(start, end)
        high = self.weight_high[_rows(start, end)].reshape(low.shape[0], -1, 1, BLOCK)
        shifts = torch.arange(8, dtype=torch.uint8, device=high.device)[:, None]
        return low | (((high >> shifts) & 1) << 4)

    def values(self, start=0, end=None):
        raise NotImplementedError("Q5_K values have an offset per sub-block; use dequantize()")

    def _row_product(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return kernels.q5_k(x, buffers["weight"], buffers["weight_scale"], buffers["weight_sub"],
                            buffers["weight_high"], self.bias)

    def pack(self):
        return ()

    def gguf_bytes(self) -> np.ndarray:
        """The weight as the GGUF tensor's bytes: per super-block ``d``, ``dmin``, the 12 scale bytes, the 32
        ``qh`` bytes, the 128 low-bit bytes."""
        rows, supers, _ = self.weight_scale.shape
        d = self.weight_scale.detach().cpu().contiguous().view(torch.uint8).reshape(rows, supers, 4)
        parts = (d, self.weight_sub.detach().cpu(), self.weight_high.detach().cpu().reshape(rows, supers, SUPER // 8),
                 self.stored_weight.detach().cpu().reshape(rows, supers, SUPER // 2))
        return torch.cat(parts, dim=-1).reshape(rows, -1).numpy()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=q5_k (GGUF super-blocks of {SUPER}), "
                f"row_kernel={self.row_kernel}")


class Q5_0Linear(BlockQuantizedLinear):
    """GGUF Q5_0: Q4_0's nibbles plus a fifth bit each, standing for ``(q - 16) * d``: ``weight`` uint8 (out x in/2,
    as Q4_0's), ``weight_scale`` float16 (out x in/32), ``weight_high`` uint8 (out x in/32 x 4: each block's fifth
    bits as GGUF's little-endian ``qh`` word, bit ``j`` for input ``j``).  The fallback type llama.cpp writes
    for a Q4_K tensor whose width is no multiple of 256 (most of SmolLM2's projections in a ``Q4_K_M`` file)."""

    kind = "q5_0"
    weight_high: torch.Tensor

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, high: torch.Tensor, bias: torch.Tensor | None,
                 weight_dtype: torch.dtype = torch.float32):
        super().__init__(values, scale, bias, weight_dtype, extra={"weight_high": high})

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Q5_0Linear:
        """Quantize an ``(out, in)`` float weight (left untouched) as ggml's reference quantizer does; on meta,
        the empty structure."""
        return cls(*quantize_q5_0(weight), bias, weight.dtype)

    def values(self, start=0, end=None):
        rows = _rows(start, end)
        return unpack_q5_0(self.stored_weight[rows], self.weight_high[rows]).float() - 16

    def _row_product(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return kernels.q5_0(x, buffers["weight"], buffers["weight_scale"], buffers["weight_high"], self.bias,
                            self.activations)

    def pack(self):
        # q = 16 * h + low (h: the fifth bit): (h + 8 - 8) * 16d - 8d, plus (low - 8) * d; each part centred on 0
        # (a part's bfloat16 rounding is relative to its size), and both round d alike
        q = unpack_q5_0(self.stored_weight, self.weight_high)
        d = self.weight_scale.float()
        return (_int4pack((q >> 4) + 8, 16 * d, -8 * d), _int4pack(q & 0xF, d, torch.zeros_like(d)))

    def gguf_bytes(self) -> np.ndarray:
        """The weight as the GGUF tensor's bytes: per block ``d``, the 4 ``qh`` bytes, the 16 nibble bytes."""
        rows, groups = self.weight_scale.shape
        d = self.weight_scale.detach().cpu().contiguous().view(torch.uint8).reshape(rows, groups, 2)
        values = self.stored_weight.detach().cpu().reshape(rows, groups, BLOCK // 2)
        return torch.cat((d, self.weight_high.detach().cpu(), values), dim=-1).reshape(rows, -1).numpy()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=q5_0 (GGUF blocks of {BLOCK}), "
                f"packed_kernel={self.packed_kernel}, row_kernel={self.row_kernel}")


def _make_qx_quants(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's ``make_qx_quants(16, 32, x, L, 1, NULL)`` (Q6_K's search, weights ``x * x``) for every group at
    once (``x``: (G, 16) float32): ``(scale (G,), L (G, 16) int64, 0..63)``, every sum in ggml's order, each
    product and sum rounded to float32 as C computes it (no FMA contraction)."""
    nmax = 32
    x = x.t().contiguous()  # (16, G): input i of every group one contiguous row
    n = x.shape[0]
    magnitude = x.abs()
    index = magnitude.argmax(dim=0, keepdim=True)  # the first of equal magnitudes (ggml's strict >)
    peak = torch.gather(x, 0, index).squeeze(0)
    amax = torch.gather(magnitude, 0, index).squeeze(0)
    zero = amax < _GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    weights = x * x

    def search(iscale):
        levels = _nearest_int(iscale * x).clamp_(-nmax, nmax - 1)
        levels_f = levels.float()
        sum_lx = torch.zeros_like(iscale)
        sum_l2 = torch.zeros_like(iscale)
        for i in range(n):
            sum_lx = sum_lx + weights[i] * x[i] * levels_f[i]
            sum_l2 = sum_l2 + weights[i] * levels_f[i] * levels_f[i]
        return levels, sum_lx, sum_l2

    levels, sum_lx, sum_l2 = search(_over(float(-nmax), peak))
    scale = torch.where(sum_l2 != 0, sum_lx / torch.where(sum_l2 != 0, sum_l2, torch.ones_like(sum_l2)),
                        torch.zeros_like(sum_l2))
    best = scale * sum_lx
    for step in range(-9, 10):
        if step == 0:
            continue
        factor = np.float32(nmax) + np.float32(0.1) * np.float32(step)
        trial, sum_lx, sum_l2 = search(_over(float(-factor), peak))
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        levels = torch.where(better, trial, levels)
        scale = torch.where(better, sum_lx / torch.where(better, sum_l2, torch.ones_like(sum_l2)), scale)
        best = torch.where(better, scale * sum_lx, best)
    levels = torch.where(zero, torch.full_like(levels, -nmax), levels)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, (levels + nmax).t()


def quantize_q6_k(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ql uint8 (out, in/2), d float16 (out, in/256), qh uint8 (out, in/4), scales int8 (out, in/256, 16))`` for
    an ``(out, in)`` float weight, ``in`` a multiple of 256: ggml's reference quantizer (``quantize_row_q6_K_ref``,
    what ``llama-quantize`` runs without an importance matrix), step for step in float32.  On meta, empty tensors
    of those shapes."""
    rows, cols = weight.shape
    supers = cols // SUPER
    device = weight.device
    ql = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    d_out = torch.empty(rows, supers, dtype=torch.float16, device=device)
    qh = torch.empty(rows, cols // 4, dtype=torch.uint8, device=device)
    sc_out = torch.empty(rows, supers, 16, dtype=torch.int8, device=device)
    if weight.is_meta:
        return ql, d_out, qh, sc_out
    step = max(1, (_CHUNK_ELEMENTS // 4) // max(cols, 1))
    for start in range(0, rows, step):
        x = weight[start:start + step].detach().to(torch.float32).reshape(-1, 16)  # (groups, 16)
        count = x.shape[0] // 16  # super-blocks
        scales, levels = _make_qx_quants(x)
        scales, levels = scales.reshape(count, 16), levels.reshape(count, 16, 16)
        index = scales.abs().argmax(dim=1, keepdim=True)  # the first of equal magnitudes (strict >)
        max_scale = torch.gather(scales, 1, index).squeeze(1)
        zero = max_scale.abs() < _GROUP_MAX_EPS
        max_scale = torch.where(zero, torch.ones_like(max_scale), max_scale)
        iscale = _over(-128.0, max_scale)
        d = _over(1.0, iscale).to(torch.float16)
        sc = _nearest_int(iscale[:, None] * scales).clamp_(max=127)
        multiplier = d.float()[:, None] * sc.float()
        blocks = x.reshape(count, 16, 16)
        divisor = torch.where(multiplier != 0, multiplier, torch.ones_like(multiplier))
        final = _nearest_int(blocks / divisor[..., None]).clamp_(-32, 31) + 32
        levels = torch.where((multiplier != 0)[..., None], final, levels)  # a group whose scale is 0 keeps the search's
        levels = torch.where(zero[:, None, None], torch.zeros_like(levels), levels)
        sc = torch.where(zero[:, None], torch.zeros_like(sc), sc)
        d = torch.where(zero, torch.zeros_like(d), d)
        halves = levels.reshape(count, 2, 4, 32)  # (super, half, quarter, l): input half * 128 + quarter * 32 + l
        low, top = halves & 0xF, halves >> 4
        packed_low = torch.cat((low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)), dim=-1)
        packed_high = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
        end = start + count // supers
        ql[start:end] = packed_low.to(torch.uint8).reshape(end - start, cols // 2)
        qh[start:end] = packed_high.to(torch.uint8).reshape(end - start, cols // 4)
        d_out[start:end] = d.reshape(end - start, supers)
        sc_out[start:end] = sc.to(torch.int8).reshape(end - start, supers, 16)
    return ql, d_out, qh, sc_out


def unpack_q6_k(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """(out, in/2) low bits and (out, in/4) high bits -> (out, in/256, 16, 16) values 0..63 in input order, groups
    of 16 (ggml's ``dequantize_row_q6_K``'s layout)."""
    rows = ql.shape[0]
    low = ql.reshape(rows, -1, 2, 2, 32)  # (super, half, ql[l] or ql[l + 32], l); uint8 arithmetic throughout
    high = qh.reshape(rows, -1, 2, 32)
    q = torch.stack(((low[..., 0, :] & 15) | ((high & 3) << 4), (low[..., 1, :] & 15) | (((high >> 2) & 3) << 4),
                     (low[..., 0, :] >> 4) | (((high >> 4) & 3) << 4), (low[..., 1, :] >> 4) | (((high >> 6) & 3) << 4)),
                    dim=-2)
    return q.reshape(rows, -1, 16, 16)


class Q6_KLinear(BlockQuantizedLinear):
    """GGUF Q6_K, as a GGUF file holds it (llama.cpp's ``Q4_K_M``/``Q5_K_M`` files hold some projections, often
    the output head, in it).

    Each row is cut into super-blocks of 256 inputs, each into 16 groups of 16 that stand for ``d * sc * (q - 32)``
    (``q`` 6 bits; ``sc`` an int8 per group; ``d`` float16 per super-block).  Stored as GGUF orders them:
    ``weight`` uint8 (out x in/2: the ``ql`` bytes, low 4 bits), ``weight_high`` uint8 (out x in/4: the ``qh``
    bytes, high 2 bits), ``weight_sub`` int8 (out x in/256 x 16: ``sc``), ``weight_scale`` float16 (out x in/256:
    ``d``).  Built by :func:`quantize_q6_k` (llama.cpp's reference quantizer, byte for byte) or read from a GGUF
    file; ``format="gguf"`` writes the bytes as they are.  No packed-kernel fallback (aten's takes groups of 32
    and up): where our kernel does not run, a call dequantizes.
    """

    kind = "q6_k"
    block_inputs = SUPER
    weight_high: torch.Tensor
    weight_sub: torch.Tensor

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, high: torch.Tensor, sub: torch.Tensor,
                 bias: torch.Tensor | None, weight_dtype: torch.dtype = torch.float32):
        super().__init__(values, scale, bias, weight_dtype, extra={"weight_high": high, "weight_sub": sub})

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Q6_KLinear:
        """Quantize an ``(out, in)`` float weight (left untouched) with ggml's reference quantizer; on meta, the
        empty structure."""
        return cls(*quantize_q6_k(weight), bias, weight.dtype)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the float32 weight: ``(d * sc) * (q - 32)``, as ggml computes it."""
        rows = _rows(start, end)
        q = unpack_q6_k(self.stored_weight[rows], self.weight_high[rows]).float() - 32
        multiplier = self.weight_scale[rows].float()[..., None] * self.weight_sub[rows].float()
        return (multiplier[..., None] * q).reshape(q.shape[0], self.in_features)

    def values(self, start=0, end=None):
        raise NotImplementedError("Q6_K values have a scale per 16 inputs; use dequantize()")

    def _row_product(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return kernels.q6_k(x, buffers["weight"], buffers["weight_scale"], buffers["weight_high"],
                            buffers["weight_sub"], self.bias)

    def pack(self):
        return ()

    def gguf_bytes(self) -> np.ndarray:
        """The weight as the GGUF tensor's bytes: per super-block the 128 ``ql`` bytes, the 64 ``qh`` bytes, the
        16 scales, ``d``."""
        rows, supers = self.weight_scale.shape
        parts = (self.stored_weight.detach().cpu().reshape(rows, supers, SUPER // 2),
                 self.weight_high.detach().cpu().reshape(rows, supers, SUPER // 4),
                 self.weight_sub.detach().cpu().view(torch.uint8),
                 self.weight_scale.detach().cpu().contiguous().view(torch.uint8).reshape(rows, supers, 2))
        return torch.cat(parts, dim=-1).reshape(rows, -1).numpy()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=q6_k (GGUF super-blocks of {SUPER}), "
                f"row_kernel={self.row_kernel}")


class BlockEmbedding(nn.Module):
    """An ``nn.Embedding`` tied to a head of GGUF blocks: the head (``lm_head``) holds the blocks and this looks up
    their rows, as llama.cpp's ``token_embd`` serves both the lookup and the output projection.

    It holds no tensor of its own (the head's are saved once, moved once; ``.to()`` on the model reaches them
    through the head), so a tied model keeps one quantized copy where it kept one float copy.  A lookup
    dequantizes the rows it reads (bit for bit what the head multiplies by) into the head's ``weight_dtype``;
    ``weight`` reads the whole table dequantized, for code that inspects it.  No gradient.
    """

    def __init__(self, head: BlockQuantizedLinear, padding_idx: int | None = None):
        super().__init__()
        object.__setattr__(self, "head", head)  # not a submodule: the model's own lm_head, reached once
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = padding_idx

    @property
    def weight(self) -> torch.Tensor:
        """The table, dequantized on each read, in the head's ``weight_dtype``."""
        return self.head.weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Embedding.forward's name)
        rows = self.head.dequantize_rows(input.reshape(-1))
        return rows.to(self.head.weight_dtype).reshape(*input.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, the rows of the "
                f"head's GGUF {self.head.kind.upper()} blocks")


class Q5_1Linear(Q5_0Linear):
    """GGUF Q5_1: Q5_0's nibbles and fifth bits standing for ``q * d + m`` (``q`` 0..31), a float16 ``d`` and ``m`` per 32
    inputs (``weight_scale``: out x in/32 x 2, as Q4_1's).  llama.cpp writes it for a Q5_K tensor whose width is
    no multiple of 256 (most of SmolLM2's projections in a ``Q5_K_M`` file)."""

    kind = "q5_1"

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Q5_1Linear:
        """Quantize an ``(out, in)`` float weight (left untouched) as ggml's reference quantizer does; on meta, the
        empty structure."""
        return cls(*quantize_q5_1(weight), bias, weight.dtype)

    def values(self, start=0, end=None):
        rows = _rows(start, end)
        return unpack_q5_0(self.stored_weight[rows], self.weight_high[rows]).float()

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        m = self.weight_scale[_rows(start, end)][:, :, 1].float()
        scaled = self._scaled(start, end)
        return (scaled.reshape(scaled.shape[0], -1, BLOCK) + m[..., None]).reshape(scaled.shape[0], self.in_features)

    def _row_product(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return kernels.q5_1(x, buffers["weight"], buffers["weight_scale"], buffers["weight_high"], self.bias)

    def pack(self):
        # q * d + m = 16 h d + low * d + m (h: the fifth bit), as two centred 4-bit parts (Q5_0's reason)
        q = unpack_q5_0(self.stored_weight, self.weight_high)
        d, m = self.weight_scale.float().unbind(-1)
        return (_int4pack((q >> 4) + 8, 16 * d, -8 * d), _int4pack(q & 0xF, d, m + 16 * d))

    def gguf_bytes(self) -> np.ndarray:
        """The weight as the GGUF tensor's bytes: per block ``d``, ``m``, the 4 ``qh`` bytes, the 16 nibble bytes."""
        rows, groups, _ = self.weight_scale.shape
        dm = self.weight_scale.detach().cpu().contiguous().view(torch.uint8).reshape(rows, groups, 4)
        values = self.stored_weight.detach().cpu().reshape(rows, groups, BLOCK // 2)
        return torch.cat((dm, self.weight_high.detach().cpu(), values), dim=-1).reshape(rows, -1).numpy()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=q5_1 (GGUF blocks of {BLOCK}), "
                f"packed_kernel={self.packed_kernel}, row_kernel={self.row_kernel}")


#: Layer class per mode.
LAYERS = {"q8_0": Q8_0Linear, "q4_0": Q4_0Linear, "q4_1": Q4_1Linear, "q5_0": Q5_0Linear, "q5_1": Q5_1Linear,
          "q4_k": Q4_KLinear, "q5_k": Q5_KLinear, "q6_k": Q6_KLinear}
