"""W8A8 dynamic: int8 weights with one scale per output channel, activations quantized per token at
every call, an int8 x int8 matmul accumulated in int32, rescaled to the activation dtype.

The scheme of torchao's ``Int8DynamicActivationInt8WeightConfig``, as a plain ``nn.Module`` (no
tensor subclass: it saves as three ordinary tensors, the keys of the weight-only int8 layer)::

    s_x = amax|x_row| / 127                      (float32, one per token)
    x_q = round(x / s_x)                         (int8)
    y   = (x_q @ W_q.T) * s_x * s_w + bias       (int32 accumulation, then float32, then x's dtype)

Which kernel multiplies is chosen from the detected device (:mod:`transformdsl.capabilities`),
once per layer when it is built or loaded, and kept as a plain attribute (``torch.compile``
guards on it):

- ``torch._int_mm`` on a CPU with int8 dot products (``avx512_vnni``, ``avx_vnni``, ``amx_int8``)
  and on CUDA (inputs of more than 16 rows there: the kernel's own rule; fewer take the fallback);
- elsewhere the fallback: the same int8 values multiplied in float32 (exact while
  ``in_features * 127 * 127 < 2**24``, float rounding beyond), because ``torch._int_mm`` without
  int8 dot products runs ~35x slower than fp32.  The plan says so (``w8a8_note``).

>>> layer = Int8DynamicLinear.build(torch.eye(16) * 2.0, None)
>>> layer(torch.ones(2, 16)).tolist()[0][:4]
[2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .int8_weight_only import QMAX, Int8WeightOnlyLinear, int8_linear

#: Lower bound on a token's ``amax``: an all-zero token gets a tiny scale and zero values.
_TINY = 1e-12
#: ``torch._int_mm`` on CUDA takes more than this many rows (and sizes that are multiples of 8).
CUDA_MIN_ROWS = 16


def quantize_tokens(x: torch.Tensor, reduce_amax: Callable[[torch.Tensor], None] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 values, float32 scale per row)`` of a 2-D activation, symmetric per token.

    ``reduce_amax`` (a row-parallel shard: :mod:`transformdsl.parallel`) turns, in place, the
    ``(rows, 1)`` amax of this shard's columns into the amax of the whole rows (the other ranks'
    maximum), so that every shard rounds with the scale the whole layer would use.

    >>> q, s = quantize_tokens(torch.tensor([[0.5, -1.0], [0.0, 0.0]]))
    >>> q.tolist()
    [[64, -127], [0, 0]]
    """
    x32 = x.float()
    amax = x32.abs().amax(dim=1, keepdim=True)
    if reduce_amax is not None:
        reduce_amax(amax)
    scale = amax.clamp_(min=_TINY).div_(QMAX)
    values = torch.div(x32, scale)  # a new tensor: rounded and clamped in place (no more full-size temporaries)
    return values.round_().clamp_(-QMAX, QMAX).to(torch.int8), scale


def cpu_kernel() -> str:
    """The kernel layers built now on a CPU use: ``"int_mm"`` or ``"float"`` (detected)."""
    from ...capabilities import w8a8_kernel

    return w8a8_kernel("cpu")


class Int8DynamicLinear(Int8WeightOnlyLinear):
    """A linear layer with an int8 weight whose input is quantized per token at each call (W8A8).

    State dict as :class:`Int8WeightOnlyLinear`'s: ``weight`` (int8, out x in), ``weight_scale``
    (float32, one per output row), ``bias`` (unchanged).  ``.weight`` reads as the dequantized
    float weight.  :attr:`cpu_kernel` says how it multiplies on a CPU.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 weight_dtype: torch.dtype = torch.float32):
        super().__init__(weight, scale, bias, weight_dtype)
        #: ``"int_mm"`` (int8 dot products detected) or ``"float"``; chosen on build and load.
        self.cpu_kernel = cpu_kernel()
        #: ``None``, or (on a row-parallel shard) what makes a token's amax the whole row's
        #: (:func:`quantize_tokens`'s ``reduce_amax``).
        self.reduce_amax: Callable[[torch.Tensor], None] | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        x = input.reshape(-1, self.in_features)
        values, x_scale = quantize_tokens(x, self.reduce_amax)
        weight = self.int8_weight
        device = x.device.type
        if (device == "cpu" and self.cpu_kernel == "int_mm") or (device == "cuda" and x.shape[0] > CUDA_MIN_ROWS):
            accumulated = torch._int_mm(values, weight.t()).float()  # int32 -> a new float32 tensor
        else:  # int8 values multiplied in float32: same sums, no int8 kernel needed
            accumulated = int8_linear(values.float(), weight)
        out = accumulated.mul_(x_scale).mul_(self.weight_scale)  # in place: the output is the one large tensor
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(input.dtype).reshape(*input.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=int8 per-output-channel, activations=int8 per-token "
                f"(dynamic), cpu_kernel={self.cpu_kernel}")
