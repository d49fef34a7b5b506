"""``quantize int8|nf4|fp4|hqq``: weight quantization with bitsandbytes and hqq."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import option
from ..registry import register
from .base import Transform

#: Linear layers (GPT-2's transposed ``Conv1D`` included).
LINEAR_TARGETS = ("Linear", "Conv1D")
#: What diffusers/transformers users skip: norms, embeddings, output heads.
DEFAULT_EXCEPT = ("norm", "embed", "embedding", "lm_head", "proj_out")


class _Quantize(Transform):
    verb = "quantize"
    default_target = LINEAR_TARGETS
    default_except = DEFAULT_EXCEPT
    runs_after = ("fuse *",)
    exclusive = "weights"


@dataclass(frozen=True)
class Int8Options:
    threshold: float = option(0.0, "LLM.int8 outlier threshold (0 = no outlier decomposition)", min=0.0)


@register
class Int8Quantization(_Quantize):
    mode = "int8"
    summary = "bitsandbytes LLM.int8 (Linear8bitLt)"
    Options = Int8Options

    def incompatible(self, other):
        if other.verb == "compile" and getattr(other.options, "fullgraph", False) and self.options.threshold > 0:
            return ("bitsandbytes int8 with an outlier threshold > 0 has data-dependent shapes, "
                    "which compile fullgraph=true cannot trace; use compile fullgraph=false (or threshold=0)")
        return None


@dataclass(frozen=True)
class FourBitOptions:
    compute: str = option("float32", "dtype the matmul runs in", kind="dtype")
    double_quant: bool = option(False, "quantize the quantization constants too")
    blocksize: int = option(64, "elements per quantization block",
                            choices=(32, 64, 128, 256, 512, 1024, 2048, 4096))


@register
class NF4Quantization(_Quantize):
    mode = "nf4"
    summary = "bitsandbytes 4-bit NormalFloat (Linear4bit)"
    Options = FourBitOptions


@register
class FP4Quantization(_Quantize):
    mode = "fp4"
    summary = "bitsandbytes 4-bit float (Linear4bit)"
    Options = FourBitOptions


@dataclass(frozen=True)
class HQQOptions:
    bits: int = option(4, "bits per weight", choices=(1, 2, 3, 4, 8))
    group_size: int = option(64, "weights per quantization group (must divide in_features)", min=1)
    axis: int = option(1, "axis the groups run along", choices=(0, 1))
    compute: str = option("float32", "dtype the matmul runs in", kind="dtype")


@register
class HQQQuantization(_Quantize):
    mode = "hqq"
    summary = "half-quadratic quantization (hqq HQQLinear)"
    Options = HQQOptions
