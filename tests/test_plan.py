"""Planning against real module trees (spec.md "Validation, ordering and conflicts", "Pipelines").

``explain`` output (a Plan's ``str()``) is compared with golden files
``tests/golden/explain/<model>__<example>.txt``, one for every built-in model each example names
in its header; ``UPDATE_GOLDEN=1`` rewrites them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from golden import EXAMPLES, assert_golden, explain_cases, explain_golden

import transformdsl
from transformdsl.errors import ScriptError
from transformdsl.models import BUILTIN
from transformdsl.planner import Plan
from transformdsl.validate import check_text


@functools.cache
def tiny(name: str):
    """A built-in model, built once per test module (planning never changes it)."""
    return BUILTIN[name]()


def plan_text(model, text):
    return transformdsl.plan(tiny(model) if isinstance(model, str) else model, text)


CASES = explain_cases()


# --------------------------------------------------------------------------- golden explain output


@pytest.mark.parametrize("model, example", CASES, ids=[f"{m}-{e}" for m, e in CASES])
def test_explain_matches_golden(model, example):
    plan = transformdsl.plan(tiny(model), EXAMPLES / f"{example}.tfm")
    assert_golden(explain_golden(model, example), str(plan))


def test_every_builtin_has_golden_plans():
    assert {model for model, _ in CASES} == set(BUILTIN)


def test_no_stale_golden_files():
    expected = {explain_golden(m, e).split("/", 1)[1] for m, e in CASES}
    present = {p.name for p in (Path(__file__).parent / "golden" / "explain").glob("*.txt")}
    assert present <= expected, f"golden files of no example: {sorted(present - expected)}"


@pytest.mark.parametrize("model, example", CASES, ids=[f"{m}-{e}" for m, e in CASES])
def test_plan_json_round_trips(model, example):
    plan = transformdsl.plan(tiny(model), EXAMPLES / f"{example}.tfm")
    data = plan.to_json()
    assert json.loads(json.dumps(data)) == data
    assert [s["line"] for s in data["steps"]] == [s.statement.line for s in plan.steps]
    assert [s["targets"] for s in data["steps"]] == [s.targets for s in plan.steps]


# --------------------------------------------------------------------------- what a plan holds


def test_plan_json_fields():
    data = plan_text("gpt2", "quantize int8 threshold=6 except ln_f\n").to_json()
    gpt2 = tiny("gpt2")
    assert data["model"] == "GPT2LMHeadModel"
    assert data["components"] == {"": "GPT2LMHeadModel"}
    assert data["modules"] == sum(1 for _ in gpt2.modules())
    assert data["bytes"] == sum(p.numel() * p.element_size() for p in gpt2.parameters())  # tied: counted once
    (step,) = data["steps"]
    conv1d = [p for p, m in gpt2.named_modules() if type(m).__name__ == "Conv1D"]
    assert step == {
        "line": 1,
        "statement": "quantize int8 threshold=6 except ln_f",
        "key": "quantize int8",
        "options": {"method": "rtn", "damp": 0.01, "block_size": 128, "act_order": True, "threshold": 6.0,
                    "weight_only": False},
        "component": "",
        "targets": conv1d,
        "skipped": [],
        "excluded": {"default: lm_head": 1},
        "bytes": sum(p.numel() * 4 for path in conv1d for p in gpt2.get_submodule(path).parameters()),
        "notes": step["notes"],  # the transform's own remarks (quantize: the expected size)
        "device_note": step["device_note"],  # depends on this machine's CPU (tests/test_capabilities.py)
    }
    assert all(isinstance(note, str) for note in step["notes"])


def test_steps_are_in_execution_order():
    plan = plan_text("flux", "compile\nquantize int8 in single_transformer_blocks.*\nfuse qkv in *Attention")
    assert [(s.transform.key(), s.statement.line) for s in plan.steps] == [
        ("fuse qkv", 3), ("quantize int8", 2), ("compile", 1)]


def test_planning_leaves_the_model_untouched():
    model = BUILTIN["flux"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    structure = [(p, type(m)) for p, m in model.named_modules()]
    transformdsl.plan(model, EXAMPLES / "fp8_dit.tfm")
    assert [(p, type(m)) for p, m in model.named_modules()] == structure
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_quantize_after_fuse_qkv_names_the_fused_projection():
    # spec.md: planning applies each transform's structural effect to the snapshot.
    plan = plan_text("flux", "quantize int8\nfuse qkv in *Attention")
    quantize = plan.steps[1]
    assert "transformer_blocks.0.attn.to_qkv" in quantize.targets
    assert not any(p.endswith((".to_q", ".to_k", ".to_v")) for p in quantize.targets)


def test_statement_selecting_nothing_says_so():
    plan = plan_text("flux", "quantize int8 in norm_out")  # norm_out.linear: excluded by default
    (step,) = plan.steps
    assert step.targets == [] and step.excluded == {"default: norm": 1}
    assert "selects no module: this statement does nothing on this model" in step.notes


# --------------------------------------------------------------------------- conflicts


def test_two_weight_formats_on_the_same_modules_conflict():
    first, second = "quantize int8 in single_transformer_blocks.*", "fp8 storage in single_transformer_blocks.0"
    (alone,) = plan_text("flux", second).steps
    shared = [p for p in alone.targets if p in plan_text("flux", first).steps[0].targets]
    assert shared
    with pytest.raises(ScriptError) as info:
        plan_text("flux", f"{first}\n{second}")
    (problem,) = info.value.problems
    assert problem.message == (
        f"'quantize int8' (line 1) and 'fp8 storage' (line 2) both change {len(shared)} module(s) "
        f"({', '.join(shared[:3])} ...); a module takes one of them")
    assert [s.line for s in problem.spans] == [1, 2]
    # The fix is checked by planning again (tests/test_first_hour.py applies such hints).
    assert problem.hint == "add 'except single_transformer_blocks.0' to line 1 (checked: the script then plans)"


def test_conflict_without_a_working_fix_offers_none():
    # Both statements name the same attention: any `except` leaves one of them nothing to do.
    with pytest.raises(ScriptError) as info:
        plan_text("flux", "quantize int8 in transformer_blocks.0.attn\nfp8 storage in transformer_blocks.0.attn")
    hint = info.value.problems[0].hint
    assert hint == "narrow one statement with 'except' or 'in' so that each module is named by one of them"


@pytest.mark.parametrize("text, native_line", [
    ("fp8 native Linear in transformer_blocks.*\nfp8 storage", 1),
    ("fp8 storage\nfp8 native Linear in transformer_blocks.*", 2),  # native still runs first
])
def test_fp8_native_takes_layers_from_fp8_storage_and_says_so(text, native_line):
    native, storage = plan_text("flux", text).steps
    assert (native.transform.key(), native.statement.line) == ("fp8 native", native_line)
    assert native.targets and not set(native.targets) & set(storage.targets)
    assert sorted(p for p, _ in storage.overridden) == sorted(native.targets)
    assert f"{len(native.targets)} module(s) left to line(s) {native_line}, which take precedence" in storage.notes


# --------------------------------------------------------------------------- pipelines


def test_pipeline_statements_target_the_denoiser_by_default():
    pipe = tiny("sd-pipeline")
    (step,) = plan_text(pipe, "quantize int8").steps
    assert step.component == "unet"
    unet_linears = {p for p, m in pipe.unet.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(step.targets) <= unet_linears


def test_component_points_a_statement_at_another_component():
    pipe = tiny("sd-pipeline")
    unet, text = plan_text(pipe, "quantize int8\nquantize int8 component=text_encoder").steps
    assert (unet.component, text.component) == ("unet", "text_encoder")
    encoder_linears = [p for p, m in pipe.text_encoder.named_modules() if isinstance(m, torch.nn.Linear)]
    assert text.targets == encoder_linears  # relative to the component; CLIP has no default exclusion to hit


def test_selectors_are_relative_to_the_component():
    (step,) = plan_text("sd-pipeline", "quantize int8 component=text_encoder in encoder.layers.0").steps
    assert step.targets and all(p.startswith("encoder.layers.0.") for p in step.targets)


@pytest.mark.parametrize("text, column, message, hint", [
    ("quantize int8 component=tokenizer", 15, "the pipeline has no component 'tokenizer'",
     "components: text_encoder, unet, vae"),
    ("fuse qkv\nquantize int8 component=text_encodr", 15, "the pipeline has no component 'text_encodr'",
     "components: text_encoder, unet, vae"),
])
def test_bad_component(text, column, message, hint):
    with pytest.raises(ScriptError) as info:
        plan_text("sd-pipeline", text)
    (problem,) = info.value.problems
    assert (problem.span.column, problem.message, problem.hint) == (column, message, hint)


def test_component_on_a_plain_module_is_an_error():
    with pytest.raises(ScriptError) as info:
        plan_text("flux", "quantize int8 component=text_encoder")
    assert info.value.message == "component= applies to pipelines; this model is a single module"
    assert (info.value.line, info.value.column) == (1, 15)


def test_pipeline_plan_lists_its_components():
    plan = plan_text("sd-pipeline", "quantize int8")
    assert plan.components == {"vae": "AutoencoderKL", "text_encoder": "CLIPTextModel",
                               "unet": "UNet2DConditionModel"}
    assert str(plan).splitlines()[0].startswith(
        "model: StableDiffusionPipeline (vae=AutoencoderKL, text_encoder=CLIPTextModel, unet=UNet2DConditionModel): ")


# --------------------------------------------------------------------------- what plan() accepts


def test_plan_accepts_text_a_path_a_script_or_a_validated_script(tmp_path):
    text = "fuse qkv in *Attention\nquantize int8 except norm\n"
    path = tmp_path / "s.tfm"
    path.write_text(text)
    expected = plan_text("flux", text).to_json()
    for script in (text, str(path), path, transformdsl.parse(text), check_text(text)):
        plan = transformdsl.plan(tiny("flux"), script)
        assert isinstance(plan, Plan)
        assert plan.to_json() == expected


def test_plan_from_a_path_keeps_the_filename_in_errors(tmp_path):
    path = tmp_path / "bad.tfm"
    path.write_text("fuse qkv\nquantize int8 except nrm\n")
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(tiny("flux"), path)
    assert info.value.diagnostics() == [f"{path}:2:22: selector 'nrm' matches no module"]


def test_plan_rejects_other_things():
    with pytest.raises(TypeError, match="a script is text, a .tfm path or a parsed Script"):
        transformdsl.plan(tiny("flux"), 42)
    with pytest.raises(TypeError, match="expected a torch.nn.Module or a diffusers pipeline"):
        transformdsl.plan(object(), "quantize int8")


@pytest.mark.parametrize("factory, text, inside", [
    ("tiny_flux", "attention native_math except single_transformer_blocks.*", "single_transformer_blocks.0"),
    ("tiny_flux", "cache first_block except transformer_blocks.0", "transformer_blocks.0"),
    ("tiny_llama", "compile except model.layers.1", "model.layers.1"),
])
def test_an_except_inside_a_whole_target_is_an_error_not_ignored(factory, text, inside):
    """A statement that changes its target as a whole (the root here) cannot leave out a module inside
    it: silently ignoring the `except` would change what the user excluded."""
    import transformdsl
    from transformdsl import models

    with pytest.raises(transformdsl.ScriptError, match=rf"would change nothing: .* changes <root> as a whole, "
                                                       rf"and {inside} lies inside it"):
        transformdsl.plan(getattr(models, factory)(), text)
