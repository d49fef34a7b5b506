"""``fuse qkv``: one projection (and one matmul) instead of separate q, k and v (declaration).

The implementation (:mod:`.fusion`) holds the layouts it knows, the analysis of a module, the
fused forwards and the reload; :mod:`.shared_projection` the parameter-free slices a module
whose own forward runs unchanged reads its projections from.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...extend import Transform, option


@dataclass(frozen=True)
class QKVOptions:
    cross: str = option("kv", "cross-attention: fuse k/v only ('kv') or leave it alone ('skip')",
                        choices=("kv", "skip"))


class QKVFusion(Transform):
    verb = "fuse"
    mode = "qkv"
    summary = "concatenate q/k/v projection weights into one Linear"
    Options = QKVOptions
    default_target = ("*Attention",)
    runs_before = ("quantize *", "fp8 *", "compile*")
    #: 2 added ``forward: "shared"`` and the group names of ``PROJECTIONS``; every entry a
    #: version 1 record can hold means the same in version 2.
    record_version = 2
    implementation = ".fusion:QKVFusion"
