"""The same jobs done by hand, the way users write them with the underlying libraries.

Each function takes a model (fp32 or bf16, eval) and returns the transformed model, like a
user's snippet would.  They choose the same layers as transformdsl's defaults (written as
users write skip lists: names of path segments), with the same library options, so that
bytes, latency and error compare one job done two ways; the harness checks that both sides
changed the same number of layers and shows it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

#: What users skip when quantizing (transformers' ``llm_int8_skip_modules``, diffusers'
#: ``keep_in_fp32_modules``), the same layers as transformdsl's default exclusions: norms (and
#: the modulation linears inside them), embeddings and embedders, output heads (``lm_head``,
#: a DiT's top-level ``proj_out``).  Matched on whole tokens of each path segment.
SKIP_TOKENS = {"norm", "embed", "embedding", "embedder"}
SKIP_WORDS = re.compile(r"(^|_)lm_head(_|$)")


def skipped(path: str) -> bool:
    """Whether a user's quantization skip list names ``path`` (or a module above it)."""
    if path == "proj_out":
        return True
    for segment in path.split("."):
        if SKIP_TOKENS & set(re.split(r"[_\d]+", segment)) or SKIP_WORDS.search(segment):
            return True
    return False


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Swap every ``nn.Linear`` not skipped for ``make(linear)``: the usual by-hand loop.

    New modules start in training mode; the model is put back in the mode it was in, as
    transformers' and diffusers' ``from_pretrained(quantization_config=...)`` leave it (eval).
    That matters: in training mode bitsandbytes' int8 layers take another code path on the CPU
    (dequantize the weight, then a float matmul) than in eval mode (int8 matmul).
    """
    training = model.training
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            full = f"{path}.{name}" if path else name
            if isinstance(child, nn.Linear) and not skipped(full):
                setattr(module, name, make(child))
    return model.train(training)


# ---------------------------------------------------------------------- bitsandbytes

def bnb_int8(model: nn.Module) -> nn.Module:
    """``Linear8bitLt`` (threshold 0, transformdsl's default), quantized by ``.to(device)``."""
    import bitsandbytes as bnb

    def make(linear: nn.Linear) -> nn.Module:
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  has_fp16_weights=False, threshold=0.0)
        new.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
        if linear.bias is not None:
            new.bias = linear.bias
        return new.to(linear.weight.device)  # Int8Params quantize when moved to a device

    return replace_linears(model, make)


def bnb_4bit(quant_type: str, compute: torch.dtype = torch.float32) -> Callable[[nn.Module], nn.Module]:
    """``Linear4bit`` with transformdsl's defaults: fp32 compute, blocks of 64, no double quant."""

    def convert(model: nn.Module) -> nn.Module:
        import bitsandbytes as bnb

        def make(linear: nn.Linear) -> nn.Module:
            new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    compute_dtype=compute, compress_statistics=False, quant_type=quant_type)
            new.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, blocksize=64,
                                           compress_statistics=False, quant_type=quant_type)
            if linear.bias is not None:
                new.bias = linear.bias
            return new.to(linear.weight.device)  # Params4bit quantize when moved to a device

        return replace_linears(model, make)

    convert.__name__ = f"bnb_{quant_type}"
    return convert


# ---------------------------------------------------------------------- hqq

def hqq_group_size(model: nn.Module) -> int:
    """The group size users pick: hqq's usual 64, or the largest power of two dividing every
    quantized layer's inputs (the tiny models have 16- and 32-wide layers)."""
    widths = [m.in_features for p, m in model.named_modules() if isinstance(m, nn.Linear) and not skipped(p)]
    return next(g for g in (64, 32, 16, 8) if all(w % g == 0 for w in widths))


def hqq_4bit(model: nn.Module) -> nn.Module:
    """``HQQLinear`` 4-bit, groups along axis 1, fp32 compute (transformdsl's defaults)."""
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    config = BaseQuantizeConfig(nbits=4, group_size=hqq_group_size(model), axis=1)

    def make(linear: nn.Linear) -> nn.Module:
        return HQQLinear(linear, config, compute_dtype=torch.float32, device=str(linear.weight.device))

    return replace_linears(model, make)


# ---------------------------------------------------------------------- diffusers

def diffusers_fuse_qkv(model: nn.Module) -> nn.Module:
    """diffusers' own ``fuse_qkv_projections()`` (keeps ``to_q/to_k/to_v`` beside the fused layer)."""
    model.fuse_qkv_projections()
    return model


def diffusers_layerwise_fp8(model: nn.Module) -> nn.Module:
    """diffusers' layerwise casting: weights stored in float8_e4m3fn, upcast to bf16 per layer."""
    if hasattr(model, "enable_layerwise_casting"):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    else:  # transformers models: the same hooks, applied with diffusers' function
        from diffusers.hooks import apply_layerwise_casting

        apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    return model


def diffusers_compile_repeated_blocks(model: nn.Module) -> nn.Module:
    """diffusers' regional compilation: ``torch.compile`` on each repeated block class."""
    model.compile_repeated_blocks(fullgraph=False)
    return model


# ---------------------------------------------------------------------- torch / torchao

def torch_compile(model: nn.Module) -> nn.Module:
    """``torch.compile(model)`` with its defaults (inductor, fullgraph=False)."""
    return torch.compile(model)


def _torchao_filter(module: nn.Module, fqn: str) -> bool:
    return type(module) is nn.Linear and not skipped(fqn)


def torchao_int8_weight_only(model: nn.Module) -> nn.Module:
    """torchao ``quantize_(model, Int8WeightOnlyConfig())``: int8 weights, per-channel scales."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=_torchao_filter)
    return model


def torchao_int8_dynamic(model: nn.Module) -> nn.Module:
    """torchao ``Int8DynamicActivationInt8WeightConfig``: int8 weights and activations (W8A8)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=_torchao_filter)
    return model


def torchao_float8_weight_only(model: nn.Module) -> nn.Module:
    """torchao ``Float8WeightOnlyConfig``: float8 weights, upcast in the matmul."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    quantize_(model, Float8WeightOnlyConfig(), filter_fn=lambda m, fqn: type(m) is nn.Linear and not fp8_skip(fqn))
    return model


#: diffusers' ``DEFAULT_SKIP_MODULES_PATTERN`` for layerwise casting (``re.search`` on the path),
#: which torchao users copy to keep the same layers in high precision.
FP8_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")


def fp8_skip(path: str) -> bool:
    return any(re.search(pattern, path) for pattern in FP8_SKIP)


#: How the untransformed model is labelled as a "baseline" (report.py keeps it out of the by-hand tables).
UNCHANGED_LABEL = "the model unchanged (same process)"


def unchanged(model: nn.Module) -> nn.Module:
    """No transform: the model as read (float32; bfloat16 for the fp8 comparisons).  As a
    "baseline" its job times our model and the untransformed one in turn in one process, which
    is the robust way to measure ours ÷ the original on a busy machine."""
    return model


def chain(*steps: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """Several by-hand steps one after the other (e.g. fuse, then quantize)."""

    def run(model: nn.Module) -> nn.Module:
        for step in steps:
            model = step(model)
        return model

    run.__name__ = "+".join(step.__name__ for step in steps)
    return run
