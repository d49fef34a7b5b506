"""Weight-only int4 (W4A16): 4-bit weights in asymmetric groups along each row, bfloat16 activations.

The scheme of torchao's ``Int4WeightOnlyConfig`` (its "tinygemm" layout: a float zero point per
group), as a plain ``nn.Module``.  For each group of ``group_size`` inputs of a row::

    scale = (max - min) / 15,   zero = min + 8 * scale          (both rounded to the compute dtype)
    q     = clamp(round((w - min) / scale), 0, 15)               (min = zero - 8 * scale)
    w    ~= (q - 8) * scale + zero

``symmetric=True`` (llm-compressor's W4A16 scheme, which compressed-tensors' ``pack-quantized``
format stores): ``scale = max(|min|, |max|) / 7.5``, ``zero = 0``, so ``w ~= (q - 8) * scale`` with
``q - 8`` in -8..7; the same layer, kernel and save (its zeros are all 0).

Saved as plain tensors, the same on every device: ``weight`` (uint8, out x in/2: two values per
byte, the even input in the low nibble), ``weight_scale`` and ``weight_zero`` (in the compute
dtype: bfloat16 by default, float32 with ``compute=float32``; out x in/group_size) and ``bias``.
The device's packed layout is made from them when the layer is built, loaded or moved (never
saved): on a CPU ``aten._convert_weight_to_int4pack_for_cpu`` for
``aten._weight_int4pack_mm_for_cpu``, used with bfloat16 activations.  Elsewhere (and on a
torch without the kernel) the layer dequantizes its weight into the compute dtype at each call.

``activations="int8"`` (``quantize int4 activations=int8``): the layer's input is first rounded per 32
inputs to int8 with a float16 scale, as llama.cpp rounds activations (:func:`.gguf_blocks.round_activations`);
decode-sized inputs then multiply as integers (``kernels.int4_q8x_rows``: VNNI dot products where the CPU has
them), larger ones multiply the rounded input as above.  The stored weights are the same either way.

>>> layer = Int4WeightOnlyLinear.build(torch.linspace(-1, 1, 32 * 16).reshape(16, 32), None, 32)
>>> layer.weight.shape, layer._buffers["weight"].dtype, layer.weight_scale.shape
(torch.Size([16, 32]), torch.uint8, torch.Size([16, 1]))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..common import blocked
from ..common.stored_weight import StoredWeight
from . import kernels
from .gguf_blocks import round_activations

#: Largest 4-bit value, and the one that dequantizes to the group's zero.
QMAX, MID = 15, 8
#: Lower bound on a group's scale (torchao's eps for this scheme).
_EPS = 1e-6
#: Rows quantized at a time: bounds the float32 working copy.
_CHUNK_ELEMENTS = 1 << 22


#: A symmetric group's scale: its largest magnitude over half the 4-bit range (llm-compressor's rule).
SYMMETRIC_RANGE = 7.5


def group_parameters(low: torch.Tensor, high: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero)`` in ``dtype`` (the layer's compute dtype) of groups whose values span
    ``[low, high]`` (float32); ``symmetric``: zero 0, the scale from the larger magnitude."""
    if symmetric:
        s = (torch.maximum(low.abs(), high.abs()) / SYMMETRIC_RANGE).clamp(min=_EPS).to(dtype)
        return s, torch.zeros_like(s)
    s = ((high - low) / QMAX).clamp(min=_EPS).to(dtype)
    return s, (low + s.float() * MID).to(dtype)


