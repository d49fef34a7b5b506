"""Quantized compute: ``quantize w8a8`` (int8 x int8 with dynamic per-token activations), the packed
weight-only kernels (``quantize int8 weight_only=true`` decoding in bfloat16, ``quantize int4``).

Every numerical claim is checked against a reference computed by hand in float32 from the stored
tensors (the scheme as torchao defines it), on the real torch kernels of this machine; which kernel
a layer takes follows the detected CPU, and the fallbacks are tested by hiding the CPU flags
(``capabilities.hidden_cpu_flags``), never by guessing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import capabilities, models  # noqa: E402
from transformdsl.errors import ScriptError, TransformError  # noqa: E402
from transformdsl.registry import declaration  # noqa: E402
from transformdsl.transforms.quantize import device_notes
from transformdsl.transforms.quantize import int4 as int4_layers  # noqa: E402
from transformdsl.transforms.quantize.int8_weight_only import Int8WeightOnlyLinear  # noqa: E402
from transformdsl.transforms.quantize.w8a8 import Int8DynamicLinear, quantize_tokens  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FACTORIES = {"llama": models.tiny_llama, "flux": models.tiny_flux}
SCRIPTS = ["quantize w8a8", "quantize int4 group_size=32"]
LAYER = {"quantize w8a8": Int8DynamicLinear, "quantize int4 group_size=32": int4_layers.Int4WeightOnlyLinear}


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The declared error's measure: ``max|after - before| / max|before|``."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def w8a8_by_hand(x: torch.Tensor, layer: Int8DynamicLinear) -> torch.Tensor:
    """torchao's Int8DynamicActivationInt8Weight, by hand in float64 from the stored tensors."""
    x64 = x.double()
    x_scale = (x64.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127)
    xq = torch.round(x64 / x_scale).clamp(-127, 127)
    out = (xq @ layer.int8_weight.double().t()) * x_scale * layer.weight_scale.double()
    return out if layer.bias is None else out + layer.bias.double()


