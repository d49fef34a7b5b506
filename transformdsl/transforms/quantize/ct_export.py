"""``quantize w8a8`` and ``quantize int4`` in compressed-tensors' layout (``save(..., format="compressed-tensors")``).

- ``w8a8``: compressed-tensors' ``int-quantized`` format (llm-compressor's W8A8, what vLLM serves with
  its int8 kernels): ``weight`` int8 as stored, ``weight_scale`` our float32 per-row scale as
  ``(out, 1)``; input activations int8, symmetric, per token, dynamic.  The weights are exact; the
  activations are quantized by the reader at run time (vLLM: ``amax / 127``, our scheme;
  compressed-tensors' own reference forward in transformers: ``amax / 127.5``, clamped to -128..127,
  which rounds differently: outputs within the int8 noise, not bit-equal).
- ``int4``: refused.  Our groups are asymmetric with a float (bfloat16) zero point (torchao's tinygemm
  scheme); compressed-tensors' ``pack-quantized`` groups are symmetric or have an integer zero point,
  so writing ours there would quantize a second time.
"""

from __future__ import annotations

from torch import nn

from ...history import AppliedStep
from ...interop.hook_types import Exported, QuantizationExport


def export_compressed(step: AppliedStep, out: Exported) -> None:
    """A ``w8a8`` step under a compressed-tensors ``quantization_config``; ``int4`` refused."""
    if step.key == "quantize int4":
        raise out.refuse(step, "its groups are asymmetric with a bfloat16 zero point (torchao's tinygemm "
                               "scheme), and compressed-tensors' pack-quantized groups are symmetric or "
                               "have an integer zero point: writing them there would quantize again",
                         "save with format='transformdsl', or format='gguf' after 'quantize q4_0'")
    other = sorted({layer.get("source") for layer in step.record["layers"]} - {"Linear"})
    if other:
        raise out.refuse(step, f"compressed-tensors quantizes nn.Linear layers, not {', '.join(map(str, other))}",
                         f"exclude them ('except {other[0]}'), or save with format='transformdsl'")
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