def group_codes(chunk: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Values 0..15 (float) of ``chunk`` (rows, groups, group_size) on the grid of ``(scale, zero)``."""
    minimum = zero.float() - scale.float() * MID
    return torch.round((chunk - minimum[..., None]) / scale.float()[..., None]).clamp_(0, QMAX)


def quantize_groups(weight: torch.Tensor, group_size: int, dtype: torch.dtype = torch.bfloat16,
                    symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values uint8 (out, in) in 0..15, scale (out, groups), zero (out, groups))``, scales and
    zeros in ``dtype``."""
    rows, cols = weight.shape
    groups = cols // group_size
    values = torch.empty(rows, cols, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, groups, dtype=dtype, device=weight.device)
    zero = torch.empty(rows, groups, dtype=dtype, device=weight.device)
    if weight.is_meta:
        return values, scale, zero
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        chunk = weight[start:start + step].detach().float().reshape(-1, groups, group_size)
        s, z = group_parameters(chunk.amin(dim=2), chunk.amax(dim=2), dtype, symmetric)
        values[start:start + step] = group_codes(chunk, s, z).reshape(-1, cols).to(torch.uint8)
        scale[start:start + step] = s
        zero[start:start + step] = z
    return values, scale, zero


class GroupGrid:
    """The int4 grid of one weight with its groups' ``(scale, zero)`` fixed up front: what GPTQ and
    AWQ round onto (llm-compressor's GPTQ fixes them the same way, from the weight before any
    update).  ``low``/``high`` (rows x groups) narrow the groups' ranges (AWQ's clipping)."""

    def __init__(self, weight: torch.Tensor, group_size: int, low: torch.Tensor | None = None,
                 high: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, symmetric: bool = False):
        rows, cols = weight.shape
        self.group_size = group_size
        if low is None or high is None:
            grouped = weight.float().reshape(rows, cols // group_size, group_size)
            low, high = grouped.amin(dim=2), grouped.amax(dim=2)
        self.scale, self.zero = group_parameters(low, high, dtype, symmetric)
        self._s, self._z = self.scale.float(), self.zero.float()
        self._minimum = self._z - self._s * MID

    def fake_column(self, column: torch.Tensor, index: int) -> torch.Tensor:
        """Column ``index`` of the weight rounded onto the grid and dequantized (float32)."""
        group = index // self.group_size
        s = self._s[:, group]
        q = torch.round((column - self._minimum[:, group]) / s).clamp_(0, QMAX)
        return (q - MID) * s + self._z[:, group]

    def fake(self, weight: torch.Tensor) -> torch.Tensor:
        """The whole weight rounded onto the grid and dequantized (float32)."""
        rows, cols = weight.shape
        grouped = weight.float().reshape(rows, -1, self.group_size)
        q = group_codes(grouped, self.scale, self.zero)
        return ((q - MID) * self._s[..., None] + self._z[..., None]).reshape(rows, cols)

    def codes(self, weight: torch.Tensor) -> torch.Tensor:
        """Values 0..15 (uint8, out x in) of a weight on (or rounded onto) the grid."""
        rows, cols = weight.shape
        grouped = weight.float().reshape(rows, -1, self.group_size)
        return group_codes(grouped, self.scale, self.zero).reshape(rows, cols).to(torch.uint8)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """(out, in) values 0..15 -> (out, in/2) uint8, the even input in the low nibble."""
    return (values[:, 0::2] | (values[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: (out, in/2) uint8 -> (out, in) uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


#: Inputs of at most this many rows (decoding) on a CPU take our row kernel (:mod:`.kernels`): float32
#: activations, the stored nibbles, scales and zeros as they are.  Beside aten's packed kernel
#: (``compute=bfloat16``), only up to ``ROW_KERNEL_PACKED_ROWS``: measured on SmolLM2-135M's layers (Intel
#: Xeon, one thread, group 64) ours took 0.94x / 0.92x its time at 1 / 2 rows and 1.15x / 1.19x at 4 / 8
#: (benchmarks/results/decode_kernels.md, one row: 0.86-1.07x over both weight sets and thread counts).
#: With ``compute=float32`` (no packed kernel: every call dequantized) up to 8.
ROW_KERNEL_MAX_ROWS = 8
ROW_KERNEL_PACKED_ROWS = 2


class _DeviceLayout:
    """The packed layout of one device (not a tensor attribute of the module: never saved)."""

    def __init__(self):
        self.source: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.scales_and_zeros: torch.Tensor | None = None


def cpu_kernel_available() -> bool:
    from ...capabilities import packed_cpu_kernels

    return "int4" in packed_cpu_kernels()


class Int4WeightOnlyLinear(StoredWeight):
    """A linear layer with int4 weights (grouped, asymmetric) and float activations."""

    weight_scale: torch.Tensor
    weight_zero: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, compute: torch.dtype = torch.bfloat16, weight_dtype: torch.dtype = torch.float32,
                 activations: str = "float"):
        super().__init__()
        #: ``"float"``: inputs multiply as they come; ``"int8"``: rounded first per 32 inputs (module docstring).
        #: The statement's ``activations=`` option (its record says it on load); not a tensor, never saved.
        self.activations = activations
        self.out_features, half = weight.shape
        self.in_features = 2 * half
        self.group_size = group_size
        self.compute = compute
        self.weight_dtype = weight_dtype
        self.register_buffer("weight", weight)  # packed nibbles, saved under the key "weight"
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero", zero)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._layout = _DeviceLayout()
        #: Whether this layer multiplies with the packed CPU kernel (detected when built or loaded).
        #: (it takes float32 too, but runs slower than dequantizing into a dense float32 matmul)
        self.packed_kernel = cpu_kernel_available() and compute == torch.bfloat16
        self.register_load_state_dict_post_hook(lambda module, _: module.repack())
        self.repack()

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int,
              compute: torch.dtype = torch.bfloat16, symmetric: bool = False,
              activations: str = "float") -> Int4WeightOnlyLinear:
        values, scale, zero = quantize_groups(weight, group_size, compute, symmetric)
        return cls(pack_nibbles(values), scale, zero, bias, group_size, compute, weight.dtype, activations)

    @property
    def packed_weight(self) -> torch.Tensor:
        """The stored nibbles (saved as ``weight``)."""
        try:
            return self._buffers["weight"]
        except KeyError:  # before __init__ registered it: an AttributeError, as for any attribute
            raise AttributeError("packed_weight") from None

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight in :attr:`weight_dtype` (dequantized on each read)."""
        return self.dequantize().to(self.weight_dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 (out, in) weight this layer multiplies by."""
        values = unpack_nibbles(self.packed_weight).float().reshape(self.out_features, -1, self.group_size)
        out = (values - MID) * self.weight_scale.float()[..., None] + self.weight_zero.float()[..., None]
        return out.reshape(self.out_features, self.in_features)

    def repack(self) -> None:
        """Make the device's packed layout from the stored tensors (after build, load and moves)."""
        layout = self._layout
        stored = self._buffers["weight"]
        layout.source = stored
        layout.weight = layout.scales_and_zeros = None
        scale, zero = self._buffers["weight_scale"], self._buffers["weight_zero"]
        #: Whether decode-sized inputs on the CPU take our kernel (:mod:`.kernels`): the nibbles read as
        #: stored, float32 activations, the scales and zeros as stored (bfloat16 or float32).
        # (the integer products of activations=int8 beat aten's kernel at 8 rows too: decode_kernels.md)
        packed_rows = self.packed_kernel and self.activations != "int8"
        self._row_limit = (ROW_KERNEL_PACKED_ROWS if packed_rows else ROW_KERNEL_MAX_ROWS) * self.in_features
        self.row_kernel = (stored.device.type == "cpu" and not stored.is_meta and stored.is_contiguous()
                           and scale.dtype in (torch.bfloat16, torch.float32) and zero.dtype == scale.dtype
                           and scale.is_contiguous() and zero.is_contiguous() and self.group_size % 32 == 0
                           and kernels.available())
        if not self.packed_kernel or stored.is_meta or stored.device.type != "cpu":
            return
        values = unpack_nibbles(stored).to(torch.int32)
        layout.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        layout.scales_and_zeros = torch.stack((self.weight_scale.t(), self.weight_zero.t()), dim=-1).contiguous()

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` moves the stored tensors (and repacks); ``.to(dtype)`` changes what
        :attr:`weight` reads as and the bias, never the stored values, scales and zeros."""
        kept = {name: self._buffers[name] for name in ("weight_scale", "weight_zero")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        probe = fn(torch.empty(0, dtype=self.weight_dtype, device=self._buffers["weight"].device))
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        if self._layout.source is not self._buffers["weight"]:
            self.repack()
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        layout = self._layout
        if not torch.compiler.is_compiling() and layout.source is not self._buffers["weight"]:
            self.repack()  # the stored tensors were replaced (a loader that assigns them directly)
        if (self.row_kernel and input.numel() <= self._row_limit and input.is_floating_point()
                and input.device.type == "cpu" and not (input.requires_grad and torch.is_grad_enabled())):
            # decoding: the nibbles read as stored, float32 activations (kernels/rows.c; no derivative)
            buffers = self._buffers
            return kernels.int4(input, buffers["weight"], buffers["weight_scale"], buffers["weight_zero"],
                                self.group_size, self.bias, self.activations)
        x = input.reshape(-1, self.in_features)
        if self.activations == "int8":  # rounded as the integer kernel rounds it, then multiplied as floats
            x = round_activations(x)[0]
        x = x.to(self.compute).contiguous()  # the packed kernel's rule
        if layout.weight is not None and x.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layout.weight, self.group_size,
                                                              layout.scales_and_zeros)
        elif blocked.by_blocks(x, self.out_features, self.compute):
            def cast(start: int, end: int, buffer: torch.Tensor) -> torch.Tensor:
                return buffer.copy_(self._dequantize_rows(start, end))

            out = blocked.linear_by_blocks(x, self.out_features, self.compute, cast)
        else:
            out = F.linear(x, self.dequantize().to(self.compute))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(input.dtype).reshape(*input.shape[:-1], self.out_features)

    def _dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        packed = self.packed_weight[start:end]
        values = unpack_nibbles(packed).float().reshape(end - start, -1, self.group_size)
        out = (values - MID) * self.weight_scale[start:end].float()[..., None] + \
            self.weight_zero[start:end].float()[..., None]
        return out.reshape(end - start, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=int4 group_size={self.group_size} asymmetric, compute={str(self.compute).split('.')[-1]}, "
                f"activations={self.activations}, "
                f"packed_kernel={self.packed_kernel}, row_kernel={self.row_kernel}")
