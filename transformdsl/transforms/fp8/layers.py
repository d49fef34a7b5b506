"""The fp8 modules: a weight kept as a float8 buffer (plus scales), upcast in ``forward`` or
multiplied natively with ``torch._scaled_mm``.

Keeping the fp8 tensor as a plain buffer and doing the cast in ``forward`` (not in a hook) is what lets
``torch.compile(fullgraph=True)`` trace it; a buffer rather than a ``Parameter`` keeps diffusers'
``ModelMixin.dtype`` (its first floating *parameter*) at the model's real dtype.  Every module returns
its output in its *input's* dtype, so a layer can be dropped into a model of any dtype; ``compute`` is
the dtype the matmul (or convolution) runs in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..common import blocked
from ..common.stored_weight import StoredWeight
from .cuda import cuda_scaled_mm_problems, device_fp8_problem, fuses_bias, has_fp8_matmul
from .numerics import dequantize, empty_scale, quantize, quantize_activation, quantize_weight

#: Bytes of upcast weight from which a linear layer upcasts and multiplies block by block.
BLOCKED_FROM = 16 << 20

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
        #: The statement that made this layer, for the message of a strict layer on a device
        #: without fp8 matmul (``fp8 dynamic`` relabels its layers).
        self.statement = "fp8 native (strict=true)"

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
                raise RuntimeError(f"{self.statement}: {device_fp8_problem(input.device)}; move the model to a CUDA "
                                   "device with compute capability 8.9+ (model.to('cuda')) before calling it")
        return self._upcast_forward(input)

    def _upcast_forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.compute_dtype
        # a large weight: upcast a block of rows at a time (decoding makes integer temporaries of
        # the block's size, which then stay in cache too)
        if blocked.by_blocks(x, self.out_features, c, BLOCKED_FROM, self.bias):
            values, scale = self.fp8_weight, self.weight_scale
            rows = scale is not None and scale.shape[0] > 1

            def upcast(start: int, end: int, _buffer) -> torch.Tensor:
                return dequantize(values[start:end], scale[start:end] if rows else scale, c)

            return blocked.linear_by_blocks(x, self.out_features, c, upcast, self._bias(c),
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
        fused = fuses_bias(self.compute_dtype) and self.bias is not None
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
