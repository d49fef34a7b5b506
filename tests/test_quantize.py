"""``quantize int8|nf4|fp4|hqq`` on the built-in tiny models, with the real kernels (CPU).

Error bounds are the ones documented in spec.md ("quantize"): relative L2 error of the
model's output against the unquantized model, measured over seeds 0-2 with ~1.5-2x margin.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import models  # noqa: E402
from transformdsl.edit import Edit  # noqa: E402
from transformdsl.errors import LoadError, ScriptError, TransformError  # noqa: E402
from transformdsl.extend import ApplyContext  # noqa: E402
from transformdsl.history import history_of  # noqa: E402
from transformdsl.persist import meta_copy  # noqa: E402
from transformdsl.planner import plan  # noqa: E402
from transformdsl.transforms.quantize import Int8Options  # noqa: E402
from transformdsl.transforms.quantize import quantization as q  # noqa: E402
from transformdsl.validate import check_text  # noqa: E402

FACTORIES = {"llama": models.tiny_llama, "flux": models.tiny_flux, "unet": models.tiny_unet,
             "gpt2": models.tiny_gpt2}

#: (model, script, bound on the relative output error): the table in spec.md.  hqq's group size
#: must divide every quantized layer's in_features: 64 for Llama, 16 for Flux (inner dim 16,
#: single blocks' proj_out 80), 32 for the UNet (cross-attention dim 32).
CASES = [
    ("llama", "quantize int8", 0.02),
    ("llama", "quantize nf4", 0.25),
    ("llama", "quantize fp4", 0.3),
    ("llama", "quantize hqq", 0.2),
    ("flux", "quantize int8", 0.004),
    ("flux", "quantize nf4 double_quant=true", 0.05),
    ("flux", "quantize fp4 compute=bf16", 0.06),
    ("flux", "quantize hqq group_size=16", 0.025),
    ("unet", "quantize int8 threshold=6", 0.01),
    ("unet", "quantize nf4 blocksize=128", 0.1),
    ("unet", "quantize fp4", 0.12),
    ("unet", "quantize hqq group_size=32 bits=8", 0.005),
    ("gpt2", "quantize int8", 0.02),
]


# --------------------------------------------------------------------------- helpers


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def apply_script(model: nn.Module, script: str, progress=None) -> tuple[list, list[dict]]:
    """Plan and apply each statement through one edit, at the pass-contract level (for the
    tests that watch the context: progress bar, records)."""
    the_plan = plan(model, script)
    edit = Edit()
    records = []
    for step in the_plan.steps:
        ctx = ApplyContext(model, edit, progress or (lambda it, **kw: it))
        records.append(step.transform.apply(ctx, list(step.targets)))
    edit.commit()
    return the_plan.steps, records


def save_and_load(model: nn.Module, tmp_path) -> nn.Module:
    transformdsl.save(model, tmp_path / "saved")
    return transformdsl.load(tmp_path / "saved")


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert list(state) == list(saved)
    for key, value in saved.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def problem_messages(error: ScriptError) -> str:
    return "\n".join(p.message + (f" | hint: {p.hint}" if p.hint else "") for p in error.problems)


# --------------------------------------------------------------------------- accuracy and reload


@pytest.mark.parametrize("name,script,bound", CASES, ids=[f"{n}-{s[9:]}" for n, s, _ in CASES])
def test_quantized_outputs_and_bit_exact_reload(name, script, bound, tmp_path):
    model = FACTORIES[name]()
    reference = models.run(model)
    targets = plan(model, script).steps[0].targets
    assert targets, "the statement selected no layer"
    transformdsl.transform(model, script)
    out = models.run(model)
    assert rel_error(out, reference) < bound
    backend = q._backend()
    assert all(isinstance(model.get_submodule(p), backend.QUANTIZED_CLASSES) for p in targets)

    loaded = save_and_load(model, tmp_path)
    assert all(type(loaded.get_submodule(p)) is type(model.get_submodule(p)) for p in targets)
    assert torch.equal(models.run(loaded), out)
    saved, again = model.state_dict(), loaded.state_dict()
    assert list(saved) == list(again)
    assert all(saved[k].dtype == again[k].dtype and torch.equal(saved[k], again[k]) for k in saved)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("in_features", [16, 32, 96, 64])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_four_bit_layer_computes_blocks_that_cross_rows_exactly(quant_type, double_quant, in_features, weight_dtype):
    """A block of 64 weights continues on the next row when a row holds 16, 32 or 96: the layer's
    output is the float matmul with the weight dequantized the plain way (code[index] * absmax, in
    file order) straight into the compute dtype, as bitsandbytes' matmul does, whatever the dtype
    of the weight it replaced, on every CPU (bitsandbytes' native CPU kernel misreads such rows on
    some)."""
    from transformdsl.transforms.quantize.layers import FourBitLinear

    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, in_features) * 0.05, torch.randn(48), torch.randn(5, in_features)
    layer = FourBitLinear.build(weight.to(weight_dtype), bias, quant_type, 64, double_quant, torch.float32).eval()
    state = layer.weight.quant_state
    packed = layer.weight.data.view(torch.uint8).reshape(-1)
    index = torch.stack([packed >> 4, packed & 0xF], 1).reshape(-1).long()
    absmax = state.absmax.float()
    if state.nested:
        import bitsandbytes as bnb

        absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    values = state.code[index] * absmax.repeat_interleave(64)[: index.numel()]
    expected = torch.nn.functional.linear(x, values.reshape(48, in_features), bias)
    with torch.no_grad():
        assert torch.equal(layer(x), expected)
    assert rel_error(layer(x), torch.nn.functional.linear(x, weight, bias)) < 0.2


def test_four_bit_probe_ignores_a_meta_device_context():
    """Layers built inside ``with torch.device("meta")`` (skeletons, accelerate's init_empty_weights)
    probe the CPU kernel on the CPU: the answer, kept for the process, is the CPU's."""
    from transformdsl.transforms.quantize import layers as _quantized

    for probe in (_quantized.cpu_kernel_misreads_crossing_blocks, _quantized.int_mm_misreads_one_input_column):
        expected = probe.__wrapped__()
        probe.cache_clear()
        with torch.device("meta"):
            assert probe() == expected
        assert probe() == expected


@pytest.mark.parametrize("out_features", [16, 5, 1])
def test_int8_layer_with_one_input_feature_is_right_on_every_cpu(out_features):
    """ConsisID's perceiver has Linear(1, 16) layers: where torch._int_mm misreads the transposed
    one-column weight (relative error ~10^4 on an AMD EPYC with VNNI), the layer multiplies in float,
    which is what LLM.int8 computes for one input feature (each activation is its own +-127 * scale)."""
    from transformdsl.transforms.quantize.layers import Int8Linear

    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, 1), torch.randn(out_features)
    layer = Int8Linear.build(weight, bias, 0.0).eval()
    dequantized = layer.weight.data.float() * (layer.state.SCB.float() / 127)[:, None]
    for x in (torch.randn(7, 1), torch.randn(2, 3, 1), torch.randn(4, 1, dtype=torch.bfloat16)):
        with torch.no_grad():
            out = layer(x)
        assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], out_features)
        expected = torch.nn.functional.linear(x.float(), dequantized, bias)
        assert rel_error(out.float(), expected) < 1e-2