# --------------------------------------------------------------------------- layers


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_w8a8_layer_is_the_scheme_computed_by_hand(rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    layer = Int8DynamicLinear.build(linear.weight.detach(), linear.bias.detach())
    x = torch.randn(rows, 96) * 3
    expected = w8a8_by_hand(x, layer)
    # int32 accumulation (int_mm) or float32 sums of the same int8 values: equal up to float32 rounding
    assert max_error(layer(x), expected) < 1e-6
    assert layer.cpu_kernel == capabilities.w8a8_kernel("cpu")
    assert layer(x.bfloat16()).dtype == torch.bfloat16  # rescaled to the activation dtype
    assert max_error(layer(x), linear(x)) < 0.02  # and close to the float layer


def test_w8a8_kernel_follows_the_detected_cpu():
    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    x = torch.randn(7, 128)
    with capabilities.hidden_cpu_flags(*capabilities.INT8_DOT_FLAGS):
        assert not capabilities.cpu_int8_dot() and capabilities.w8a8_kernel("cpu") == "float"
        fallback = Int8DynamicLinear.build(weight, None)
    assert fallback.cpu_kernel == "float"
    native = Int8DynamicLinear.build(weight, None)
    assert native.cpu_kernel == ("int_mm" if capabilities.cpu_int8_dot() else "float")
    # the same int8 sums: in_features * 127 * 127 < 2**24, so float32 holds them exactly
    assert torch.equal(fallback(x), native(x))


def test_quantize_tokens_is_per_row_symmetric():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [100.0, 50.0, -100.0]])
    q, s = quantize_tokens(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0]
    assert torch.allclose(s.squeeze(1), torch.tensor([2 / 127, 1e-12 / 127, 100 / 127]))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_matches_its_dequantized_weight(group_size):
    torch.manual_seed(1)
    linear = nn.Linear(256, 48)
    layer = int4_layers.Int4WeightOnlyLinear.build(linear.weight.detach(), linear.bias.detach(), group_size)
    stored = layer.state_dict()
    assert {k: v.dtype for k, v in stored.items()} == {"weight": torch.uint8, "weight_scale": torch.bfloat16,
                                                       "weight_zero": torch.bfloat16, "bias": torch.float32}
    assert stored["weight"].shape == (48, 128) and stored["weight_scale"].shape == (48, 256 // group_size)
    # the asymmetric scheme: every weight within half a step of its group's grid
    w = layer.dequantize()
    step = layer.weight_scale.float().repeat_interleave(group_size, 1)
    assert ((w - linear.weight.detach()).abs() <= step * 0.51 + 1e-3).all()
    x = torch.randn(5, 256)
    reference = (x.bfloat16().float() @ w.t() + linear.bias.detach())
    out = layer(x)
    assert layer.packed_kernel == ("int4" in capabilities.packed_cpu_kernels())
    assert max_error(out, reference) < 0.01  # bfloat16 compute
    assert max_error(out, linear(x)) < 0.1


def test_int4_nibbles_round_trip():
    values = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    packed = int4_layers.pack_nibbles(values)
    assert packed.shape == (16, 32) and torch.equal(int4_layers.unpack_nibbles(packed), values)
    assert packed[0, 0].item() == values[0, 0].item() | (values[0, 1].item() << 4)  # even input: low nibble


def test_int8_weight_only_decodes_with_the_packed_kernel_in_bfloat16(aten_kernels):
    torch.manual_seed(2)
    linear = nn.Linear(128, 64).to(torch.bfloat16)
    layer = Int8WeightOnlyLinear.build(linear.weight.detach(), linear.bias.detach())
    reference = layer.dequantize()
    for rows in (1, 8, 40):  # decode-sized (packed kernel where present) and prefill-sized (blocked)
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        expected = x.float() @ reference.t() + linear.bias.float()
        assert max_error(layer(x), expected) < 0.01
    assert layer.packed_kernel == ("int8" in capabilities.packed_cpu_kernels())
    odd = Int8WeightOnlyLinear.build(torch.randn(16, 24), None)  # 24 inputs: the kernel would misread them
    assert not odd.packed_kernel
    assert max_error(odd(torch.ones(1, 24, dtype=torch.bfloat16)), torch.ones(1, 24) @ odd.dequantize().t()) < 0.01


# --------------------------------------------------------------------------- models


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_models_within_declared_bound_and_reload_in_a_fresh_process(name, script, tmp_path):
    model = FACTORIES[name]()
    reference = models.run(model)
    transformdsl.transform(model, script, verify=True)  # fails above the declared bound
    bound = declaration(" ".join(script.split()[:2])).error_bound["max"]
    out = models.run(model)
    assert 0 < max_error(out, reference) < bound
    layers = [m for m in model.modules() if type(m) is LAYER[script]]
    assert layers
    directory = transformdsl.save(model, tmp_path / "saved")
    torch.save(out, tmp_path / "expected.pt")
    code = ("import torch, transformdsl; from transformdsl import models; "
            f"m = transformdsl.load({str(directory)!r}); "
            f"assert torch.equal(models.run(m), torch.load({str(tmp_path / 'expected.pt')!r})); print('same')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.stdout.strip() == "same", result.stderr[-2000:]


@pytest.mark.parametrize("script", ["quantize w8a8", "quantize int4 group_size=32",
                                    "quantize int8 weight_only=true"])
def test_bfloat16_llama_saves_device_independent_tensors(script, tmp_path):
    model = models.tiny_llama().to(torch.bfloat16)
    transformdsl.transform(model, script)
    out = models.run(model)
    loaded = transformdsl.load(transformdsl.save(model, tmp_path / "s"))
    assert torch.equal(models.run(loaded), out)
    saved = transformdsl.load(tmp_path / "s").state_dict()
    assert all(t.dtype in (torch.int8, torch.uint8, torch.bfloat16, torch.float32) for t in saved.values())


def test_w8a8_composes_with_fuse_qkv_and_whole_compile(tmp_path):
    model = models.tiny_llama()
    reference = models.run(model)
    transformdsl.transform(model, "fuse qkv; quantize w8a8")
    fused = models.run(model)
    assert max_error(fused, reference) < 0.05
    assert any(type(m) is Int8DynamicLinear and m.out_features == 128 for m in model.modules())  # q+k+v, fused
    compiled = models.tiny_llama()
    transformdsl.transform(compiled, "fuse qkv; quantize w8a8; compile fullgraph=true")
    assert max_error(models.run(compiled), fused) < 1e-5


def test_int4_compiles_whole_with_its_packed_layout():
    model = models.tiny_llama()
    transformdsl.transform(model, "quantize int4 group_size=32")
    compiled = models.tiny_llama()
    transformdsl.transform(compiled, "quantize int4 group_size=32; compile fullgraph=true")
    assert max_error(models.run(compiled), models.run(model)) < 1e-5


def test_w8a8_composes_with_regional_compile():
    model = models.tiny_flux()
    transformdsl.transform(model, "quantize w8a8")
    eager = models.run(model)
    regional = models.tiny_flux()
    transformdsl.transform(regional, "quantize w8a8; compile regional in *TransformerBlock")
    assert max_error(models.run(regional), eager) < 1e-5


def test_refused_layers_are_named_with_the_reason():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 40), nn.Linear(12, 64), nn.Linear(64, 20))
    step = transformdsl.plan(model, "quantize w8a8").steps[0]
    assert step.targets == ["0", "1"]
    misses = dict(step.skipped)
    assert "too small" in misses["2"] and "multiples of 8" in misses["3"]
    step = transformdsl.plan(model, "quantize int4 group_size=32").steps[0]
    assert step.targets == ["0"]
    misses = dict(step.skipped)
    assert "multiples of 16" in misses["1"] and "does not divide" in misses["2"]


