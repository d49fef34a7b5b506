"""``fp8 storage|native`` in a library's layout (``save(..., format="transformers" | "compressed-tensors")``).

transformers' ``fp8`` ``quantization_config`` (``FineGrainedFP8Config``): e4m3 ``Linear`` weights, our
scales as ``weight_scale_inv`` (per output row: ``weight_block_size = [1, in_features]``; per tensor: no
blocks); transformers runs them with its fp8 kernels on a GPU and dequantizes them on a CPU.  Or
compressed-tensors' ``float-quantized`` format (per output channel), which transformers loads with the
compressed-tensors package installed (and vLLM serves).  diffusers has no loader for pre-quantized fp8.
"""

from __future__ import annotations

from torch import nn

from ...errors import TransformError
from ...history import AppliedStep
from ...interop import rules
from ...interop.hook_types import Exported, QuantizationExport
from ...interop.rules import kept_in_float


def export_fp8(step: AppliedStep, out: Exported) -> None:
    where = out.where(step)
    if out.library != "transformers":
        raise TransformError(f"format='diffusers' cannot carry {where}: diffusers has no loader for "
                             "pre-quantized fp8 weights (its fp8 is run-time layerwise casting, "
                             "enable_layerwise_casting); drop the statement, quantize with int8/nf4/fp4, "
                             "or save with format='transformdsl'")
    steps = [(where, step.record)]
    previous = next((q for q in out.quantization if q.group == ("fp8",)), None)
    if previous is not None:  # several fp8 statements share one config
        previous.steps.extend(steps)
        previous.paths.update(step.record["layers"])
        return

    def config(out: Exported, module: nn.Module, layers: set[str], quantized: set[str]) -> dict:
        if out.fmt == "compressed-tensors":
            out.notes.append(f"fp8: {len(quantized)} layer(s) in compressed-tensors' float-quantized format (per "
                             "channel); transformers loads it with the compressed-tensors package installed")
            return compressed_tensors_config(out, layers, export.steps, quantized)
        out.notes.append(f"fp8: {len(quantized)} layer(s) as transformers' fp8 format (float8_e4m3fn weights, "
                         "weight_scale_inv); transformers dequantizes them on a CPU")
        return fp8_config(out, layers, export.steps, quantized, kept_in_float(module))

    export = QuantizationExport(kind="fp8", group=("fp8",), paths=set(step.record["layers"]), conv1d=False,
                                config=config, steps=steps)
    out.quantization.append(export)


def fp8_config(out: Exported, layers: set[str], steps: list[tuple[str, dict]], quantized: set[str],
         keep: list[str]) -> dict:
    """transformers' fp8 config; renames our scales to ``weight_scale_inv``."""
    from transformers import FineGrainedFP8Config

    per_row: set[bool] = set()
    widest = 1
    for where, record in steps:
        if record.get("dtype", "e4m3") != "e4m3":
            raise TransformError(f"format='transformers' cannot carry {where}: transformers' fp8 format is "
                                 "float8_e4m3fn; use dtype=e4m3")
        for path, spec in record["layers"].items():
            if spec.get("kind", "linear") != "linear":
                raise TransformError(f"format='transformers' cannot carry {where} on '{path}' ({spec['kind']}): "
                                     "transformers stores only Linear layers in fp8; exclude it (e.g. "
                                     f"'except {path.rpartition('.')[2]}'), or save with format='transformdsl'")
    for path in sorted(quantized):
        scale_key, new_key = f"{path}.weight_scale", f"{path}.weight_scale_inv"
        scale = out.tensors.pop(scale_key)
        out_features, in_features = out.tensors[f"{path}.weight"].shape
        per_row.add(scale.numel() != 1 or out_features == 1)
        widest = max(widest, int(in_features))
        out.tensors[new_key] = scale.reshape(-1, 1).contiguous() if scale.numel() != 1 else scale.reshape(())
        out.layout.append({"key": scale_key, "from": [new_key], "op": "rename", "shape": list(scale.shape)})
    if len(per_row) > 1:
        raise TransformError("format='transformers': fp8 layers with per-tensor and per-row scales in one model "
                             "(fp8 native scaling=tensor stores layers it cannot run natively per row); "
                             "use scaling=row, or save with format='transformdsl'")
    skip = rules.skip_list(layers, "transformers", quantized, keep)
    block = [1, widest] if per_row == {True} else None
    config = FineGrainedFP8Config(activation_scheme="dynamic", weight_block_size=block, modules_to_not_convert=skip)
    data = config.to_dict()
    data["modules_to_not_convert"] = skip
    data["weight_block_size"] = block
    return data


def compressed_tensors_config(out: Exported, layers: set[str], steps: list[tuple[str, dict]],
                        quantized: set[str]) -> dict:
    """compressed-tensors' config for our per-row e4m3 layers: their tensors are already its layout
    (``weight`` float8_e4m3fn, ``weight_scale`` float32 (out, 1)); unquantized Linears are ignored
    by exact name (its rule: a name equals an entry, or matches an ``re:`` entry)."""
    for where, record in steps:
        if record.get("dtype", "e4m3") != "e4m3" or record.get("scaling", "row") != "row":
            raise TransformError(f"format='compressed-tensors' cannot carry {where}: it stores e4m3 weights with "
                                 "one scale per output channel; use dtype=e4m3 (fp8 storage) or scaling=row "
                                 "(fp8 native)")
        for path, spec in record["layers"].items():
            if spec.get("kind", "linear") != "linear":
                raise TransformError(f"format='compressed-tensors' cannot carry {where} on '{path}' "
                                     f"({spec['kind']}): only Linear layers; exclude it, or save with "
                                     "format='transformdsl'")
    for path in quantized:
        scale = out.tensors[f"{path}.weight_scale"]
        if tuple(scale.shape) != (out.tensors[f"{path}.weight"].shape[0], 1):
            raise TransformError(f"format='compressed-tensors': '{path}' has a per-tensor scale; use scaling=row")
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": sorted(layers - quantized)}
