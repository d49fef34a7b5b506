"""``fuse qkv``: one projection (and one matmul) instead of separate q, k and v."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import option
from ..registry import register
from .base import Transform


@dataclass(frozen=True)
class QKVOptions:
    cross: str = option("kv", "cross-attention: fuse k/v only ('kv') or leave it alone ('skip')",
                        choices=("kv", "skip"))


@register
class QKVFusion(Transform):
    verb = "fuse"
    mode = "qkv"
    summary = "concatenate q/k/v projection weights into one Linear"
    Options = QKVOptions
    default_target = ("*Attention",)
    runs_before = ("quantize *", "fp8 *", "compile*")
