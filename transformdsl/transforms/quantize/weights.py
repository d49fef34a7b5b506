"""A linear layer's float weight and a quantized layer's saved bytes (what every quantize pass reads)."""

from __future__ import annotations

import torch
from torch import nn

from ..common.modules import is_conv1d


def float_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's weight as (out_features, in_features) and its bias: views, no copy."""
    weight = module.weight
    if is_conv1d(type(module), module):
        weight = weight.t()
    return weight.detach(), None if module.bias is None else module.bias.detach()


def state_bytes(module: nn.Module) -> int:
    """Bytes of everything the module saves (weights, scales, quant state, bias)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if isinstance(t, torch.Tensor))