def test_declared_exclusions_are_honoured():
    from transformers import T5Config, T5EncoderModel

    model = T5EncoderModel(T5Config(vocab_size=32, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    for script in ("quantize w8a8", "quantize int4 group_size=32"):
        step = transformdsl.plan(model, script).steps[0]
        assert not any(p.endswith("DenseReluDense.wo") for p in step.targets)
        assert any(p.endswith("SelfAttention.q") for p in step.targets)


def test_int4_weight_only_false_is_refused_with_the_fix():
    with pytest.raises(ScriptError, match="quantize w8a8"):
        transformdsl.plan(nn.Sequential(nn.Linear(64, 64)), "quantize int4 weight_only=false")


# --------------------------------------------------------------------------- device notes


def test_w8a8_note_when_the_cpu_has_no_int8_dot_products():
    with capabilities.hidden_cpu_flags(*capabilities.INT8_DOT_FLAGS):
        step = transformdsl.plan(models.tiny_llama(), "quantize w8a8").steps[0]
        assert step.device_note == device_notes.w8a8_note("cpu", {"float32"})
        assert "float32" in step.device_note and "weight_only=true" in step.device_note
        assert os.environ[capabilities.HIDE_FLAGS_ENV]
    assert capabilities.HIDE_FLAGS_ENV not in os.environ
    with capabilities.hidden_cpu_flags("amx_bf16"):
        step = transformdsl.plan(models.tiny_llama(), "quantize w8a8").steps[0]
        assert (step.device_note is None) == capabilities.cpu_int8_dot()
    step = transformdsl.plan(models.tiny_llama(), "quantize w8a8").steps[0]
    if capabilities.cpu_int8_dot() and "amx_bf16" in capabilities.cpu_flags():  # AMX: bfloat16 is as fast
        assert "a bfloat16 layer runs about as fast as these int8 layers or faster" in step.device_note


def test_w8a8_note_on_a_cpu_with_amx_bf16_tiles(monkeypatch):
    """Measured on an Intel Xeon with AMX: a bfloat16 layer is as fast as w8a8 or faster; the note says so
    (and, for a model already in bfloat16, that w8a8 saves bytes, not time).  Faked flags: runs anywhere."""
    monkeypatch.setattr(device_notes, "w8a8_kernel", lambda device: "int_mm")
    monkeypatch.setattr(device_notes, "cpu_flags", lambda: frozenset({"amx_int8", "amx_bf16"}))
    assert "for speed alone model.to(torch.bfloat16) is enough here" in device_notes.w8a8_note("cpu", {"float32"})
    assert "w8a8 halves their weight bytes, not their time" in device_notes.w8a8_note("cpu", {"bfloat16"})
    monkeypatch.setattr(device_notes, "cpu_flags", lambda: frozenset({"avx512_vnni"}))
    assert device_notes.w8a8_note("cpu", {"float32"}) is None  # VNNI without AMX bf16: w8a8 is the fast choice
    assert device_notes.w8a8_note("cuda", {"float32"}) is None


def test_packed_weight_only_notes(aten_kernels):
    fp32 = transformdsl.plan(models.tiny_llama(), "quantize int8 weight_only=true").steps[0]
    bf16 = transformdsl.plan(models.tiny_llama().to(torch.bfloat16), "quantize int8 weight_only=true").steps[0]
    assert bf16.device_note is None
    if "int8" in capabilities.packed_cpu_kernels():
        assert "bfloat16" in fp32.device_note and "_weight_int8pack_mm" in fp32.device_note
    int4 = transformdsl.plan(models.tiny_llama(), "quantize int4 group_size=32 compute=float32").steps[0]
    assert "compute=bfloat16" in int4.device_note


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("script", ["quantize w8a8", "quantize int4 group_size=32"])
def test_transformers_format_is_refused_naming_the_reason(script, tmp_path):
    model = models.tiny_llama()
    transformdsl.transform(model, script)
    with pytest.raises(TransformError, match="torchao"):
        transformdsl.save(model, tmp_path / "out", format="transformers")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_w8a8_and_int4_run_within_bound():  # pragma: no cover  (no GPU on the CPU machines)
    for script in SCRIPTS:
        model = models.tiny_llama().to("cuda")
        reference = models.run(model)
        transformdsl.transform(model, script)
        bound = declaration(" ".join(script.split()[:2])).error_bound["max"]
        assert max_error(models.run(model), reference) < bound
