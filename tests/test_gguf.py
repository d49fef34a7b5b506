"""GGUF (llama.cpp) interchange: ``quantize q8_0|q4_0``, ``save(..., format="gguf")`` read back by stock
transformers (``gguf_file=``), and ``load("file.gguf")`` (spec.md "Interchange", GGUF)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

import transformdsl
from transformdsl.errors import TransformError
from transformdsl.models.builtin import tiny_llama
from transformdsl.transforms.quantize.gguf_blocks import LAYERS

QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def kl_per_token(reference: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    p, q = reference.float().log_softmax(-1), ours.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def hard_weight(dtype=torch.float32) -> torch.Tensor:
    """Random rows, plus blocks that test the rounding rules: all zero, ties of magnitude with both
    signs, exact halves, one large outlier."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    w[0, :32] = 0
    w[1, :32] = torch.tensor([1.0, -1.0] * 16)
    w[2, :32] = torch.arange(32) / 2 - 8
    w[3, 5] = 40.0
    return w.to(dtype)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_bytes_are_the_gguf_reference_quantizers(kind, dtype):
    weight = hard_weight(dtype)
    layer = LAYERS[kind].build(weight, None)
    reference = gguf.quants.quantize(weight.float().numpy(), QTYPES[kind])
    assert np.array_equal(layer.gguf_bytes(), reference)
    # ...and the layer multiplies by what ggml's dequantization gives for those bytes.
    assert np.array_equal(layer.dequantize().numpy(), gguf.quants.dequantize(reference, QTYPES[kind]))


def test_block_modes_quantize_llama_within_their_bound_and_reload_exactly(tmp_path):
    model = tiny_llama()
    reference = model(TOKENS).logits
    for kind in ("q8_0", "q4_0"):
        quantized = transformdsl.transform(tiny_llama(), f"quantize {kind}")
        layer = quantized.model.layers[0].mlp.down_proj
        assert type(layer).__name__ == f"{kind.upper()}Linear" and quantized.lm_head.__class__ is nn.Linear
        out = quantized(TOKENS).logits
        assert 0 < (out - reference).abs().max() < (0.05 if kind == "q8_0" else 0.5)
        transformdsl.save(quantized, tmp_path / kind)
        assert torch.equal(transformdsl.load(tmp_path / kind)(TOKENS).logits, out)


def test_block_modes_skip_layers_whose_inputs_are_not_whole_blocks():
    model = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 8))
    plan = transformdsl.plan(model, "quantize q8_0")
    assert plan.steps[0].targets == ["1"]
    assert plan.steps[0].skipped == [("0", "in_features 48 is not a multiple of GGUF's block of 32")]


@pytest.fixture(scope="module")
def trained():
    from tests.trained import load_model

    return load_model(torch.bfloat16)


@pytest.mark.parametrize("script", ["", "quantize q8_0", "quantize q4_0"])
def test_gguf_export_loads_in_stock_transformers_with_our_logits(tmp_path, script):
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    if script:
        model = transformdsl.transform(model, script)
    ours = model(TOKENS).logits
    transformdsl.save(model, tmp_path, format="gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32)
    assert type(stock).__name__ == "LlamaForCausalLM"
    logits = stock(TOKENS).logits
    assert kl_per_token(logits, ours).max() <= 1e-4
    assert torch.allclose(logits, ours, atol=1e-5, rtol=0)


def test_gguf_export_of_the_trained_bf16_llama_in_q8_0(tmp_path, trained):
    """Real trained weights in bfloat16: Q8_0 blocks of the projections, BF16 embeddings and head."""
    from transformers import AutoModelForCausalLM

    model = transformdsl.transform(trained, "quantize q8_0")
    tokens = torch.tensor([list(b"def f(x):\n    return x + 1\n")])
    ours = model(tokens).logits.float()
    transformdsl.save(model, tmp_path, format="gguf")
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["token_embd.weight"] == "BF16"
    assert types["blk.0.attn_norm.weight"] == "F32"
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.bfloat16)
    assert kl_per_token(stock(tokens).logits, ours).max() <= 1e-4


@pytest.mark.parametrize("script, message", [
    ("quantize int8 weight_only=true", "'quantize q8_0'"),
    ("quantize int4 group_size=32", "'quantize q4_0'"),
    ("quantize w8a8", "'quantize q8_0' (8-bit) or 'quantize q4_0'"),
    ("fuse qkv", "drop it for a GGUF save"),
])
def test_gguf_export_refuses_what_it_cannot_carry_naming_the_fit(tmp_path, script, message):
    model = transformdsl.transform(tiny_llama(), script)
    with pytest.raises(TransformError, match="format='gguf' cannot carry line 1") as error:
        transformdsl.save(model, tmp_path / "out", format="gguf")
    assert message in str(error.value)
    assert not (tmp_path / "out").exists()


def test_gguf_export_refuses_other_architectures(tmp_path):
    from transformdsl.models.builtin import BUILTIN

    with pytest.raises(TransformError, match="format='gguf' writes causal language models.*GPT2LMHeadModel"):
        transformdsl.save(BUILTIN["gpt2"](), tmp_path / "out", format="gguf")


def test_block_layers_are_refused_in_a_library_layout(tmp_path):
    model = transformdsl.transform(tiny_llama(), "quantize q8_0")
    with pytest.raises(TransformError, match="GGUF's Q8_0 blocks have no transformers layout.*format='gguf'"):
        transformdsl.save(model, tmp_path / "out", format="transformers")
