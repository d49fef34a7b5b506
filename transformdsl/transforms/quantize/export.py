"""``quantize int8|nf4|fp4|hqq`` in a library's layout (``save(..., format="transformers" | "diffusers")``).

Our int8/nf4/fp4 layers are bitsandbytes' ``Linear8bitLt``/``Linear4bit`` and their state_dict keys are
the ones the libraries write, so the tensors go as they are; ``config.json`` gets the library's
``BitsAndBytesConfig`` with the script's options and a skip list checked against the library's rules
(:mod:`transformdsl.interop.rules`).  hqq is refused: transformers cannot load HQQ checkpoints and
diffusers has no HQQ loader.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import TransformError
from ...history import AppliedStep
from ...interop import rules
from ...interop.hook_types import Exported, QuantizationExport
from ...interop.rules import kept_in_float


def export_bitsandbytes(step: AppliedStep, out: Exported) -> None:
    """An int8/nf4/fp4 step: its layers under the library's bitsandbytes ``quantization_config``."""
    library, fmt, where = out.library, out.fmt, out.where(step)
    if step.options.get("weight_only"):
        raise TransformError(f"format={library!r} cannot carry {where}: bitsandbytes (the library's int8 "
                             "format) has no weight-only int8, and its LLM.int8 would compute something else; "
                             "drop weight_only=true, or save with format='transformdsl'")
    if fmt == "compressed-tensors":
        raise TransformError(f"format='compressed-tensors' carries fp8 layers, not {where}; use "
                             "format='transformers' for bitsandbytes")
    # transformers' loader converts `type(module) is nn.Linear` and Conv1D only (diffusers':
    # any nn.Linear): a quantized subclass (Falcon's FalconLinear) would load as float.
    other = sorted({layer.get("source") for layer in step.record["layers"]} - {"Linear", "Conv1D", None})
    if other and library == "transformers":
        paths = [layer["path"] for layer in step.record["layers"] if layer.get("source") in other]
        raise TransformError(f"format='transformers' cannot carry {where}: transformers' bitsandbytes loader "
                             f"quantizes nn.Linear and Conv1D layers only, not {', '.join(other)} "
                             f"({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}); exclude them "
                             f"('except {other[0]}'), or save with format='transformdsl'")
    key = step.key

    def config(out: Exported, module: nn.Module, layers: set[str], quantized: set[str]) -> dict:
        skip = rules.skip_list(layers, out.library, quantized, kept_in_float(module))
        out.notes.append(f"{key}: {len(quantized)} layer(s) as bitsandbytes {key.split()[1]} "
                         f"(quantization_config, {len(skip)} skip entries)")
        return bnb_config(out.library, key, step.options, skip)

    out.quantization.append(QuantizationExport(
        kind=key, group=(key, tuple(sorted(step.options.items()))),
        paths={layer["path"] for layer in step.record["layers"]}, conv1d=True, config=config))


def refuse_hqq(step: AppliedStep, out: Exported) -> None:
    raise TransformError(f"format={out.fmt!r} cannot carry {out.where(step)}: transformers cannot load HQQ "
                         "checkpoints (its HQQ quantizer raises NotImplementedError) and diffusers has no "
                         "HQQ loader; quantize with int8/nf4/fp4 for a stock-loadable save, or save with "
                         "format='transformdsl'")


def bnb_config(library: str, key: str, options: dict, skip: list[str]) -> dict:
    mode = key.split()[1]
    if library == "diffusers":
        from diffusers import BitsAndBytesConfig
    else:
        from transformers import BitsAndBytesConfig
    if mode == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=float(options.get("threshold", 0.0)),
                                    llm_int8_skip_modules=skip)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mode,
                                    bnb_4bit_compute_dtype=getattr(torch, options.get("compute", "float32")),
                                    bnb_4bit_use_double_quant=bool(options.get("double_quant", False)),
                                    bnb_4bit_quant_storage="uint8", llm_int8_skip_modules=skip)
    data = config.to_dict()
    data["llm_int8_skip_modules"] = skip  # [] must stay [] (None would let the loader add its defaults)
    return data
