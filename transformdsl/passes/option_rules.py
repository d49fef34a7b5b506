"""Options classes with rules across their fields (``__post_init__``), kept free of torch.

``transformdsl check`` validates scripts without importing torch (see :mod:`transformdsl.catalog`):
an options class whose ``__post_init__`` checks one field against another is imported from here,
as is, by the catalog.  Their transforms import them back (``fp8 native``, ``quantize int8``, ``quantize hqq``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..options import option


@dataclass(frozen=True)
class NativeOptions:
    scaling: str = option("tensor", "weight/activation scale granularity", choices=("tensor", "row"))
    activation: str = option("dynamic", "how activations are scaled", choices=("dynamic",))
    compute: str = option("bfloat16", "output dtype of the fp8 matmul", kind="dtype")
    strict: bool = option(False, "error instead of upcasting where the device has no fp8 matmul")

    def __post_init__(self):
        # Row-wise scaling runs CUTLASS's f8f8bf16_rowwise on sm89: bfloat16 output only.
        if self.scaling == "row" and self.compute != "bfloat16":
            raise ValueError(f"scaling=row needs compute=bfloat16 (the row-wise fp8 kernels write bfloat16), "
                             f"got compute={self.compute}")


@dataclass(frozen=True)
class HQQOptions:
    bits: int = option(4, "bits per weight", choices=(1, 2, 3, 4, 8))
    group_size: int | str = option(64, "weights per quantization group (a multiple of 8 that divides in_features), "
                                   "or auto: the largest of 128, 64, 32, 16, 8 that suits each layer",
                                   min=8, kind="int_or_auto")
    axis: int = option(1, "axis the groups run along (1: along a row's inputs; 0: down a column)", choices=(0, 1))
    compute: str = option("float32", "dtype the matmul runs in", kind="dtype")

    def __post_init__(self):
        if self.group_size != "auto" and self.group_size % 8:
            below = max(8, self.group_size // 8 * 8)
            raise ValueError(f"hqq group_size must be a multiple of 8, got {self.group_size}; "
                             f"try {below} or {below + 8}")


@dataclass(frozen=True)
class Int8Options:
    threshold: float = option(0.0, "LLM.int8 outlier threshold (0 = no outlier decomposition)", min=0.0)
    weight_only: bool = option(False, "int8 weights, float activations and matmul (W8A16) instead of LLM.int8")

    def __post_init__(self):
        if self.weight_only and self.threshold:
            raise ValueError(f"threshold={self.threshold:g} is LLM.int8's activation outlier threshold; "
                             "weight_only=true never quantizes activations: drop one of the two")
