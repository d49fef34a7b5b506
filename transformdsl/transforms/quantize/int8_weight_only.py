"""Weight-only int8 (W8A16): int8 weights with one scale per output channel, float activations.

The scheme torchao's ``Int8WeightOnlyConfig`` uses, as a plain ``nn.Module`` (no tensor
subclass, no backend import): each call casts the int8 weight to the input's dtype, runs the
ordinary matmul and multiplies the *output* by the per-channel scales,

    y = F.linear(x, W_int8.to(x.dtype)) * scale + bias

which is exact algebra (the scale is constant along each output column) and costs one
elementwise pass over the output instead of one over the full-size weight.  A large weight
is cast and multiplied a block of rows at a time (:mod:`..common.blocked`: at width 3072 and 48 tokens
the whole cast took 2.3-4.6x the float layer's time, block by block 0.84-1.35x;
benchmarks/results/upcast.md).  Activations are
never quantized, so the error is the weight rounding alone (half a step of ``amax / 127`` per
row) and the matmul is the float one: no int8 GEMM, which CPUs without VNNI/AMX run ~35x slower
than fp32 (bitsandbytes' ``quantize int8``).

>>> layer = Int8WeightOnlyLinear.build(torch.eye(4) * 2.0, None)
>>> layer.int8_weight.dtype, layer.weight_scale.shape, layer.weight.dtype
(torch.int8, torch.Size([4]), torch.float32)
>>> layer(torch.ones(2, 4)).tolist()
[[2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..common import blocked
from ..common.stored_weight import StoredWeight
from . import kernels

#: Largest int8 magnitude used: symmetric, so -128 is never produced.
QMAX = 127
#: Rows quantized at a time: bounds the float32 working copy to ~``_CHUNK_ELEMENTS`` values.
_CHUNK_ELEMENTS = 1 << 22
#: Lower bound on a row's ``amax``: an all-zero row gets a tiny scale and zero values.
_TINY = 1e-12
#: Inputs of at most this many rows (decoding) take the packed bf16 x int8 kernel
#: (``aten._weight_int8pack_mm``) on a CPU.  Measured against the blocked cast-and-multiply at
#: widths 3072 and 4096 (AMD EPYC with avx512_vnni/avx512_bf16, one thread): 0.05-0.2x at 1-8
#: rows, 0.9-1.3x at 16, 1.2-2.4x from 32 (benchmarks/bench_quantized_compute.py --crossover).
PACKED_MAX_ROWS = 8
#: Activation dtypes that take the packed kernel.  It multiplies bfloat16 activations only; a float32
#: input is rounded to bfloat16 for it (and the output back), which adds ~2^-9 relative error per
#: value to the int8 rounding's larger one: on a 4096 -> 11008 layer, relative output error 0.0045
#: against 0.0039 for the exact float32 product, at 0.36x the fp32 layer's time instead of 0.65x
#: (one decode row, AMD EPYC, one thread).  float16 stays on the float path (no such kernel).
PACKED_INPUTS = (torch.bfloat16, torch.float32)
#: The kernel reads ``in_features`` in blocks of 16: other sizes give wrong results (seen: NaN).
PACKED_IN_MULTIPLE = 16


def packed_kernel_available() -> bool:
    """Whether this torch has the packed bf16 x int8 CPU kernel."""
    from ...capabilities import packed_cpu_kernels

    return "int8" in packed_cpu_kernels()


def int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.to(x.dtype))`` for an int8 ``weight``, without a float copy of all of
    it where that copy is what costs (:mod:`..common.blocked`); ``bias`` (added by the caller) only says
    whether autograd records the call."""
    if not blocked.by_blocks(x, weight.shape[0], x.dtype, bias=bias):
        return F.linear(x, weight.to(x.dtype))  # under compile, the cast fuses into the matmul

    def cast(start: int, end: int, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.copy_(weight[start:end])

    return blocked.linear_by_blocks(x, weight.shape[0], x.dtype, cast)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 values, float32 scale per row)`` with ``values * scale[:, None] ≈ weight``.

    Works row-chunk by row-chunk, so the float32 working copy stays small whatever the layer
    size; ``weight`` is read, never written.  On the meta device it returns meta tensors of the
    right shapes and dtypes (what loading replays).

    >>> q, s = quantize_rows(torch.tensor([[0.5, -1.0], [0.0, 0.0]]))
    >>> q.tolist(), [round(v, 6) for v in s.tolist()]
    ([[64, -127], [0, 0]], [0.007874, 0.0])
    """
    rows, cols = weight.shape
    values = torch.empty(rows, cols, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, dtype=torch.float32, device=weight.device)
    if weight.is_meta:
        return values, scale
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        chunk = weight[start:start + step].detach().to(torch.float32, copy=True)  # worked on in place
        amax = chunk.abs().amax(dim=1, keepdim=True).clamp_(min=_TINY)
        torch.div(chunk, amax, out=chunk).mul_(QMAX).round_()
        values[start:start + step] = chunk.to(torch.int8)
        scale[start:start + step] = (amax / QMAX).squeeze(1)
    return values, scale


class RowGrid:
    """The int8 grid of one weight, each row's scale fixed up front (``amax / 127`` of the row):
    what GPTQ rounds onto, column by column.  :func:`quantize_rows` of a weight on this grid gives
    the same scales back."""

    group_size = None

    def __init__(self, weight: torch.Tensor):
        self._amax = weight.float().abs().amax(dim=1).clamp_(min=_TINY)
        self.scale = self._amax / QMAX

    def fake_column(self, column: torch.Tensor, index: int) -> torch.Tensor:
        """Column ``index`` rounded onto the grid and dequantized (float32)."""
        return (column / self._amax * QMAX).round_().clamp_(-QMAX, QMAX) * self.scale

    def fake(self, weight: torch.Tensor) -> torch.Tensor:
        return self.codes(weight).float() * self.scale[:, None]

    def codes(self, weight: torch.Tensor) -> torch.Tensor:
        """The int8 values (out x in) of a weight on (or rounded onto) the grid."""
        return (weight.float() / self._amax[:, None] * QMAX).round_().clamp_(-QMAX, QMAX).to(torch.int8)


class _KernelScale:
    """The scales in bfloat16 for the packed kernel, made when the layer is built, loaded or moved (not
    a tensor attribute of the module: never saved).  Converting them inside ``forward`` cost a pass per
    call and, under ``compile``, made inductor's lowering of the kernel fail (its scale operand must be
    a stored tensor, not a computed one)."""

    def __init__(self):
        self.source: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def update(self, layer: nn.Module) -> None:
        self.source = layer._buffers["weight_scale"]
        self.value = None if self.source is None else self.source.to(torch.bfloat16)


class Int8WeightOnlyLinear(StoredWeight):
    """A linear layer with an int8 weight and float activations (drop-in for ``nn.Linear``).

    State dict: ``weight`` (int8, out x in), ``weight_scale`` (float32, one per output row),
    ``bias`` (the original, unchanged).  ``forward`` takes any leading dimensions and returns
    the input's dtype; the weight is dequantized into that dtype at every call.

    Model code that reads ``layer.weight`` (its dtype to cast inputs, its shape or device)
    gets the effective weight, dequantized on each read into :attr:`weight_dtype` (the dtype of
    the weight it replaced, following ``model.to(dtype)``); the stored int8 tensor is
    :attr:`int8_weight`.
    """

    weight_scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # the int8 values, saved under the key "weight"
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_dtype = weight_dtype
        #: Whether bfloat16 inputs of few rows take ``aten._weight_int8pack_mm`` on a CPU (a plain
        #: attribute: compile guards on it).
        self.packed_kernel = self.in_features % PACKED_IN_MULTIPLE == 0 and packed_kernel_available()
        self._kernel_scale = _KernelScale()
        self.register_load_state_dict_post_hook(lambda module, _: module._after_load())
        self._kernel_scale.update(self)
        self._choose_row_kernel()

    def _choose_row_kernel(self) -> None:
        #: Whether inputs of few rows on the CPU take our decode kernel (:mod:`.kernels`: float32
        #: activations, the int8 bytes read as stored); decided when the layer is built, loaded or moved.
        stored, scale = self._buffers["weight"], self._buffers["weight_scale"]
        self._row_limit = PACKED_MAX_ROWS * self.in_features
        self.row_kernel = (stored.device.type == "cpu" and not stored.is_meta and stored.is_contiguous()
                           and scale.dtype == torch.float32 and scale.is_contiguous() and kernels.available())

    def _after_load(self) -> None:
        self._kernel_scale.update(self)
        self._choose_row_kernel()

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8WeightOnlyLinear:
        """Quantize an ``(out, in)`` float weight (left untouched); on meta, the empty structure."""
        values, scale = quantize_rows(weight)
        return cls(values, scale, bias, weight.dtype)

    @property
    def int8_weight(self) -> torch.Tensor:
        """The stored int8 weight (saved as ``weight``)."""
        try:
            return self._buffers["weight"]
        except KeyError:  # before __init__ registered it: an AttributeError, as for any attribute
            raise AttributeError("int8_weight") from None

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight in :attr:`weight_dtype` (a new tensor, computed on each read)."""
        return self.dequantize().to(self.weight_dtype)

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)`` moves the int8 weight and its scales; ``.to(dtype)`` changes what
        :attr:`weight` reads as and the bias, never the stored values or the float32 scales."""
        scale = self._buffers["weight_scale"]
        super()._apply(fn, recurse)
        after = self._buffers["weight_scale"]
        if after is not None and after.dtype != scale.dtype:
            self._buffers["weight_scale"] = scale.to(after.device)
        probe = fn(torch.empty(0, dtype=self.weight_dtype, device=self._buffers["weight"].device))
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        self._kernel_scale.update(self)
        self._choose_row_kernel()
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        x = input
        buffers = self._buffers
        if not torch.compiler.is_compiling() and self._kernel_scale.source is not buffers["weight_scale"]:
            self._after_load()  # the scales were replaced (a loader that assigns them directly)
        if (self.row_kernel and x.numel() <= self._row_limit and x.is_floating_point()
                and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())):
            # decoding: the int8 bytes read as stored, float32 activations (kernels/rows.c; no derivative)
            return kernels.rows("int8", x, buffers["weight"], buffers["weight_scale"], self.bias)
        if (self.packed_kernel and x.dtype in PACKED_INPUTS and x.device.type == "cpu"
                and x.numel() <= PACKED_MAX_ROWS * self.in_features
                and not (torch.is_grad_enabled() and x.requires_grad)):  # the kernel has no derivative
            # decoding: int8 weights read once, no float copy (the scales are applied by the kernel);
            # float32 activations are rounded to bfloat16 for it (PACKED_INPUTS says why)
            out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16),
                                                     self.int8_weight, self._kernel_scale.value)
            out = out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
            return out if self.bias is None else out + self.bias.to(x.dtype)
        scale = self.weight_scale
        if scale.dtype != x.dtype:
            scale = scale.to(x.dtype)  # out-features values only
        out = int8_linear(x, self.int8_weight, self.bias)
        if self.bias is None:
            return out * scale
        return torch.addcmul(self.bias.to(x.dtype), out, scale)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (for inspection and error checks)."""
        return self.int8_weight.float() * self.weight_scale.float()[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=int8, scale=per-output-channel")
