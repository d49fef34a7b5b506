"""``fp8 storage`` and ``fp8 native``: weights in float8, upcast per layer or multiplied natively."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import option
from ..registry import register
from .base import Transform

#: diffusers' layerwise-casting defaults (``DEFAULT_SKIP_MODULES_PATTERN``).
DEFAULT_EXCEPT = ("norm", "pos_embed", "patch_embed", "re:^proj_in$", "re:^proj_out$")


@dataclass(frozen=True)
class StorageOptions:
    dtype: str = option("e4m3", "float8 format of the stored weights", choices=("e4m3", "e5m2"))
    compute: str = option("bfloat16", "dtype weights are upcast to for the forward", kind="dtype")


@register
class FP8Storage(Transform):
    verb = "fp8"
    mode = "storage"
    summary = "store weights in float8, upcast per layer at forward"
    Options = StorageOptions
    default_target = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Conv1D")
    default_except = DEFAULT_EXCEPT
    runs_after = ("fuse *",)
    exclusive = "weights"


@dataclass(frozen=True)
class NativeOptions:
    scaling: str = option("tensor", "weight/activation scale granularity", choices=("tensor", "row"))
    activation: str = option("dynamic", "how activations are scaled", choices=("dynamic",))
    compute: str = option("bfloat16", "output dtype of the fp8 matmul", kind="dtype")
    strict: bool = option(False, "error instead of upcasting where the device has no fp8 matmul")


@register
class FP8Native(Transform):
    verb = "fp8"
    mode = "native"
    summary = "keep fp8 weights and multiply natively with torch._scaled_mm"
    Options = NativeOptions
    default_target = ("Linear",)
    default_except = DEFAULT_EXCEPT
    runs_after = ("fuse *",)
    exclusive = "weights"
    overrides = ("fp8 storage",)
