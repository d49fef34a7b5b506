"""``fuse bias_act_dropout|bias_dropout_residual|bias_dropout_residual_layernorm``.

Replaces the elementwise chain that follows a linear layer with one fused function,
keeping the same parameters under the same state_dict keys.
"""

from __future__ import annotations

from ..registry import register
from .base import Transform


class _Elementwise(Transform):
    verb = "fuse"
    runs_after = ("fuse qkv",)
    runs_before = ("quantize *", "fp8 *")
    changes_weights = False


@register
class BiasActDropout(_Elementwise):
    mode = "bias_act_dropout"
    summary = "fuse bias + activation + dropout after a projection"
    default_target = ("FeedForward", "*MLP")


@register
class BiasDropoutResidual(_Elementwise):
    mode = "bias_dropout_residual"
    summary = "fuse bias + dropout + residual add"
    default_target = ("*Block", "*Layer")


@register
class BiasDropoutResidualLayerNorm(_Elementwise):
    mode = "bias_dropout_residual_layernorm"
    summary = "fuse bias + dropout + residual add + layernorm"
    default_target = ("*Block", "*Layer")
