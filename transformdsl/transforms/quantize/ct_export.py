"""``quantize w8a8`` and ``quantize int4`` in compressed-tensors' layout (``save(..., format="compressed-tensors")``).

- ``w8a8``: compressed-tensors' ``int-quantized`` format (llm-compressor's W8A8, what vLLM serves with
  its int8 kernels): ``weight`` int8 as stored, ``weight_scale`` our float32 per-row scale as
  ``(out, 1)``; input activations int8, symmetric, per token, dynamic.  The weights are exact; the
  activations are quantized by the reader at run time (vLLM: ``amax / 127``, our scheme;
  compressed-tensors' own reference forward in transformers: ``amax / 127.5``, clamped to -128..127,
  which rounds differently: outputs within the int8 noise, not bit-equal).
- ``int4 symmetric=true``: compressed-tensors' ``pack-quantized`` format (llm-compressor's W4A16, what
  vLLM serves with its Marlin/Machete kernels): ``weight_packed`` is our nibble bytes read as int32
  (eight 4-bit values per word, the first in the low bits: compressed-tensors' ``pack_to_int32`` of
  ``q - 8``), ``weight_scale`` our scales as float32 (exact), ``weight_shape``; no zero point.  The
  weights are exact: the reader dequantizes ``(q - 8) * scale`` in float32, as our layer does.
- ``int4`` with asymmetric groups (the default): refused.  Their zero point is a float (torchao's
  tinygemm scheme); compressed-tensors' groups have an integer zero point, so writing ours there would
  quantize a second time.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ...history import AppliedStep
from ...interop.hook_types import Exported, QuantizationExport


def export_compressed(step: AppliedStep, out: Exported) -> None:
    """A ``w8a8`` or ``int4 symmetric=true`` step under a compressed-tensors ``quantization_config``."""
    if step.key == "quantize int4":
        return _export_int4(step, out)
    _linear_only(step, out)
    paths = {layer["path"] for layer in step.record["layers"]}
    for path in sorted(paths):
        key = f"{path}.weight_scale"
        scale = out.tensors[key]
        out.tensors[key] = scale.reshape(-1, 1)
        out.layout.append({"key": key, "from": [key], "op": "rename", "shape": list(scale.shape)})

    def config(out: Exported, module: nn.Module, layers: set[str], quantized: set[str]) -> dict:
        out.notes.append(f"w8a8: {len(quantized)} layer(s) in compressed-tensors' int-quantized format (int8 "
                         "weights per channel, int8 activations per token, dynamic); transformers loads it "
                         "with the compressed-tensors package installed, vLLM serves it")
        weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}
        activations = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": activations, "output_activations": None}},
                "ignore": sorted(layers - quantized)}

    out.quantization.append(QuantizationExport(kind=step.key, group=("compressed-tensors w8a8",), paths=paths,
                                               conv1d=False, config=config))


def _linear_only(step: AppliedStep, out: Exported) -> None:
    other = sorted({layer.get("source") for layer in step.record["layers"]} - {"Linear"})
    if other:
        raise out.refuse(step, f"compressed-tensors quantizes nn.Linear layers, not {', '.join(map(str, other))}",
                         f"exclude them ('except {other[0]}'), or save with format='transformdsl'")


def _export_int4(step: AppliedStep, out: Exported) -> None:
    if step.options.get("activations") == "int8":
        raise out.refuse(step, "its layers round their inputs to int8 per 32 (activations=int8), which "
                               "compressed-tensors' W4A16 scheme does not say: a reader would compute another model",
                         "drop activations=int8 (the same weights, float activations: W4A16), or save with "
                         "format='transformdsl'")
    if not step.options.get("symmetric"):
        raise out.refuse(step, "its groups are asymmetric with a float zero point (torchao's tinygemm scheme), "
                               "and compressed-tensors' pack-quantized groups have an integer zero point: "
                               "writing them there would quantize again",
                         "quantize with 'quantize int4 symmetric=true' (llm-compressor's W4A16 groups), or save "
                         "with format='transformdsl', or format='gguf' after 'quantize q4_0'")
    if sys.byteorder != "little":  # weight_packed's words are the nibble bytes read little-endian
        raise out.refuse(step, "this machine is big-endian; compressed-tensors' int32 words are little-endian",
                         "save with format='transformdsl'")
    _linear_only(step, out)
    group_size = int(step.options["group_size"])
    paths = {layer["path"] for layer in step.record["layers"]}
    for path in sorted(paths):
        nibbles, scale_key, zero_key = f"{path}.weight", f"{path}.weight_scale", f"{path}.weight_zero"
        packed, scale, zero = out.tensors.pop(nibbles), out.tensors[scale_key], out.tensors.pop(zero_key)
        if bool(zero.any()):
            raise out.refuse(step, f"'{path}' has non-zero zero points (a layer that is not symmetric)",
                             "save with format='transformdsl'")
        rows, half = packed.shape
        out.tensors[f"{path}.weight_packed"] = packed.contiguous().view(torch.int32)
        out.tensors[f"{path}.weight_shape"] = torch.tensor([rows, 2 * half], dtype=torch.int64)
        out.layout.append({"key": nibbles, "from": [f"{path}.weight_packed"], "op": "view", "dtype": "uint8",
                           "shape": [rows, half]})
        out.layout.append({"key": zero_key, "from": [f"{path}.weight_shape"], "op": "zeros",
                           "dtype": str(zero.dtype).removeprefix("torch."), "shape": list(zero.shape)})
        if scale.dtype != torch.float32:
            out.tensors[scale_key] = scale.float()
            out.layout.append({"key": scale_key, "from": [scale_key], "op": "cast",
                               "dtype": str(scale.dtype).removeprefix("torch.")})

    def config(out: Exported, module: nn.Module, layers: set[str], quantized: set[str]) -> dict:
        out.notes.append(f"int4: {len(quantized)} layer(s) in compressed-tensors' pack-quantized format (symmetric "
                         f"int4 groups of {group_size}, scales in float32, bfloat16 or float activations: W4A16); "
                         "transformers loads it with the compressed-tensors package installed, vLLM serves it")
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size, "symmetric": True,
                   "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None, "output_activations": None}},
                "ignore": sorted(layers - quantized)}

    out.quantization.append(QuantizationExport(kind=step.key, group=("compressed-tensors int4", group_size),
                                               paths=paths, conv1d=False, config=config))
