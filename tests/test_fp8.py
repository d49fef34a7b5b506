"""``fp8 storage`` and ``fp8 native`` on the tiny UNet, SD3 and Flux models (and LLMs for Embedding/Conv1D).

Outputs are compared with the same model in bfloat16 (the model users start from), by relative
L2 error ``|y - y_ref| / |y_ref|``; the bounds are the ones spec.md documents.  ``cpu_mm`` runs
the native layers through ``torch._scaled_mm``'s CPU reference (the code path a GPU takes);
without it they upcast, as on any device without fp8 matmul.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import transformdsl
from transformdsl import models
from transformdsl.edit import Edit
from transformdsl.errors import ScriptError, TransformError
from transformdsl.extend import ApplyContext
from transformdsl.planner import plan
from transformdsl.transforms import fp8
from transformdsl.transforms.fp8 import apply as fp8_apply
from transformdsl.transforms.fp8 import cuda as fp8_cuda
from transformdsl.transforms.fp8 import layers as fp8_modules
from transformdsl.transforms.fp8 import numerics
from transformdsl.transforms.fp8.cuda import cuda_scaled_mm_problems
from transformdsl.transforms.fp8.layers import FP8Conv, FP8Embedding, FP8Linear, FP8Module

#: Relative L2 error bounds against the bfloat16 model (spec.md "fp8"; measured worst ~0.10 / 0.20 / 0.04).
BOUND = {"storage": 0.15, "storage-e5m2": 0.30, "native": 0.06, "both": 0.15}
SCRIPTS = {
    "storage": "fp8 storage",
    "storage-e5m2": "fp8 storage dtype=e5m2",
    "native": "fp8 native",
    "both": "fp8 storage; fp8 native in *TransformerBlock",
}
E4M3 = torch.float8_e4m3fn


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bf16(name: str, seed: int = 0) -> nn.Module:
    return models.BUILTIN[name](seed).to(torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_models():
    """name → (bf16 model, its output); copied by each test that transforms it."""
    out = {}
    for name in ("unet", "sd3", "flux"):
        model = bf16(name)
        out[name] = (model, models.run(model))
    return out


def transformed(model: nn.Module, script: str) -> nn.Module:
    model = copy.deepcopy(model)
    transformdsl.transform(model, script)
    return model


def fp8_layers(model: nn.Module) -> dict[str, FP8Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Module)}


def snapshot(model: nn.Module) -> dict[str, tuple]:
    """Every tensor (identity, dtype, bytes) and every module (identity): 'bit-identical' means equal."""
    tensors = {k: (id(v), v.dtype, v.detach().contiguous().view(torch.uint8).clone())
               for k, v in model.state_dict(keep_vars=True).items()}
    return {"tensors": tensors, "modules": {n: id(m) for n, m in model.named_modules()}}


def same(a: dict, b: dict) -> bool:
    if a["modules"] != b["modules"] or a["tensors"].keys() != b["tensors"].keys():
        return False
    return all(x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2])
               for x, y in zip(a["tensors"].values(), b["tensors"].values()))


# --------------------------------------------------------------------------- quantization


def test_docstring_examples():
    import doctest

    assert doctest.testmod(fp8_cuda).failed == 0


def test_quantize_round_trips_to_within_one_e4m3_step():
    w = torch.randn(64, 128) * 0.02
    values, scale = numerics.quantize(w, E4M3, dims=(1,))
    assert values.dtype == E4M3 and scale.shape == (64, 1) and scale.dtype == torch.float32
    back = values.float() * scale
    # 3 mantissa bits: relative rounding error at most 2^-4 for normal values (the scale keeps them normal).
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale * 2**-9).all()
    assert torch.equal(values.float().abs().amax(dim=1), torch.full((64,), 448.0))


def test_quantize_e5m2_saturates_instead_of_overflowing_and_zero_rows_stay_zero():
    w = torch.tensor([[1e6, -3.0, 0.5], [0.0, 0.0, 0.0]])
    values, scale = numerics.quantize(w, torch.float8_e5m2, dims=(1,))
    back = values.float() * scale
    assert torch.isfinite(back).all() and torch.equal(back[1], torch.zeros(3))
    assert back[0, 0].item() == pytest.approx(1e6, rel=0.25)


def test_quantize_leaves_the_input_untouched():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    before = w.clone()
    numerics.quantize(w, E4M3, dims=None)
    assert torch.equal(w, before)


# --------------------------------------------------------------------------- the CUDA rules


def _operands(m=32, k=64, n=48, scaling="tensor"):
    a = torch.randn(m, k).to(E4M3)
    w = torch.randn(n, k).to(E4M3)
    if scaling == "row":
        return a, w.t(), torch.ones(m, 1), torch.ones(n, 1).t()
    return a, w.t(), torch.ones(1, 1), torch.ones(1, 1)


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_cuda_rules_accept_what_fp8_linear_builds(scaling):
    assert cuda_scaled_mm_problems(*_operands(scaling=scaling)) == []
    a, b, sa, sb = _operands(scaling=scaling)
    assert cuda_scaled_mm_problems(a, b, sa, sb, torch.zeros(48, dtype=torch.bfloat16), torch.bfloat16) == []


def _case(name):
    a, b, sa, sb = _operands()
    bias, out = None, torch.bfloat16
    if name == "K not a multiple of 16":
        a, b = a[:, :40].contiguous(), b[:40]
        b = b.t().contiguous().t()
    elif name == "N not a multiple of 16":
        b = b[:, :40].t().contiguous().t()
    elif name == "B row-major":
        b = b.contiguous()
    elif name == "A column-major":
        a = a.t().contiguous().t()
    elif name == "3-D A":
        a = a.reshape(2, 16, 64)
    elif name == "e5m2 x e5m2":
        a, b = a.float().to(torch.float8_e5m2), b.float().to(torch.float8_e5m2)
    elif name == "float64 scale":
        sa = sa.double()
    elif name == "row scale wrong shape":
        sa, sb = torch.ones(32), torch.ones(48)
    elif name == "row-wise with float16 output":
        _, _, sa, sb = _operands(scaling="row")
        out = torch.float16
    elif name == "bias with float32 output":
        bias, out = torch.zeros(48, dtype=torch.bfloat16), torch.float32
    elif name == "float32 bias":
        bias = torch.zeros(48)
    return a, b, sa, sb, bias, out


@pytest.mark.parametrize("name, expected", [
    ("K not a multiple of 16", "inner dimension K=40"),
    ("N not a multiple of 16", "outer dimension N=40"),
    ("B row-major", "B must be column-major"),
    ("A column-major", "A must be row-major"),
    ("3-D A", "2-D"),
    ("e5m2 x e5m2", "two float8_e5m2"),
    ("float64 scale", "scales must be float32"),
    ("row scale wrong shape", "tensor-wise"),
    ("row-wise with float16 output", "bfloat16 output"),
    ("bias with float32 output", "float32 output"),
    ("float32 bias", "the bias must be torch.bfloat16"),
])
def test_cuda_rules_reject_what_cuda_rejects(name, expected):
    problems = cuda_scaled_mm_problems(*_case(name))
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("name", ["K not a multiple of 16", "N not a multiple of 16", "B row-major",
                                  "e5m2 x e5m2", "float32 bias"])
def test_the_cpu_kernel_accepts_them_which_is_why_the_rules_are_ours(name):
    a, b, sa, sb, bias, out = _case(name)
    torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=bias, out_dtype=out)  # no error on CPU


@pytest.mark.parametrize("shape, expected", [
    ((64, 64), []),
    ((40, 64), ["inner dimension K=40 is not a multiple of 16"]),
    ((64, 24), ["outer dimension N=24 is not a multiple of 16"]),
    ((8, 8), ["inner dimension K=8 is not a multiple of 16", "outer dimension N=8 is not a multiple of 16"]),
])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_layer_shapes_are_checked_with_the_same_rules(shape, expected, scaling):
    assert fp8_cuda.native_layer_problems(*shape, scaling, torch.bfloat16, bias=True) == expected


def test_the_cpu_reference_path_refuses_operands_a_gpu_would_reject():
    layer = FP8Linear.from_linear(nn.Linear(40, 64), E4M3, torch.bfloat16, native=True, scaling="tensor")
    x = torch.randn(4, 40)
    with fp8.CPU_SCALED_MM.turned(True):
        with pytest.raises(RuntimeError, match="inner dimension K=40"):
            layer(x)
    assert layer(x).shape == (4, 64)  # upcast path: fine on CPU


# --------------------------------------------------------------------------- modules


def test_fp8_linear_keeps_the_input_dtype_and_handles_empty_batches():
    layer = FP8Linear.from_linear(nn.Linear(32, 16), E4M3, torch.bfloat16, native=True, scaling="row")
    with fp8.CPU_SCALED_MM.turned(True):
        assert layer(torch.randn(2, 3, 32)).dtype == torch.float32
        assert layer(torch.randn(2, 3, 32)).shape == (2, 3, 16)
        assert layer(torch.randn(0, 32)).shape == (0, 16)
    assert layer(torch.randn(5, 32, dtype=torch.float16)).dtype == torch.float16


def test_native_layers_match_the_upcast_within_activation_quantization_error():
    torch.manual_seed(0)
    linear = nn.Linear(256, 128).to(torch.bfloat16)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    ref = linear(x)
    for scaling in ("tensor", "row"):
        layer = FP8Linear.from_linear(linear, E4M3, torch.bfloat16, native=True, scaling=scaling)
        upcast = layer(x)
        with fp8.CPU_SCALED_MM.turned(True):
            native = layer(x)
        assert rel_error(upcast, ref) < 0.04
        assert rel_error(native, ref) < 0.06
        assert not torch.equal(native, upcast)  # the two paths really differ (activations are quantized)


def test_strict_native_layers_refuse_to_upcast_at_runtime():
    layer = FP8Linear.from_linear(nn.Linear(32, 32), E4M3, torch.bfloat16, native=True, strict=True)
    with pytest.raises(RuntimeError, match="strict=true.*cpu has no fp8 matmul"):
        layer(torch.randn(2, 32))
    with fp8.CPU_SCALED_MM.turned(True):
        layer(torch.randn(2, 32))


def test_conv_padding_modes_and_embedding_rows():
    torch.manual_seed(0)
    for conv in (nn.Conv2d(8, 16, 3, padding=1, padding_mode="reflect"), nn.Conv1d(4, 8, 3, stride=2, groups=2)):
        x = torch.randn(2, conv.in_channels, *([9] * (conv.weight.dim() - 2)))
        new = FP8Conv.from_conv(conv, E4M3, torch.float32)
        assert new(x).shape == conv(x).shape and rel_error(new(x), conv(x)) < 0.04
    emb = nn.Embedding(100, 32)
    new = FP8Embedding.from_embedding(emb, E4M3, torch.float32)
    ids = torch.tensor([[1, 5], [99, 0]])
    assert rel_error(new(ids), emb(ids)) < 0.04


def test_storage_memory_is_half_of_bfloat16_on_realistic_layers():
    linear = nn.Linear(3072, 3072, device="meta", dtype=torch.bfloat16)
    layer = FP8Linear.empty(linear, E4M3, torch.bfloat16)
    size = sum(t.numel() * t.element_size() for t in [*layer.buffers(), *layer.parameters()])
    bf16_size = sum(t.numel() * t.element_size() for t in linear.parameters())
    assert size / bf16_size == pytest.approx(0.5, abs=0.002)


# --------------------------------------------------------------------------- planning


def test_default_exclusions_follow_diffusers():
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    ours = {s.removeprefix("re:") for s in fp8.DEFAULT_EXCEPT}
    assert ours == set(DEFAULT_SKIP_MODULES_PATTERN)
    p = plan(bf16("sd3"), "fp8 storage")
    targets = p.steps[0].targets
    assert not any("norm" in t or t.startswith(("pos_embed", "proj_out")) for t in targets)
    assert p.steps[0].excluded == {"default: norm": 5, "default: pos_embed": 1, "default: re:^proj_out$": 1}
    assert "transformer_blocks.0.norm1.linear" not in targets  # excluded with its parent


def test_default_exclusions_can_be_turned_off():
    targets = plan(bf16("sd3"), "fp8 storage default_except=false").steps[0].targets
    assert {"proj_out", "pos_embed.proj", "transformer_blocks.0.norm1.linear"} <= set(targets)


def test_native_runs_before_storage_and_takes_the_layers_it_names(bf16_models):
    model, _ = bf16_models["flux"]
    p = plan(model, "fp8 storage; fp8 native in transformer_blocks.*")
    native, storage = p.steps
    assert native.transform.key() == "fp8 native" and storage.transform.key() == "fp8 storage"
    assert native.targets and not set(native.targets) & set(storage.targets)
    assert {path for path, line in storage.overridden} == set(native.targets)
    assert any("left to line(s) 1" in n for n in storage.notes)
    out = transformed(model, "fp8 storage; fp8 native in transformer_blocks.*")
    layers = fp8_layers(out)
    assert {n for n, m in layers.items() if getattr(m, "native", False)} == set(native.targets)
    assert {n for n, m in layers.items() if not getattr(m, "native", False)} == set(storage.targets)


@pytest.mark.parametrize("script", ["quantize int8; fp8 storage", "fp8 native; quantize nf4",
                                    "fp8 storage; fp8 storage dtype=e5m2"])
def test_a_layer_cannot_be_both_fp8_and_quantized(script):
    with pytest.raises(ScriptError, match="a module takes one of them"):
        plan(bf16("sd3"), script)


def test_fp8_and_quantization_on_different_layers_plan_fine():
    p = plan(bf16("sd3"), "quantize int8 in transformer_blocks.0; fp8 storage except transformer_blocks.0")
    quantized, stored = p.steps
    assert quantized.targets and stored.targets and not set(quantized.targets) & set(stored.targets)


def _odd_model() -> nn.Module:
    """Layers whose shapes break the CUDA fp8 rules, and one that fits."""
    return nn.ModuleDict({"fits": nn.Linear(64, 32), "odd_in": nn.Linear(40, 32), "odd_out": nn.Linear(32, 24)})


def test_layers_that_cannot_run_natively_fall_back_to_upcast_and_are_listed():
    p = plan(_odd_model(), "fp8 native")
    notes = "\n".join(p.steps[0].notes)
    assert sorted(p.steps[0].targets) == ["fits", "odd_in", "odd_out"]
    assert "1 layer(s) native: torch._scaled_mm" in notes
    assert "2 layer(s) cannot run torch._scaled_mm on a GPU" in notes
    assert "odd_in: inner dimension K=40 is not a multiple of 16" in notes
    assert "odd_out: outer dimension N=24 is not a multiple of 16" in notes
    assert p.steps[0].device_note.startswith("fallback: cpu has no fp8 matmul")
    model = _odd_model()
    transformdsl.transform(model, "fp8 native")
    assert [model[k].native for k in ("fits", "odd_in", "odd_out")] == [True, False, False]
    assert model["odd_in"].weight_scale.shape == (32, 1)  # stored like fp8 storage: one scale per row
    with fp8.CPU_SCALED_MM.turned(True):
        assert model["odd_in"](torch.randn(3, 40)).shape == (3, 32)


def test_strict_makes_each_fallback_an_error_naming_the_layer():
    with pytest.raises(ScriptError) as info:
        plan(_odd_model(), "fp8 native strict=true")
    text = str(info.value)
    assert "odd_in: inner dimension K=40" in text and "odd_out: outer dimension N=24" in text
    assert "fits: cpu has no fp8 matmul" in text
    with fp8.CPU_SCALED_MM.turned(True):  # the CPU reference is a real _scaled_mm: only the shapes fail now
        with pytest.raises(ScriptError) as info:
            plan(_odd_model(), "fp8 native strict=true")
        assert "fits" not in str(info.value)
        plan(nn.ModuleDict({"fits": nn.Linear(64, 32)}), "fp8 native strict=true")


def test_row_scaling_needs_a_bfloat16_output():
    with pytest.raises(ScriptError, match="scaling=row needs compute=bfloat16"):
        plan(_odd_model(), "fp8 native scaling=row compute=float16")
    plan(_odd_model(), "fp8 native scaling=tensor compute=float16")


def test_near_misses_tied_weights_non_linear_and_already_fp8():
    gpt2 = models.tiny_gpt2()
    step = plan(gpt2, "fp8 storage").steps[0]
    reasons = dict(step.skipped)
    assert "tied to lm_head" in reasons["transformer.wte"]
    assert "transformer.h.0.attn.c_attn" in step.targets  # transformers' Conv1D
    step = plan(models.tiny_unet(), "fp8 native Conv2d").steps[0]
    assert not step.targets and "fp8 native changes Linear layers, not Conv2d" in step.skipped[0][1]
    model = _odd_model()
    transformdsl.transform(model, "fp8 storage in fits")
    assert dict(plan(model, "fp8 native fits").steps[0].skipped) == {"fits": "already has a float8 weight"}


def test_diffusers_model_dtype_is_unchanged(bf16_models):
    """fp8 weights are buffers, so ModelMixin.dtype (first floating parameter) stays bfloat16."""
    model = transformed(bf16_models["unet"][0], "fp8 storage")
    assert model.dtype == torch.bfloat16
    assert isinstance(model.conv_in, FP8Conv)


def test_model_to_dtype_keeps_fp8_weights_and_float32_scales(bf16_models):
    model = transformed(bf16_models["sd3"][0], "fp8 storage; fp8 native in transformer_blocks.*")
    before = {k: v.view(torch.uint8).clone() for k, v in model.state_dict().items() if k.endswith("weight_scale")}
    model.to(torch.float16)  # what pipe.to("cuda", torch.float16) does to its components
    layers = fp8_layers(model)
    assert {m.fp8_weight.dtype for m in layers.values()} == {E4M3}
    assert {m.weight_scale.dtype for m in layers.values()} == {torch.float32}
    assert all(torch.equal(model.state_dict()[k].view(torch.uint8), v) for k, v in before.items())
    assert models.run(model).dtype == torch.float16


# --------------------------------------------------------------------------- the three models


@pytest.mark.parametrize("mode", list(SCRIPTS))
@pytest.mark.parametrize("name", ["unet", "sd3", "flux"])
def test_outputs_stay_within_bounds_of_the_bf16_model(bf16_models, name, mode):
    model, ref = bf16_models[name]
    out_model = transformed(model, SCRIPTS[mode])
    layers = fp8_layers(out_model)
    assert layers
    expected = numerics.FP8_DTYPES["e5m2"] if mode == "storage-e5m2" else E4M3
    assert {m.fp8_weight.dtype for m in layers.values()} == {expected}
    for cpu_mm in ((False, True) if mode in ("native", "both") else (False,)):
        with fp8.CPU_SCALED_MM.turned(cpu_mm):
            error = rel_error(models.run(out_model), ref)
        assert error < BOUND[mode], f"{name} {mode} cpu_mm={cpu_mm}: {error:.4f}"


@pytest.mark.parametrize("name, script", [("unet", "fp8 storage dtype=e5m2"), ("flux", SCRIPTS["both"]),
                                          ("sd3", "fp8 native scaling=row")])
def test_verify_holds_the_declared_error_bounds(bf16_models, name, script):
    model = copy.deepcopy(bf16_models[name][0])
    logged = []
    transformdsl.transform(model, script, verify=True, log=logged.append)
    assert any("within the bound" in line for line in logged), logged


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_language_models_embeddings_and_conv1d(name):
    model = bf16(name)
    ref = models.run(model)
    model = transformed(model, "fp8 storage")
    kinds = {type(m).__name__ for m in fp8_layers(model).values()}
    assert kinds == ({"FP8Linear", "FP8Embedding"} if name == "llama" else {"FP8Conv1D", "FP8Embedding"})
    assert rel_error(models.run(model), ref) < 0.10


# --------------------------------------------------------------------------- persistence


@pytest.mark.parametrize("name, script", [("unet", "fp8 storage"), ("sd3", SCRIPTS["both"]),
                                          ("flux", "fp8 native scaling=row; fp8 storage dtype=e5m2")])
def test_save_and_reload_bit_exactly(bf16_models, tmp_path, name, script):
    from safetensors import safe_open

    model = transformed(bf16_models[name][0], script)
    transformdsl.save(model, tmp_path / name)
    # The loader builds its skeleton from the config in float32; a factory gives the bf16 one (called
    # under the meta device: no weights are made).
    loaded = transformdsl.load(tmp_path / name, model=lambda: type(model).from_config(model.config).to(torch.bfloat16))
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype, key
        assert torch.equal(want[key].view(torch.uint8), got[key].view(torch.uint8)), key
    for path, layer in fp8_layers(model).items():
        other = loaded.get_submodule(path)
        assert type(other) is type(layer) and other.extra_repr() == layer.extra_repr()
    with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as f:
        stored = {f.get_slice(k).get_dtype() for k in f.keys() if k.endswith(".weight")}
    assert {"F8_E4M3"} <= stored
    with fp8.CPU_SCALED_MM.turned(True):
        assert torch.equal(models.run(loaded), models.run(model))


def test_rebuild_on_a_meta_skeleton_creates_no_data():
    model = models.tiny_sd3()
    step = plan(model, SCRIPTS["both"]).steps
    records = []
    for s in step:
        edit = Edit()
        records.append(s.transform.apply(ApplyContext(model, edit, progress=lambda it, **k: it), s.targets))
        edit.commit()
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        skeleton = SD3Transformer2DModel(**models.SD3_CONFIG)
    for s, record in zip(step, records):
        type(s.transform).rebuild(skeleton, record, s.transform.options)
    assert all(t.is_meta for t in skeleton.state_dict().values())
    skeleton.load_state_dict(model.state_dict(), strict=True, assign=True)
    assert torch.equal(models.run(skeleton), models.run(model))


# --------------------------------------------------------------------------- atomicity


class Boom(Exception):
    pass


def _failing_progress(after: int):
    def progress(iterable, **kwargs):
        for i, item in enumerate(iterable):
            if i == after:
                raise Boom(f"injected after {after} layers")
            yield item
    return progress


@pytest.mark.parametrize("script", ["fp8 storage", "fp8 native"])
def test_a_failure_midway_rolls_back_to_a_bit_identical_model(bf16_models, script):
    model = copy.deepcopy(bf16_models["unet"][0])
    before = snapshot(model)
    step = plan(model, script).steps[0]
    edit = Edit()
    with pytest.raises(Boom):
        step.transform.apply(ApplyContext(model, edit, _failing_progress(after=7)), step.targets)
    assert not same(before, snapshot(model))  # 7 layers were replaced...
    edit.rollback()
    assert same(before, snapshot(model))  # ...and are back, tensors untouched
    assert torch.equal(models.run(model), bf16_models["unet"][1])


def test_transform_rolls_back_every_statement_when_a_later_one_fails(bf16_models, monkeypatch):
    model = copy.deepcopy(bf16_models["flux"][0])
    before = snapshot(model)
    calls = []
    convert = fp8_apply._convert

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("injected in fp8 storage")
        return convert(*args)

    monkeypatch.setattr(fp8_apply, "_convert", failing)
    with pytest.raises(TransformError, match="'fp8 storage' failed.*left unchanged"):
        transformdsl.transform(model, "fp8 storage; fp8 native in transformer_blocks.*")
    assert same(before, snapshot(model))


# --------------------------------------------------------------------------- compile


@pytest.mark.slow
def test_eager_and_compiled_agree_fullgraph_true_and_false(bf16_models):
    """One model, one script covering both module types and both native paths; inductor on CPU."""
    model = transformed(bf16_models["flux"][0], "fp8 storage; fp8 native in transformer_blocks.*")
    with fp8.CPU_SCALED_MM.turned(True):
        eager = models.run(model)
        outputs = {}
        for fullgraph in (True, False):
            torch._dynamo.reset()
            outputs[fullgraph] = models.run(torch.compile(model, fullgraph=fullgraph, dynamic=False))
    torch._dynamo.reset()
    # Inductor keeps the upcast weight in float32 before rounding once; eager rounds in bfloat16.
    for out in outputs.values():
        assert rel_error(out, eager) < 0.02
    assert rel_error(outputs[True], outputs[False]) < 1e-3


def test_no_graph_break_on_either_path():
    """fullgraph capture alone (backend=eager: no codegen) for the upcast and the _scaled_mm paths."""
    layer = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(torch.bfloat16)
    transformdsl.transform(layer, "fp8 native in 0; fp8 storage in 2")
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    for cpu_mm in (False, True):
        with fp8.CPU_SCALED_MM.turned(cpu_mm):
            torch._dynamo.reset()
            compiled = torch.compile(layer, fullgraph=True, backend="eager")
            assert torch.equal(compiled(x), layer(x))
    torch._dynamo.reset()


# --------------------------------------------------------------------------- GPU


cuda_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                              reason="needs a CUDA GPU with fp8 matmul (compute capability 8.9+)")


@pytest.mark.gpu
@cuda_fp8
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_gpu_native_runs_scaled_mm_and_compiles(scaling):
    torch.manual_seed(0)
    linear = nn.Linear(3072, 3072).to("cuda", torch.bfloat16)
    layer = FP8Linear.from_linear(linear, E4M3, torch.bfloat16, native=True, scaling=scaling, strict=True)
    x = torch.randn(2, 2048, 3072, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    assert rel_error(out, linear(x)) < 0.06
    assert rel_error(torch.compile(layer, fullgraph=True)(x), out) < 0.02


@pytest.mark.gpu
@cuda_fp8
def test_gpu_plan_has_no_fallback_and_strict_passes(bf16_models):
    model = copy.deepcopy(bf16_models["flux"][0]).to("cuda")
    p = plan(model, "fp8 native strict=true")
    assert not any("fallback" in n for n in p.steps[0].notes) and p.steps[0].device_note is None
    ref = models.run(model)
    transformdsl.transform(model, p)
    assert rel_error(models.run(model), ref) < BOUND["native"]


# --------------------------------------------------------------------------- decoding on the CPU


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaled", ["row", "tensor", "none"])
def test_e4m3_decoded_through_its_bits_is_torchs_conversion_bit_for_bit(dtype, scaled):
    """Every e4m3 code (subnormals, both zeros, the largest) decodes to what ``values.to(dtype) *
    scale`` gives; NaN codes and a scale that would overflow take torch's own conversion."""
    wide = torch.int16 if dtype == torch.bfloat16 else torch.int32
    codes = torch.arange(256, dtype=torch.uint8).repeat(80).reshape(256, 80)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN code: the decoding applies
    values = codes.view(E4M3)
    scale = {"row": torch.rand(256, 1) * 4, "tensor": torch.tensor([[0.37]]), "none": None}[scaled]
    expected = values.to(dtype) if scale is None else values.to(dtype) * scale.to(dtype)
    assert numerics._decode_e4m3(values, scale, dtype) is not None
    assert torch.equal(numerics.dequantize(values, scale, dtype).view(wide), expected.view(wide))
    with_nan = codes.clone()
    with_nan[7, 3] = 0xFF
    assert numerics._decode_e4m3(with_nan.view(E4M3), scale, dtype) is None
    got = numerics.dequantize(with_nan.view(E4M3), scale, dtype)
    assert got[7, 3].isnan() and got.isnan().sum() == 1
    if scale is not None:
        assert numerics._decode_e4m3(values, scale * 1e4, dtype) is None  # times 2^120 it would overflow


