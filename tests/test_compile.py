"""``compile`` and ``compile regional``.

Compiling costs seconds per graph on a CPU, so the compiled cases are few and small:
inductor where the graph is small (Llama, regional UNet blocks), ``aot_eager`` (dynamo's
full capture and AOT autograd, without code generation) for the larger whole-model graphs.
The inductor cache is shared by the whole test run (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transformdsl
from transformdsl import models
from transformdsl.errors import ScriptError
from transformdsl.extend import Transform
from transformdsl.transforms.compile import run as compile_pass
from transformdsl.transforms.compile.run import is_compiled


def compiled_paths(root: nn.Module) -> list[str]:
    return [path for path, m in root.named_modules() if is_compiled(m)]


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# --------------------------------------------------------------------------- planning (no compiling)


def test_compile_runs_last_and_conflicts_are_found_before_running(monkeypatch):
    model = models.tiny_llama()
    the_plan = transformdsl.plan(model, "compile fullgraph=true\nfuse bias_act_dropout")
    assert [s.transform.key() for s in the_plan.steps] == ["fuse bias_act_dropout", "compile"]
    # A rule another transform declares against compile stops the script before anything runs.
    def no_fullgraph(self, other):
        return "no fullgraph here" if other.verb == "compile" and other.options.fullgraph else None

    monkeypatch.setattr(transformdsl.registry.get("fuse bias_act_dropout"), "incompatible", no_fullgraph)
    keys = list(model.state_dict())
    with pytest.raises(ScriptError, match="line 1.*line 2.*no fullgraph here"):
        transformdsl.transform(model, "fuse bias_act_dropout\ncompile fullgraph=true")
    assert compiled_paths(model) == [] and list(model.state_dict()) == keys
    monkeypatch.undo()
    with pytest.raises(ScriptError, match="compiled once"):
        transformdsl.plan(model, "compile\ncompile regional in *DecoderLayer")
    with pytest.raises(ScriptError, match="needs an 'in' clause"):
        transformdsl.plan(model, "compile regional")
    with pytest.raises(ScriptError, match="needs backend=inductor"):
        transformdsl.plan(model, "compile mode=max-autotune backend=eager")


def test_regional_plan_names_the_blocks_and_containers():
    model = models.tiny_flux()
    step = transformdsl.plan(model, "compile regional in *TransformerBlock").steps[0]
    assert step.targets == ["transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"]
    assert any("1 × FluxTransformerBlock, 2 × FluxSingleTransformerBlock" in n for n in step.notes)
    step = transformdsl.plan(model, "compile regional in single_transformer_blocks").steps[0]
    assert step.targets == [] and "ModuleList has no forward" in step.skipped[0][1]


def test_compile_in_place_keeps_the_pipeline_and_the_keys():
    pipe = models.tiny_sd_pipeline()
    unet = pipe.unet
    keys = list(unet.state_dict())
    transformdsl.transform(pipe, "compile fullgraph=false")
    assert pipe.unet is unet and type(unet).__name__ == "UNet2DConditionModel"
    assert compiled_paths(unet) == [""] and list(unet.state_dict()) == keys
    # Already compiled: a second run lists it as a near miss instead of compiling twice.
    assert transformdsl.plan(pipe, "compile").steps[0].skipped == [("", "already compiled (torch.compile)")]


def test_rollback_after_a_failure_midway_leaves_the_model_bit_identical(monkeypatch):
    model = models.tiny_llama()
    before = dict(model.state_dict(keep_vars=True))
    classes = {path: type(m) for path, m in model.named_modules()}
    calls = []
    real = compile_pass.compile_in_place

    def fail_on_second(module, kwargs):
        calls.append(module)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        real(module, kwargs)

    monkeypatch.setattr(compile_pass, "compile_in_place", fail_on_second)
    script = "fuse bias_act_dropout kernel=eager\ncompile regional in *DecoderLayer"
    with pytest.raises(transformdsl.TransformError, match="injected failure"):
        transformdsl.transform(model, script)
    assert len(calls) == 2  # the first layer was compiled (and the MLPs fused) before the failure
    assert compiled_paths(model) == []
    assert {path: type(m) for path, m in model.named_modules()} == classes
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)


# --------------------------------------------------------------------------- compiled == eager

CASES = [
    ("llama", "compile fullgraph=true"),
    ("llama", "compile regional in *DecoderLayer fullgraph=false"),
    ("unet", "compile regional in BasicTransformerBlock fullgraph=true"),
    ("sd3", "compile fullgraph=false backend=aot_eager"),
    ("flux", "compile fullgraph=true backend=aot_eager"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "script"), CASES, ids=[f"{n}: {s}" for n, s in CASES])
def test_compiled_agrees_with_eager(name, script):
    model = models.BUILTIN[name]()
    want = models.run(model)
    transformdsl.transform(model, script)
    graphs = unique_graphs()
    torch.testing.assert_close(models.run(model), want, rtol=1e-4, atol=1e-4)
    compiled = unique_graphs()
    if "regional" in script and name == "llama":
        assert compiled_paths(model) == ["model.layers.0", "model.layers.1"]
        assert compiled - graphs <= 1  # both layers run one graph (none new if an earlier test made it)
    models.run(model)
    assert unique_graphs() == compiled, "a second call with the same inputs recompiled"


@pytest.mark.slow
def test_save_and_load_compile_again(tmp_path):
    model = transformdsl.transform(models.tiny_llama(), "compile regional in *DecoderLayer fullgraph=false")
    want = models.run(model)
    transformdsl.save(model, tmp_path / "compiled")
    loaded = transformdsl.load(tmp_path / "compiled")
    assert compiled_paths(loaded) == ["model.layers.0", "model.layers.1"]  # finalize() compiled them again
    torch.testing.assert_close(models.run(loaded), want, rtol=1e-5, atol=1e-5)


def test_an_edited_compile_record_is_refused_on_load(tmp_path):
    """The options compiled with on load are the saved statement's: a record naming others is refused."""
    from tests.saved_files import edit_meta
    from transformdsl.errors import LoadError

    model = transformdsl.transform(models.tiny_llama(), "compile regional in *DecoderLayer fullgraph=false")
    transformdsl.save(model, tmp_path / "m")
    edit_meta(tmp_path / "m", ("steps", 0, "record", "options", "backend"), "eager")
    with pytest.raises(LoadError, match="step 'compile regional' record options .* disagree with its options"):
        transformdsl.load(tmp_path / "m")