def test_gpt2_conv1d_is_quantized_transposed():
    model = models.tiny_gpt2()
    steps, records = apply_script(model, "quantize int8")
    layer = model.get_submodule("transformer.h.0.attn.c_attn")  # Conv1D (64 in, 192 out)
    assert (layer.in_features, layer.out_features) == (64, 192)
    entry = next(e for e in records[0]["layers"] if e["path"] == "transformer.h.0.attn.c_attn")
    assert entry["source"] == "Conv1D" and (entry["in"], entry["out"]) == (64, 192)


def test_reload_reads_the_quantized_bytes_instead_of_quantizing_again(tmp_path, monkeypatch):
    """load() rebuilds nf4 layers from the saved packed weights and quant state: bitsandbytes'
    quantizer never runs again on real data, only on the meta skeleton that shapes the layer (how
    much faster that is lives in benchmarks/, not in a timed test)."""
    import bitsandbytes as bnb

    def make():
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)])

    torch.manual_seed(0)
    model = make()
    transformdsl.transform(model, "quantize nf4")
    transformdsl.save(model, tmp_path / "saved")
    calls = []
    real = bnb.functional.quantize_4bit

    def counting(weight, *args, **kwargs):
        calls.append(weight.device.type)
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(bnb.functional, "quantize_4bit", counting)
    loaded = transformdsl.load(tmp_path / "saved", model=make)
    assert calls and set(calls) == {"meta"}, calls
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


