"""``quantize w8a8`` saved with ``format="compressed-tensors"`` (llm-compressor's int-quantized W8A8, what vLLM
serves), loaded by stock transformers with the compressed-tensors package in a process without transformdsl
(spec.md "Interchange"); ``quantize int4 symmetric=true`` as its pack-quantized W4A16, asymmetric int4 refused."""

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


def with_dequantized_int4(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s int4 layers multiplying float32 activations by their dequantized float32 weight, as
    compressed-tensors' decompressed ``nn.Linear`` does (ours: the packed kernel, bfloat16 activations)."""
    from transformdsl.transforms.quantize.int4 import Int4WeightOnlyLinear

    def forward(layer, x):
        return F.linear(x.float(), layer.dequantize(), layer.bias)

    for module in model.modules():
        if isinstance(module, Int4WeightOnlyLinear):
            module.forward = forward.__get__(module)
    return model


@pytest.mark.slow
def test_symmetric_int4_loads_in_stock_transformers_with_compressed_tensors(tmp_path):
    pytest.importorskip("compressed_tensors")
    from tests.trained import load_model

    model = transformdsl.transform(load_model(), "quantize int4 group_size=32 symmetric=true")
    ours = model(TOKENS).logits
    transformdsl.save(model, tmp_path / "ct", format="compressed-tensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["ignore"] == ["lm_head"]
    assert config["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True, "dynamic": False}
    stored = load_file(str(tmp_path / "ct" / "model.safetensors"))
    packed = stored["model.layers.0.mlp.down_proj.weight_packed"]
    layer = model.model.layers[0].mlp.down_proj
    assert packed.dtype == torch.int32 and "model.layers.0.mlp.down_proj.weight_zero" not in stored
    # the words are compressed-tensors' own packing of the signed values: its unpacker gives them back
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from transformdsl.transforms.quantize.int4 import unpack_nibbles

    signed = unpack_from_int32(packed, 4, torch.Size([layer.out_features, layer.in_features]))
    assert torch.equal(signed.int() + 8, unpack_nibbles(layer.packed_weight).int())
    stock = stock_logits(tmp_path / "ct", tmp_path)
    # The weights are carried exactly: multiplied as the stock layer does (float32), ours gives its logits...
    reference = with_dequantized_int4(transformdsl.load(tmp_path / "ct"))(TOKENS).logits
    assert torch.allclose(stock, reference, atol=1e-5, rtol=0)
    # ...and with our packed kernel (bfloat16 activations) within a bfloat16 matmul's rounding.
    assert kl_per_token(stock, ours).max() < 1e-3
    # transformdsl reads its own compressed-tensors save back exactly.
    again = transformdsl.load(tmp_path / "ct")
    assert torch.equal(again(TOKENS).logits, ours)
    assert torch.equal(again.model.layers[0].mlp.down_proj.weight_scale, layer.weight_scale)


def test_asymmetric_int4_is_refused_for_compressed_tensors_naming_the_mode_that_fits(tmp_path):
    model = transformdsl.transform(tiny_llama(), "quantize int4 group_size=32")
    with pytest.raises(TransformError, match="format='compressed-tensors' cannot carry line 1: 'quantize int4 "
                                             "group_size=32': its groups are asymmetric with a float zero") as caught:
        transformdsl.save(model, tmp_path / "out", format="compressed-tensors")
    assert "'quantize int4 symmetric=true'" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_symmetric_int4_groups_have_zero_points_of_zero_and_reload_bit_exactly(tmp_path):
    from transformdsl.transforms.quantize.int4 import Int4WeightOnlyLinear

    model = transformdsl.transform(tiny_llama(), "quantize int4 group_size=32 symmetric=true")
    layers = [m for m in model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    assert layers and all(not m.weight_zero.any() for m in layers)
    for m in layers:  # the largest magnitude of each group is 7.5 steps (it rounds to 8, clamped to 7)
        w = m.dequantize().reshape(m.out_features, -1, 32)
        assert bool((w.abs().amax(-1) <= 8 * m.weight_scale.float() + 1e-6).all())
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids).logits
    transformdsl.save(model, tmp_path / "out")
    assert torch.equal(transformdsl.load(tmp_path / "out")(ids).logits, before)


@pytest.mark.parametrize("tamper, message", [
    (lambda e: e["op"] == "zeros" and e.update(shape=[1 << 20, 1 << 10]), "refusing to allocate it"),
    (lambda e: e["op"] == "zeros" and e.update(dtype="complex128"), "malformed 'tensors.layout' entry"),
    (lambda e: e["op"] == "view" and e.update(shape=[3, 5]), "bytes; '"),
    (lambda e: e["op"] == "view" and e.update(shape=[1 << 40, 1 << 20]), "bytes; '"),
])
def test_a_tampered_int4_layout_entry_is_a_clear_load_error(tmp_path, tamper, message):
    from transformdsl.errors import LoadError

    model = transformdsl.transform(tiny_llama(), "quantize int4 group_size=32 symmetric=true")
    transformdsl.save(model, tmp_path / "ct", format="compressed-tensors")
    meta_path = tmp_path / "ct" / "transformdsl.json"
    meta = json.loads(meta_path.read_text())
    for entry in meta["tensors"]["layout"]:
        tamper(entry)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(LoadError, match=message):
        transformdsl.load(tmp_path / "ct")


def test_a_float32_scale_that_is_not_a_bfloat16_value_is_refused_on_load(tmp_path):
    from transformdsl.errors import LoadError

    model = transformdsl.transform(tiny_llama(), "quantize int4 group_size=32 symmetric=true")
    transformdsl.save(model, tmp_path / "ct", format="compressed-tensors")
    path = tmp_path / "ct" / "model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in tensors if k.endswith("weight_scale"))
    tensors[key] = tensors[key] * (1 + 2 ** -12)  # between two bfloat16 values
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(LoadError, match="does not hold bfloat16 values exactly"):
        transformdsl.load(tmp_path / "ct")