@pytest.mark.slow
def test_quantized_and_compiled_saves_reloads_and_runs(tmp_path):
    if transformdsl.registry.get("quantize int8").apply is Transform.apply:
        pytest.skip("the quantize pass has not landed yet")
    model = models.tiny_llama()
    want = models.run(model)
    transformdsl.transform(model, "quantize int8; compile regional in *DecoderLayer fullgraph=false")
    got = models.run(model)
    torch.testing.assert_close(got, want, rtol=0.1, atol=0.1)
    transformdsl.save(model, tmp_path / "q")
    loaded = transformdsl.load(tmp_path / "q")
    assert compiled_paths(loaded) == ["model.layers.0", "model.layers.1"]
    torch.testing.assert_close(models.run(loaded), got, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- kv_cache=static: generate's decode step


def test_kv_cache_static_is_refused_where_transformers_cannot_run_it():
    with pytest.raises(ScriptError, match="not a transformers model that generates"):
        transformdsl.plan(models.tiny_flux(), "compile kv_cache=static")
    with pytest.raises(ScriptError, match="use 'compile kv_cache=static' instead of the regional form"):
        transformdsl.plan(models.tiny_llama(), "compile regional in *DecoderLayer kv_cache=static")


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["quantize int8 weight_only=true", "quantize q4_0"])
def test_kv_cache_static_compiles_the_decode_step_and_generates_the_same_tokens(tmp_path, quantize):
    """Decode-sized inputs take the packed kernels, which inductor lowers itself (the int8 one crashed
    before its scales were kept in bfloat16)."""
    torch.manual_seed(0)
    model = models.tiny_llama().eval()
    transformdsl.transform(model, quantize)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    the_plan = transformdsl.plan(model, "compile kv_cache=static")
    assert any("decode step" in note for note in the_plan.steps[0].notes)
    transformdsl.transform(model, "compile kv_cache=static")
    assert compiled_paths(model) == []  # direct calls stay eager: only generate's decode step is compiled
    assert model.generation_config.cache_implementation == "static"
    graphs = unique_graphs()
    with torch.inference_mode():
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    assert unique_graphs() > graphs and hasattr(model, "_compiled_call")
    transformdsl.save(model, tmp_path / "m")
    loaded = transformdsl.load(tmp_path / "m")
    config = loaded.generation_config
    assert config.cache_implementation == "static" and config.compile_config.mode == "default"
    assert config.compile_config.dynamic is False


def test_kv_cache_static_is_rolled_back_with_the_rest(monkeypatch):
    model = models.tiny_llama()
    before = dict(vars(model.generation_config))
    real = compile_pass.static_decode

    def then_fail(module, options, edit):
        real(module, options, edit)
        assert module.generation_config.cache_implementation == "static"
        raise RuntimeError("injected failure")

    monkeypatch.setattr(compile_pass, "static_decode", then_fail)
    with pytest.raises(transformdsl.TransformError, match="injected failure"):
        transformdsl.transform(model, "compile kv_cache=static")
    assert vars(model.generation_config) == before