# --------------------------------------------------------------------------- contract


@pytest.mark.parametrize("script", ["quantize int8", "quantize nf4 double_quant=true", "quantize hqq"])
def test_failure_on_second_layer_rolls_back_bit_exactly(script, monkeypatch):
    model = models.tiny_llama()
    before = snapshot(model)
    modules = dict(model.named_modules())
    reference = models.run(model)
    cls = type(plan(model, script).steps[0].transform)
    real_build = cls.build.__func__
    calls = []

    def failing_build(klass, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real_build(klass, *args, **kwargs)

    monkeypatch.setattr(cls, "build", classmethod(failing_build))
    with pytest.raises(TransformError, match="line 1: '.*' failed: RuntimeError: injected failure"):
        transformdsl.transform(model, script)
    assert len(calls) == 2
    assert_same(model, before)
    assert all(model.get_submodule(p) is m for p, m in modules.items() if p)
    assert torch.equal(models.run(model), reference)


@pytest.mark.parametrize("script", ["quantize int8", "quantize fp4", "quantize hqq bits=8"])
def test_source_weights_are_never_written(script):
    """The replaced float layers keep their tensors bit-exact (bitsandbytes/hqq may alias)."""
    model = models.tiny_llama()
    old = {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    saved = {p: (m.weight.detach().clone(), m.weight.data_ptr()) for p, m in old.items()}
    apply_script(model, script)
    for path, (weight, ptr) in saved.items():
        assert old[path].weight.data_ptr() == ptr and torch.equal(old[path].weight, weight), path


def test_progress_bar_wraps_the_layers():
    seen = []

    def progress(iterable, total=None, desc=None):
        seen.append((total, desc))
        return iterable

    model = models.tiny_llama()
    steps, _ = apply_script(model, "quantize nf4", progress=progress)
    assert seen == [(len(steps[0].targets), "quantize nf4")]


def test_bitsandbytes_cast_warning_is_filtered_narrowly(caplog):
    model = models.tiny_llama()
    apply_script(model, "quantize int8")
    caplog.set_level(logging.WARNING)
    models.run(model)  # float32 inputs: bitsandbytes logs a cast warning per call
    assert not [r for r in caplog.records if "MatMul8bitLt" in r.getMessage()]
    logging.getLogger("bitsandbytes.autograd._functions").warning("something else")
    assert [r for r in caplog.records if r.getMessage() == "something else"]


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("script,low,high", [
    ("quantize int8", 0.25, 0.26),             # int8 + one fp32 scale per row
    ("quantize nf4", 0.13, 0.145),             # 4 bits + one fp32 absmax per 64
    ("quantize nf4 double_quant=true", 0.125, 0.135),
    ("quantize fp4 blocksize=256", 0.125, 0.135),
    ("quantize hqq bits=4 group_size=128", 0.125, 0.145),
    ("quantize hqq bits=8", 0.25, 0.29),
])
def test_bytes_of_quantized_layers(script, low, high):
    model = nn.Sequential(nn.Linear(512, 256))
    steps, records = apply_script(model, script)
    record = records[0]
    assert record["bytes_before"] == 512 * 256 * 4 + 256 * 4
    assert low <= record["bytes_after"] / record["bytes_before"] <= high
    # The plan's estimate is the real size (within the JSON quant state's few bytes).
    estimate = steps[0].transform.estimate_bytes(steps[0].transform.options, 512, 256, True, torch.float32)
    assert abs(estimate - record["bytes_after"]) <= 64
    assert "->" in " ".join(steps[0].notes)


# --------------------------------------------------------------------------- planning and validation


def test_default_exclusions_on_llama_and_flux():
    llama = plan(models.tiny_llama(), "quantize int8").steps[0]
    assert "lm_head" not in llama.targets and llama.excluded == {"default: lm_head": 1}
    assert len(llama.targets) == 14  # 7 projections x 2 layers
    flux = plan(models.tiny_flux(), "quantize int8").steps[0]
    assert "proj_out" not in flux.targets  # the output head
    assert "single_transformer_blocks.0.proj_out" in flux.targets  # an ordinary projection
    assert not [p for p in flux.targets if ".norm" in p or "time_text_embed" in p or "embedder" in p]
    assert flux.excluded == {"default: embed": 4, "default: embedder": 2, "default: norm": 5,
                             "default: re:^proj_out$": 1}
    everything = plan(models.tiny_flux(), "quantize int8 default_except=false").steps[0]
    assert "proj_out" in everything.targets and "transformer_blocks.0.norm1.linear" in everything.targets
    fewer = plan(models.tiny_flux(), "quantize int8 except ff").steps[0]
    assert not [p for p in fewer.targets if ".ff." in p] and fewer.excluded["except ff"] > 0


def test_tied_and_already_quantized_layers_are_near_misses():
    gpt2 = plan(models.tiny_gpt2(), "quantize int8 default_except=false").steps[0]
    assert ("lm_head", "its weight is tied to transformer.wte; quantizing it would untie them") in gpt2.skipped
    model = models.tiny_llama()
    apply_script(model, "quantize int8")
    again = plan(model, "quantize nf4").steps[0]
    assert not again.targets
    assert ("model.layers.0.self_attn.q_proj", "already quantized (Int8Linear)") in again.skipped


def test_two_quantizations_of_the_same_layers_name_both_lines():
    with pytest.raises(ScriptError) as info:
        plan(models.tiny_llama(), "quantize int8\nquantize nf4 in model.layers.1")
    (problem,) = info.value.problems
    assert problem.message.startswith("'quantize int8' (line 1) and 'quantize nf4' (line 2) both change 7 module(s)")
    assert [s.line for s in problem.spans] == [1, 2]
    assert problem.hint == "add 'except model.layers.1' to line 1 (checked: the script then plans)"


def test_quantize_and_fp8_on_the_same_layers_name_both_lines():
    with pytest.raises(ScriptError) as info:
        plan(models.tiny_flux(), "fp8 storage in transformer_blocks\nquantize nf4")
    (problem,) = info.value.problems
    assert "'fp8 storage' (line 1) and 'quantize nf4' (line 2) both change" in problem.message
    assert "except" in problem.hint


def test_disjoint_quantizations_are_fine():
    the_plan = plan(models.tiny_flux(),
                    "quantize nf4 in transformer_blocks.*\nquantize int8 in single_transformer_blocks.*")
    first, second = the_plan.steps
    assert first.targets and second.targets and not set(first.targets) & set(second.targets)


def test_hqq_layers_the_group_size_does_not_divide_are_near_misses():
    step = plan(models.tiny_flux(), "# flux\nquantize hqq group_size=32").steps[0]
    skipped = dict(step.skipped)
    assert skipped["transformer_blocks.0.attn.to_q"] == ("group_size=32 does not divide its in_features (16); "
                                                         "group_size=auto picks a size per layer")
    assert not step.targets or all(p not in skipped for p in step.targets)


def test_hqq_group_size_auto_picks_the_largest_usual_size_per_layer_and_reloads_exactly(tmp_path):
    model = models.tiny_flux()
    step = plan(model, "quantize hqq group_size=auto").steps[0]
    assert step.targets and not step.skipped
    ref = models.run(model)
    transformdsl.transform(model, "quantize hqq group_size=auto")
    sizes = {layer["path"]: layer["group_size"] for layer in history_of(model).steps[0].record["layers"]}
    to_q = model.get_submodule("transformer_blocks.0.attn.to_q")
    assert sizes["transformer_blocks.0.attn.to_q"] == 16 == to_q.meta["group_size"]  # in_features 16
    assert max(sizes.values()) > 16  # wider layers get larger groups
    out = models.run(model)
    assert rel_error(out, ref) < 0.4
    transformdsl.save(model, tmp_path / "m")
    assert torch.equal(models.run(transformdsl.load(tmp_path / "m")), out)


def test_hqq_group_size_must_be_a_multiple_of_8():
    with pytest.raises(ScriptError) as info:
        check_text("fuse qkv\nquantize hqq group_size=12")
    assert info.value.line == 2
    assert "group_size must be a multiple of 8, got 12; try 8 or 16" in info.value.message


def test_four_bit_blocksize_choices():
    with pytest.raises(ScriptError) as info:
        check_text("quantize nf4 blocksize=100")
    assert "option 'blocksize': expected one of 32, 64" in info.value.message


def test_fuse_qkv_runs_before_quantize_whatever_the_order():
    validated = check_text("quantize int8\nfuse qkv in *Attention")
    assert [t.key() for t in validated.steps] == ["fuse qkv", "quantize int8"]


def test_fuse_qkv_then_quantize_quantizes_the_fused_projection(tmp_path):
    model = models.tiny_flux()
    reference = models.run(model)
    script = "fuse qkv in *Attention; quantize int8"
    try:
        transformdsl.transform(model, script)
    except TransformError as exc:
        if isinstance(exc.__cause__, NotImplementedError):
            pytest.skip("fuse qkv is not executable on this branch yet")
        raise
    names = [p for p, m in model.named_modules() if isinstance(m, q._backend().Int8Linear)]
    assert [p for p in names if p.endswith("to_qkv")]
    assert not [p for p in names if p.endswith(("to_q", "to_k", "to_v"))]
    out = models.run(model)
    assert rel_error(out, reference) < 0.004
    assert torch.equal(models.run(save_and_load(model, tmp_path)), out)


def test_int8_outlier_threshold_compiles_with_fullgraph():
    """Measured on torch 2.13 / bitsandbytes 0.50.2: the outlier path traces in one graph
    (bitsandbytes registers fake kernels with dynamic sizes), so no rule forbids it."""
    check_text("quantize int8 threshold=6\ncompile fullgraph=true")
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    layer = q._backend().Int8Linear.build(linear.weight, linear.bias, 6.0).eval()
    x = torch.randn(4, 64)
    x[:, :3] = 30.0  # three outlier columns
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))


