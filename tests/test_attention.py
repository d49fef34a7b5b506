"""``attention BACKEND``: diffusers' attention dispatcher and transformers' attn_implementation as a statement."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import transformdsl
from tests.saved_files import edit_meta
from transformdsl import models
from transformdsl.errors import LoadError, ScriptError
from transformdsl.transforms import attention

dispatch = pytest.importorskip("diffusers.models.attention_dispatch")


def plan_error(model, script: str) -> str:
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(model, script)
    return str(info.value)


def backends(model) -> set[str]:
    return {str(getattr(m.processor, "_attention_backend", "-")) for m in model.modules()
            if getattr(m, "processor", None) is not None}


def test_the_declared_names_are_the_installed_libraries_names():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert attention.DIFFUSERS_BACKENDS == tuple(b.value for b in dispatch.AttentionBackendName)
    assert set(attention.TRANSFORMERS_BACKENDS) - {"eager"} <= set(ALL_ATTENTION_FUNCTIONS.keys())


def test_diffusers_backend_per_module_matches_set_attention_backend_by_hand():
    ours, hand = models.tiny_flux(), models.tiny_flux()
    active = dispatch._AttentionBackendRegistry._active_backend
    transformdsl.transform(ours, "attention native_math")
    assert dispatch._AttentionBackendRegistry._active_backend == active  # the process default is left alone
    args, kwargs = models.sample_inputs(ours)
    try:
        hand.set_attention_backend("_native_math")
        with torch.no_grad():
            assert torch.equal(ours(*args, **kwargs).sample, hand(*args, **kwargs).sample)
    finally:
        dispatch._AttentionBackendRegistry.set_active_backend(active)
    assert backends(ours) == {"AttentionBackendName._NATIVE_MATH"}


def test_in_selects_the_modules():
    model = models.tiny_flux()
    transformdsl.transform(model, "attention native_math in transformer_blocks.*")
    assert str(model.transformer_blocks[0].attn.processor._attention_backend) == "AttentionBackendName._NATIVE_MATH"
    assert model.single_transformer_blocks[0].attn.processor._attention_backend is None


def test_transformers_attn_implementation_matches_by_hand():
    ours, hand = models.tiny_llama(), models.tiny_llama()
    transformdsl.transform(ours, "attention eager")
    hand.set_attn_implementation("eager")
    assert ours.config._attn_implementation == "eager"
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, hand(ids).logits)


def test_plan_errors_name_the_requirement_and_an_alternative_that_works():
    flux, llama = models.tiny_flux(), models.tiny_llama()
    message = plan_error(flux, "attention flash")
    assert "flash-attn" in message and "works here: attention native" in message
    assert "sageattention" in plan_error(flux, "attention sage")
    message = plan_error(flux, "attention native_cudnn")  # a half-only CUDA kernel, on an fp32 CPU model
    assert "CUDA devices only" in message and "bfloat16 or float16" in message and "float32" in message
    assert "write 'attention native'" in plan_error(flux, "attention sdpa")
    assert "write 'attention sdpa'" in plan_error(llama, "attention native")
    message = plan_error(llama, "attention flash_attention_2")
    assert "FlashAttention2" in message and "works here: attention sdpa" in message
    assert "no attention module whose processor dispatches" in plan_error(models.tiny_unet(), "attention native")


def test_saved_backend_is_reapplied_on_load(tmp_path):
    model = models.tiny_flux()
    transformdsl.transform(model, "attention native_math")
    transformdsl.save(model, tmp_path / "m")
    assert backends(transformdsl.load(tmp_path / "m")) == {"AttentionBackendName._NATIVE_MATH"}
    llama = models.tiny_llama()
    transformdsl.transform(llama, "attention eager")
    transformdsl.save(llama, tmp_path / "l")
    assert transformdsl.load(tmp_path / "l").config._attn_implementation == "eager"


def _as_saved_on_a_gpu_machine(directory):
    """The save a CUDA machine with xformers writes: the same record, naming xformers."""
    meta_path = directory / "transformdsl.json"
    meta = json.loads(meta_path.read_text())
    step = meta["steps"][0]
    step["key"] = step["statement"] = "attention xformers"
    step["record"]["backend"] = "xformers"
    meta_path.write_text(json.dumps(meta))
    (directory / "script.tfm").write_text("attention xformers\n")


def test_load_refuses_a_backend_this_machine_lacks_unless_the_fallback_is_on(tmp_path, caplog):
    model = models.tiny_flux()
    transformdsl.transform(model, "attention native_math")
    transformdsl.save(model, tmp_path / "m")
    _as_saved_on_a_gpu_machine(tmp_path / "m")
    with pytest.raises(LoadError) as info:
        transformdsl.load(tmp_path / "m")
    assert "xformers" in str(info.value) and "FALLBACK.turned(True)" in str(info.value)
    with attention.FALLBACK.turned(True), caplog.at_level(logging.WARNING, logger="transformdsl"):
        loaded = transformdsl.load(tmp_path / "m")
    assert backends(loaded) == {"None"}  # the library's default
    assert "attention fallback is on" in caplog.text


@pytest.mark.parametrize("field, value, expected", [
    ("backend", "flash_hub", "names backend 'flash_hub' (diffusers), not the statement's '_native_math'"),
    ("library", "transformers", "names backend '_native_math' (transformers), not the statement's"),
    ("targets", ["nonexistent.block"], "names module 'nonexistent.block', which the loaded model does not have"),
    ("targets", "abc", "has no list of module paths (targets)"),
], ids=["another backend", "another library", "no such module", "not a list"])
def test_an_edited_attention_record_is_refused_on_load(tmp_path, field, value, expected):
    """The backend set on load is the statement's: an edited record does not choose what runs."""
    model = models.tiny_flux()
    transformdsl.transform(model, "attention native_math")
    transformdsl.save(model, tmp_path / "m")
    edit_meta(tmp_path / "m", ("steps", 0, "record", field), value)
    with pytest.raises(LoadError) as info:
        transformdsl.load(tmp_path / "m")
    assert expected in str(info.value)