@pytest.mark.parametrize("lead", [(5,), (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale", ["row", "tensor", "none"])
def test_a_large_fp8_linear_upcasts_block_by_block_to_the_same_output(monkeypatch, lead, bias, scale):
    from transformdsl.transforms.common import blocked as _blocked

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 200, bias=bias).to(torch.bfloat16)
    layer = fp8_modules.FP8Linear.from_linear(linear, E4M3, torch.bfloat16, scale=scale)
    x = torch.randn(*lead, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        whole = layer(x)
        monkeypatch.setattr(fp8_modules, "BLOCKED_FROM", 0)
        monkeypatch.setattr(_blocked, "BLOCK_BYTES", 64 * 128 * 2)  # blocks of 64 rows: 64, 64, 64, 8
        blocks = layer(x)
    assert blocks.shape == whole.shape == (*lead, 200) and blocks.is_contiguous() and blocks.dtype == x.dtype
    torch.testing.assert_close(blocks, whole, rtol=2e-2, atol=1e-2)


def test_layers_upcast_by_blocks_still_differentiate(monkeypatch):
    """Where autograd records the call (grad mode, a bias or input that requires grad) the layer
    takes the whole upcast: the ``out=`` products of the blocks are not differentiable."""
    from transformdsl.transforms.common import blocked as _blocked
    from transformdsl.transforms.quantize.int8_weight_only import Int8WeightOnlyLinear

    monkeypatch.setattr(fp8_modules, "BLOCKED_FROM", 0)
    monkeypatch.setattr(_blocked, "BLOCKED_BYTES", 0)
    linear = torch.nn.Linear(64, 96).to(torch.bfloat16)
    for layer in (fp8_modules.FP8Linear.from_linear(linear, E4M3, torch.bfloat16),
                  Int8WeightOnlyLinear.build(linear.weight.detach(), linear.bias.detach())):
        x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
        layer(x).sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        with torch.no_grad():
            assert layer(x).shape == (3, 96)


def test_decoding_steps_aside_when_subnormals_are_flushed():
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).repeat(200).reshape(127, 200).view(E4M3)
    try:
        torch.set_flush_denormal(True)
        assert numerics._decode_e4m3(codes, None, torch.bfloat16) is None
    finally:
        torch.set_flush_denormal(False)
    assert numerics._decode_e4m3(codes, None, torch.bfloat16) is not None


@pytest.mark.parametrize("script", ["fp8 storage", "fp8 storage scale=none"])
def test_upcasting_layers_still_trace_with_torch_fx(script):
    """torch.fx.symbolic_trace (quantization toolkits use it) sees the plain upcast of fp8 layers,
    as before the CPU fast paths: they look at real tensors only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    model = model.to(torch.bfloat16)
    transformdsl.transform(model, script)
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(traced(x), model(x))