# --------------------------------------------------------------------------- loading


def test_rebuild_rejects_a_malformed_record():
    skeleton = meta_copy(models.tiny_llama())
    options = Int8Options()
    with pytest.raises(LoadError, match="malformed layer entry"):
        q.Int8Quantization.rebuild(skeleton, {"layers": [{"path": "lm_head", "in": -1}]}, options)
    with pytest.raises(LoadError, match="which this architecture does not have"):
        q.Int8Quantization.rebuild(skeleton, {"layers": [
            {"path": "model.nope", "in": 4, "out": 4, "dtype": "float32", "bias": None}]}, options)


def test_loading_a_mismatched_four_bit_state_fails():
    torch.manual_seed(0)
    backend = q._backend()
    linear = nn.Linear(64, 32)
    saved = backend.FourBitLinear.build(linear.weight, linear.bias, "nf4", 64, False, torch.float32).state_dict()
    with torch.device("meta"):
        weight = torch.empty(32, 64)
    skeleton = backend.FourBitLinear.build(weight, None, "nf4", 128, False, torch.float32)
    saved.pop("bias")
    with pytest.raises(RuntimeError, match="does not match this layer"):
        skeleton.load_state_dict(saved, strict=True, assign=True)


def test_int8_loads_into_a_layer_never_quantized():
    """bitsandbytes refuses int8 state in a fresh Linear8bitLt; ours loads it, with or without assign."""
    torch.manual_seed(0)
    backend = q._backend()
    linear = nn.Linear(64, 32)
    layer = backend.Int8Linear.build(linear.weight, linear.bias, 0.0).eval()
    x = torch.randn(3, 64)
    for assign in (True, False):
        with torch.device("meta"):
            skeleton = backend.Int8Linear.build(torch.empty(32, 64), torch.empty(32), 0.0)
        if not assign:
            skeleton = skeleton.to_empty(device="cpu")
        skeleton.load_state_dict(layer.state_dict(), strict=True, assign=assign)
        assert type(skeleton.weight).__name__ == "Int8Params"
        assert torch.equal(skeleton.eval()(x), layer(x))