def test_only_the_lossy_sage_kernels_declare_no_error_bound():
    from transformdsl.registry import declaration

    lossy = {mode for mode in attention.MODES if declaration(f"attention {mode}").error_bound is None}
    assert lossy == {mode for mode in attention.MODES if mode.startswith("sage")} and "sage" in lossy
    assert declaration("attention native_math").error_bound == 0.0


def test_a_processor_that_runs_with_one_backend_only_is_a_plan_error():
    """AnyFlow's causal processor declares _SUPPORTED_BACKENDS (flex) and raised at the first call."""
    from tests.zoo import corpus

    model, _ = corpus.build(corpus.entry("diffusers/AnyFlowFARTransformer3DModel"))
    text = plan_error(model, "attention native_math")
    assert "AnyFlowCausalAttnProcessor (on blocks.0.attn1 and 1 more) runs only with the flex" in text
    assert "write 'attention flex'" in text
    assert transformdsl.plan(model, "attention flex").steps[0].targets == [""]


def test_the_records_list_of_attention_modules_chooses_nothing_on_load(tmp_path):
    """A processor the user wrapped (or another diffusers version) changes which modules dispatch; the load
    sets the statement's backend on the loaded model's attention modules, whatever the list says."""
    model = models.tiny_flux()
    transformdsl.transform(model, "attention native_math")
    transformdsl.save(model, tmp_path / "m")
    edit_meta(tmp_path / "m", ("steps", 0, "record", "modules"), ["x.y"])
    assert backends(transformdsl.load(tmp_path / "m")) == {"AttentionBackendName._NATIVE_MATH"}


def test_two_whole_model_attention_statements_are_refused():
    with pytest.raises(ScriptError, match="both set the attention of the whole model"):
        transformdsl.plan(models.tiny_flux(), "attention native\nattention native_math")


def test_attention_runs_before_cache_and_compile():
    plan = transformdsl.plan(models.tiny_flux(), "compile\ncache first_block\nattention native_math")
    assert [s.transform.key() for s in plan.steps] == ["attention native_math", "cache first_block", "compile"]
