"""``quantize w8a8`` saved with ``format="compressed-tensors"`` (llm-compressor's int-quantized W8A8, what vLLM
serves), loaded by stock transformers with the compressed-tensors package in a process without transformdsl
(spec.md "Interchange"); ``quantize int4`` refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import transformdsl
from transformdsl.errors import TransformError
from transformdsl.models.builtin import tiny_llama

ROOT = Path(__file__).resolve().parent.parent
TOKENS = torch.tensor([list(b"def f(x):\n    return x + 1\n")])


def stock_logits(directory: Path, tmp: Path) -> torch.Tensor:
    """The logits stock transformers computes for :data:`TOKENS` from ``directory`` (tests/stock_loader.py,
    a fresh process that cannot import transformdsl)."""
    save_file({"arg0": TOKENS}, str(tmp / "in.safetensors"))
    jobs = [{"dir": str(directory), "library": "transformers", "class": "LlamaForCausalLM",
             "inputs": str(tmp / "in.safetensors"), "out": str(tmp / "out.safetensors")}]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "stock_loader.py"), str(tmp / "jobs.json")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return load_file(str(tmp / "out.safetensors"))["out"]


def with_reference_activations(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s w8a8 layers computing as compressed-tensors' reference forward does: the same int8
    weights and scales, activations fake-quantized per token with ``amax / 127.5`` clamped to -128..127."""
    from transformdsl.transforms.quantize.w8a8 import Int8DynamicLinear

    def forward(layer, x):
        scale = x.abs().amax(dim=-1, keepdim=True) / 127.5
        xq = torch.clamp(torch.round(x / scale), -128, 127) * scale
        weight = layer.int8_weight.float() * layer.weight_scale.float()[:, None]
        return F.linear(xq, weight, layer.bias)

    for module in model.modules():
        if isinstance(module, Int8DynamicLinear):
            module.forward = forward.__get__(module)
    return model


def kl_per_token(reference: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    p, q = reference.float().log_softmax(-1), ours.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.mark.slow
def test_w8a8_loads_in_stock_transformers_with_compressed_tensors(tmp_path):
    pytest.importorskip("compressed_tensors")
    from tests.trained import load_model

    model = transformdsl.transform(load_model(), "quantize w8a8")
    ours = model(TOKENS).logits
    transformdsl.save(model, tmp_path / "ct", format="compressed-tensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized" and config["ignore"] == ["lm_head"]
    assert config["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    stock = stock_logits(tmp_path / "ct", tmp_path)
    # The weights are carried exactly: with compressed-tensors' own activation rounding, ours computes
    # the stock logits up to float rounding...
    reference = with_reference_activations(transformdsl.load(tmp_path / "ct"))(TOKENS).logits
    assert torch.allclose(stock, reference, atol=1e-4, rtol=0)
    # ...and with ours (amax / 127, as vLLM's int8 kernels) it is within the int8 activation noise.
    assert kl_per_token(stock, ours).max() < 0.01
    # transformdsl reads its own compressed-tensors save back exactly.
    assert torch.equal(transformdsl.load(tmp_path / "ct")(TOKENS).logits, ours)


def test_int4_is_refused_for_compressed_tensors_saying_why(tmp_path):
    model = transformdsl.transform(tiny_llama(), "quantize int4 group_size=32")
    with pytest.raises(TransformError, match="format='compressed-tensors' cannot carry line 1: 'quantize int4 "
                                             "group_size=32': its groups are asymmetric with a bfloat16 zero"):
        transformdsl.save(model, tmp_path / "out", format="compressed-tensors")
    assert not (tmp_path / "out").exists()