# --------------------------------------------------------------------------- examples and pipelines

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("example,names", [
    ("quantize_denoiser.tfm", ["flux", "unet"]),
    ("quantize_llm.tfm", ["llama", "gpt2"]),
])
def test_examples_plan_and_run(example, names, tmp_path):
    for name in names:
        model = FACTORIES[name]()
        steps = plan(model, EXAMPLES / example).steps
        assert all(step.targets for step in steps if step.transform.verb == "quantize")
        try:
            transformdsl.transform(model, EXAMPLES / example)
        except TransformError as exc:
            if isinstance(exc.__cause__, NotImplementedError):
                continue  # a statement of the example (fuse qkv) is not executable on this branch yet
            raise
        out = models.run(model)
        assert torch.equal(models.run(save_and_load(model, tmp_path / name)), out)


def test_pipeline_denoiser_and_text_encoder(tmp_path):
    pipe = models.tiny_sd_pipeline()
    reference = models.run(pipe)
    transformdsl.transform(pipe, "quantize int8\nquantize nf4 component=text_encoder")
    assert isinstance(pipe.unet.get_submodule("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"),
                      q._backend().Int8Linear)
    assert isinstance(pipe.text_encoder.get_submodule("encoder.layers.0.mlp.fc1"),
                      q._backend().FourBitLinear)
    out = models.run(pipe)
    assert rel_error(out, reference) < 0.1
    assert torch.equal(models.run(save_and_load(pipe, tmp_path)), out)


@pytest.mark.parametrize("bits,axis", [(8, 1), (4, 1), (4, 0), (3, 1), (3, 0), (2, 1), (1, 1)])
def test_hqq_structure_on_meta_is_what_hqq_builds(bits, axis):
    """Reloading builds the empty layer from the shapes alone: the same tensors, dtypes and
    meta data (values aside) that hqq's own quantizer gives for a real weight."""
    from transformdsl.transforms.quantize import layers as _quantized

    torch.manual_seed(0)
    weight = torch.randn(48, 80)
    real = _quantized.HQQLayer.build(weight, torch.zeros(48), bits, 16, axis, torch.float32)
    empty = _quantized.HQQLayer.build(weight.to("meta"), torch.zeros(48, device="meta"), bits, 16, axis,
                                      torch.float32)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in real.state_dict().items()}
    assert {k: (tuple(v.shape), v.dtype) for k, v in empty.state_dict().items()} == shapes
    assert all(v.is_meta for v in empty.state_dict().values())
    assert empty.meta == real.meta
    empty.load_state_dict(real.state_dict(), assign=True)
    x = torch.randn(3, 80)
    assert torch.equal(empty(x), real(x))
