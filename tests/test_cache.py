"""``cache MODE``: diffusers' step caches as statements, compared with ``enable_cache`` by hand.

Every mode runs on a real diffusers denoiser that supports it (the built-in tiny Flux, or a corpus
model built from its tiny config) over a sequence of calls in one cache context, and must give
outputs bit-identical to diffusers' own ``enable_cache(Config(...))`` on a copy; every mode is a
plan error on a model its hooks cannot wrap.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import transformdsl
from tests.saved_files import edit_meta
from tests.zoo import corpus
from transformdsl import models
from transformdsl.errors import ScriptError

diffusers_hooks = pytest.importorskip("diffusers.hooks")
ROOT = Path(__file__).resolve().parents[1]


def flux_loop(model, steps: int = 8, timestep_scale: float = 1.0, context: dict | None = None):
    """``steps`` denoiser calls in one cache context on the tiny Flux: latents drift, timesteps fall."""
    args, kwargs = models.sample_inputs(model)
    outputs = []
    with torch.no_grad():
        for i in range(steps):
            kw = dict(kwargs, timestep=torch.full_like(kwargs["timestep"], (1 - i / steps) * timestep_scale))
            with model.cache_context("cond", **(context(i) if context else {})):
                outputs.append(model(args[0] * (1 + 0.02 * i), **kw).sample)
    model._reset_stateful_cache()
    return torch.stack(outputs)


def corpus_loop(model, inputs, steps: int = 6, context=None, timesteps=None):
    args, kwargs = inputs
    outputs = []
    with torch.no_grad():
        for i in range(steps):
            kw = dict(kwargs)
            if timesteps is not None:
                kw["timestep"] = torch.full_like(kwargs["timestep"], timesteps[i])
            with model.cache_context("cond", **(context(i) if context else {})):
                outputs.append(corpus.output_tensor(model(*args, **kw)))
    model._reset_stateful_cache()
    return torch.stack(outputs)


def plan_error(model, script: str) -> str:
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(model, script)
    return str(info.value)


# --------------------------------------------------------------------------- done-when


def test_first_block_matches_enable_cache_by_hand_and_skips():
    ours, by_hand, plain = models.tiny_flux(), models.tiny_flux(), models.tiny_flux()
    transformdsl.transform(ours, "cache first_block threshold=0.2")
    by_hand.enable_cache(diffusers_hooks.FirstBlockCacheConfig(threshold=0.2))
    got, expected = flux_loop(ours), flux_loop(by_hand)
    assert torch.equal(got, expected)
    with torch.no_grad():  # the cache does skip: some step differs from the uncached model
        args, kwargs = models.sample_inputs(plain)
    uncached = torch.stack([plain(args[0] * (1 + 0.02 * i), **dict(kwargs, timestep=torch.full_like(
        kwargs["timestep"], 1 - i / 8))).sample.detach() for i in range(8)])
    assert torch.equal(got[0], uncached[0])  # the first call computes every block
    assert not torch.equal(got, uncached)
    assert ours.is_cache_enabled and type(ours._cache_config).__name__ == "FirstBlockCacheConfig"


def test_saved_cache_reloads_in_a_fresh_process_with_the_same_outputs(tmp_path):
    model = models.tiny_flux()
    transformdsl.transform(model, "cache first_block threshold=0.2")
    expected = flux_loop(model)
    transformdsl.save(model, tmp_path / "saved")
    torch.save(expected, tmp_path / "expected.pt")
    code = textwrap.dedent(f"""
        import torch, transformdsl
        from tests.test_cache import flux_loop
        model = transformdsl.load({str(tmp_path / 'saved')!r})
        assert model.is_cache_enabled, "cache not re-enabled"
        assert model._cache_config.threshold == 0.2
        assert torch.equal(flux_loop(model), torch.load({str(tmp_path / 'expected.pt')!r}))
        print("same")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "same" in result.stdout


def test_bare_call_outside_a_cache_context_gets_diffusers_message_at_the_call():
    from transformdsl.transforms.cache.guard import CacheContextError

    model = models.tiny_flux()
    transformdsl.transform(model, "cache first_block threshold=0.2")
    args, kwargs = models.sample_inputs(model)
    with pytest.raises(CacheContextError) as info, torch.no_grad():
        model(*args, **kwargs)
    message = str(info.value)
    assert message.startswith("No cache context is set.")  # diffusers' own words
    assert "cache first_block threshold=0.2" in message and "cache_context" in message
    assert isinstance(info.value, ValueError)  # what diffusers raises, for code that catches it
    frames = [f.name for f in __import__("traceback").extract_tb(info.value.__traceback__)]
    assert "new_forward" not in frames[-2:]  # raised at the denoiser's call, not inside a block hook


def test_verify_runs_each_sample_in_a_fresh_context():
    model = models.tiny_flux()
    lines = []
    transformdsl.transform(model, "cache first_block threshold=0.2", verify=True, log=lines.append)
    assert any(line.startswith("verify: rms 0 ") and "within the bound 0" in line for line in lines)
    with torch.no_grad(), model.cache_context("x"):  # verify left no cached step behind
        pass


def _tiny_flux_pipeline():
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), latent_channels=1,
                        norm_num_groups=1, sample_size=32).eval()
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=models.tiny_flux())


def _run_pipeline(pipe):
    torch.manual_seed(1)
    embeds, pooled = torch.randn(1, 8, 32), torch.randn(1, 16)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=6, height=16, width=16,
                generator=torch.Generator().manual_seed(0), output_type="latent").images


def test_a_pipeline_keeps_working_as_called_and_matches_by_hand():
    ours, by_hand = _tiny_flux_pipeline(), _tiny_flux_pipeline()
    transformdsl.transform(ours, "cache pyramid_broadcast spatial_attention_block_skip_range=2 "
                                 "spatial_attention_timestep_skip_range=\"100,950\"")
    by_hand.transformer.enable_cache(diffusers_hooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(100, 950),
        current_timestep_callback=lambda: by_hand._current_timestep))
    first = _run_pipeline(ours)
    assert torch.equal(first, _run_pipeline(by_hand))
    assert torch.equal(_run_pipeline(ours), first)  # the pipeline resets the cache after each call


# --------------------------------------------------------------------------- every mode, supported and not


def _hand(model, config):
    model.enable_cache(config)
    return model


def test_taylorseer_matches_by_hand_and_refuses_a_model_without_its_modules():
    ours, hand = models.tiny_flux(), models.tiny_flux()
    transformdsl.transform(ours, "cache taylorseer cache_interval=2 disable_cache_before_step=1 "
                                 "taylor_factors_dtype=float32")
    _hand(hand, diffusers_hooks.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                                      taylor_factors_dtype=torch.float32))
    assert torch.equal(flux_loop(ours), flux_loop(hand))
    wan, _ = corpus.build(corpus.entry("diffusers/WanTransformer3DModel"))
    assert "'cache taylorseer' hooks the modules whose names fully match" in plan_error(wan, "cache taylorseer")


def test_pyramid_broadcast_matches_by_hand_reading_the_calls_timestep():
    ours, hand = models.tiny_flux(), models.tiny_flux()
    transformdsl.transform(ours, "cache pyramid_broadcast spatial_attention_block_skip_range=3 "
                                 "spatial_attention_timestep_skip_range=\"-1,900\"")
    step = {"i": 0}
    _hand(hand, diffusers_hooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=3, spatial_attention_timestep_skip_range=(-1, 900),
        current_timestep_callback=lambda: (1 - step["i"] / 8) * 1000))

    def context(i):
        step["i"] = i
        return {}
    got, expected = flux_loop(ours), flux_loop(hand, context=context)
    assert torch.equal(got, expected)
    assert "identifiers" in plan_error(models.tiny_flux(), "cache pyramid_broadcast "
                                                           "spatial_attention_block_identifiers=\"^nothing$\"")


def test_mag_matches_by_hand_and_needs_ratios():
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    ours, hand = models.tiny_flux(), models.tiny_flux()
    transformdsl.transform(ours, "cache mag mag_ratios=flux num_inference_steps=8 threshold=0.5")
    _hand(hand, diffusers_hooks.MagCacheConfig(mag_ratios=FLUX_MAG_RATIOS.clone(), num_inference_steps=8,
                                               threshold=0.5))
    assert torch.equal(flux_loop(ours), flux_loop(hand))
    with pytest.raises(ScriptError, match="mag_ratios=flux"):
        transformdsl.plan(models.tiny_flux(), "cache mag")
    ace, _ = corpus.build(corpus.entry("diffusers/AceStepTransformer1DModel"))
    assert "it does not know AceStepTransformerBlock" in plan_error(ace, "cache mag mag_ratios=flux")


def test_first_block_refuses_a_model_with_one_block_and_a_non_cache_model():
    allegro, _ = corpus.build(corpus.entry("diffusers/AllegroTransformer3DModel"))
    assert "needs at least 2; AllegroTransformer3DModel has 1 block(s)" in plan_error(allegro, "cache first_block")
    assert "a step cache works on a diffusers denoiser" in plan_error(models.tiny_unet(), "cache first_block")
    assert "a step cache works on a diffusers denoiser" in plan_error(models.tiny_llama(), "cache first_block")


def test_faster_matches_by_hand_on_cogvideox_and_refuses_flux_free_models():
    entry = corpus.entry("diffusers/CogVideoXTransformer3DModel[CogVideoXTransformer]")
    ours, inputs = corpus.build(entry)
    hand, _ = corpus.build(entry)
    timesteps = [999, 900, 700, 600, 500, 400]
    transformdsl.transform(ours, "cache faster")
    step = {"i": 0}
    _hand(hand, diffusers_hooks.FasterCacheConfig(current_timestep_callback=lambda: timesteps[step["i"]],
                                                  attention_weight_callback=lambda _: 0.5))

    def context(i):
        step["i"] = i
        return {}
    got = corpus_loop(ours, inputs, timesteps=timesteps)
    assert torch.equal(got, corpus_loop(hand, inputs, timesteps=timesteps, context=context))
    ace, _ = corpus.build(corpus.entry("diffusers/AceStepTransformer1DModel"))
    assert "'cache faster' hooks diffusers self-attention modules" in plan_error(ace, "cache faster")


def test_sea_matches_by_hand_on_wan_and_refuses_models_without_an_adapter():
    entry = corpus.entry("diffusers/WanTransformer3DModel")
    ours, inputs = corpus.build(entry)
    hand, _ = corpus.build(entry)
    transformdsl.transform(ours, "cache sea threshold=0.5")
    _hand(hand, diffusers_hooks.SeaCacheConfig(threshold=0.5))

    def context(i):
        return {"step_index": i, "num_inference_steps": 6, "sigma": 1 - i / 6}
    got = corpus_loop(ours, inputs, context=context)
    assert torch.equal(got, corpus_loop(hand, inputs, context=context))
    assert "needs a raw_vision_callback" in plan_error(models.tiny_flux(), "cache sea")


def test_text_kv_matches_by_hand_on_nucleus_and_refuses_flux():
    entry = corpus.entry("diffusers/NucleusMoEImageTransformer2DModel")
    ours, inputs = corpus.build(entry)
    hand, _ = corpus.build(entry)
    transformdsl.transform(ours, "cache text_kv")
    _hand(hand, diffusers_hooks.TextKVCacheConfig())
    assert torch.equal(corpus_loop(ours, inputs, steps=3), corpus_loop(hand, inputs, steps=3))
    assert "'cache text_kv' hooks NucleusMoEImageTransformerBlock" in plan_error(models.tiny_flux(), "cache text_kv")


# --------------------------------------------------------------------------- rules


def test_one_cache_per_denoiser():
    with pytest.raises(ScriptError, match="one step cache at a time"):
        transformdsl.plan(models.tiny_flux(), "cache first_block\ncache taylorseer")


def test_a_cache_enabled_outside_the_script_is_a_plan_error():
    model = models.tiny_flux()
    model.enable_cache(diffusers_hooks.FirstBlockCacheConfig())
    assert "already has a step cache" in plan_error(model, "cache first_block")


def test_cache_runs_after_structural_transforms_and_before_compile():
    plan = transformdsl.plan(models.tiny_flux(), "compile\ncache first_block\nfuse qkv\nquantize int8 except norm")
    order = [step.transform.key() for step in plan.steps]
    assert order.index("cache first_block") > order.index("fuse qkv")
    assert order.index("cache first_block") > order.index("quantize int8")
    assert order.index("cache first_block") < order.index("compile")


def test_options_are_checked_without_a_model():
    from transformdsl.parser import parse
    from transformdsl.validate import validate

    for script, needle in [("cache first_block threshold=-1", "at least 0"),
                           ("cache taylorseer skip_predict_identifiers=\"(\"", "not a regular expression"),
                           ("cache pyramid_broadcast cross_attention_timestep_skip_range=\"9,1\"", "low end"),
                           ("cache faster tensor_format=BSC", "expected one of"),
                           ("cache sea residual_order=2", "expected one of"),
                           ("cache mag", "mag_ratios=flux")]:
        with pytest.raises(ScriptError, match=needle):
            validate(parse(script))


def test_a_rollback_removes_the_cache_and_its_hooks():
    from transformdsl.edit import Edit
    from transformdsl.extend import ApplyContext

    model = models.tiny_flux()
    args, kwargs = models.sample_inputs(model)
    with torch.no_grad():
        before = model(*args, **kwargs).sample
    keys = {id(m): set(m.__dict__) for m in model.modules()}
    step = transformdsl.plan(model, "cache first_block threshold=0.2").steps[0]
    edit = Edit()
    step.transform.apply(ApplyContext(root=model, edit=edit, progress=lambda items, **_: items), step.targets)
    assert model.is_cache_enabled
    edit.rollback()
    assert not model.is_cache_enabled
    assert {id(m): set(m.__dict__) for m in model.modules()} == keys  # no hook, no forward override left
    with torch.no_grad():  # a bare call works again, with the same output
        assert torch.equal(model(*args, **kwargs).sample, before)


@pytest.mark.parametrize("mode", ["first_block", "taylorseer", "pyramid_broadcast", "mag mag_ratios=flux"])
def test_fullgraph_compile_is_refused_with_a_cache_naming_the_fix(mode):
    # Measured (spec.md "cache", rule table): every cache makes fullgraph=true fail at the first call.
    with pytest.raises(ScriptError, match="write 'compile fullgraph=false'"):
        transformdsl.plan(models.tiny_flux(), f"cache {mode}\ncompile fullgraph=true")
    with pytest.raises(ScriptError, match="'compile regional fullgraph=true' fails"):
        transformdsl.plan(models.tiny_flux(), f"cache {mode}\ncompile regional in transformer_blocks.* fullgraph=true")
    transformdsl.plan(models.tiny_flux(), f"cache {mode}\ncompile fullgraph=false")  # the fix plans


def test_cache_with_regional_compile_matches_the_cache_alone():
    alone, compiled = models.tiny_flux(), models.tiny_flux()
    transformdsl.transform(alone, "cache first_block threshold=0.2")
    transformdsl.transform(compiled, "cache first_block threshold=0.2\n"
                                     "compile regional in transformer_blocks.*, single_transformer_blocks.*")
    assert torch.allclose(flux_loop(compiled), flux_loop(alone), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("other", ["fuse qkv", "quantize int8 weight_only=true", "fp8 storage"])
def test_cache_with_structural_transforms_wraps_their_modules(other):
    """Measured (spec.md rule table): every quantization, fp8 mode and fuse qkv runs with a cache; the
    cache wraps the blocks holding the replaced layers.  Here: the same outputs as the other statement's
    model with the cache enabled by hand afterwards."""
    ours, hand = models.tiny_flux(), models.tiny_flux()
    transformdsl.transform(ours, f"{other}\ncache first_block threshold=0.2")
    transformdsl.transform(hand, other)
    hand.enable_cache(diffusers_hooks.FirstBlockCacheConfig(threshold=0.2))
    assert torch.equal(flux_loop(ours), flux_loop(hand))


def test_text_kv_allows_fullgraph_compile():
    # Measured: NucleusMoEImage with text_kv compiles with fullgraph=true, whole and regional.
    model, _ = corpus.build(corpus.entry("diffusers/NucleusMoEImageTransformer2DModel"))
    transformdsl.plan(model, "cache text_kv\ncompile fullgraph=true")


def test_options_left_none_reload(tmp_path):
    model = models.tiny_flux()
    transformdsl.transform(model, "cache pyramid_broadcast cross_attention_block_skip_range=none")
    transformdsl.save(model, tmp_path / "m")
    loaded = transformdsl.load(tmp_path / "m")
    assert loaded.is_cache_enabled and loaded._cache_config.cross_attention_block_skip_range is None
    assert loaded._cache_config.spatial_attention_block_skip_range == 2  # diffusers' fallback when all are none


@pytest.mark.parametrize("field, value, expected", [
    ("options", {"threshold": 0.9}, "record options .* disagree with its options"),
    ("targets", ["transformer_blocks.7"], "names module 'transformer_blocks.7', which the loaded model does not have"),
], ids=["options", "targets"])
def test_an_edited_cache_record_is_refused_on_load(tmp_path, field, value, expected):
    """The cache enabled on load is the saved statement's, checked: the record alone chooses nothing."""
    from transformdsl.errors import LoadError

    model = models.tiny_flux()
    transformdsl.transform(model, "cache first_block threshold=0.2")
    transformdsl.save(model, tmp_path / "m")
    edit_meta(tmp_path / "m", ("steps", 0, "record", field), value)
    with pytest.raises(LoadError, match=expected):
        transformdsl.load(tmp_path / "m")


@pytest.mark.parametrize("model_id, script, expected", [
    ("diffusers/Cosmos3OmniTransformer", "cache first_block",
     "reads each block's 'hidden_states' argument, and Cosmos3VLTextMoTDecoderLayer.forward takes und_seq"),
    ("diffusers/Flux2Transformer2DModel[Flux2Transformer]", "cache first_block",
     "subtracts the first block's output from the last block's, and here they differ: Flux2TransformerBlock "
     "(transformer_blocks.0) returns text and image states, Flux2SingleTransformerBlock"),
    ("diffusers/LatteTransformer3DModel", "cache first_block",
     "LatteTransformer3DModel.forward interleaves transformer_blocks and temporal_transformer_blocks"),
    ("diffusers/LatteTransformer3DModel", "cache mag mag_ratios=flux",
     "LatteTransformer3DModel.forward interleaves transformer_blocks and temporal_transformer_blocks"),
], ids=["blocks without hidden_states", "head and tail return differently", "interleaved lists", "mag, interleaved"])
def test_what_the_residual_caches_assume_of_the_blocks_is_checked_at_plan_time(model_id, script, expected):
    """Each of these failed deep inside diffusers' hooks at the first call (the support matrix's crashes)."""
    model, _ = corpus.build(corpus.entry(model_id))
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(model, script)
    assert expected in str(info.value)


def _wan_call(model, inputs, timestep):
    args, kwargs = inputs if isinstance(inputs, tuple) else ((), inputs)
    kwargs = dict(kwargs, timestep=torch.full_like(kwargs["timestep"], timestep))
    with torch.no_grad(), model.cache_context("cond"):
        return model(*args, **kwargs)


def test_faster_plan_says_what_each_call_must_give():
    text = str(transformdsl.plan(models.tiny_flux(), "cache faster"))
    assert "each call carries the unconditional and conditional batches concatenated" in text
    assert "first call must be at a timestep" not in text  # with CFG the first call computes (diffusers' rule)
    text = str(transformdsl.plan(models.tiny_flux(), "cache faster is_guidance_distilled=true"))
    assert "a denoising loop's first call must be at a timestep outside (-1, 681)" in text
    assert "batches concatenated" not in text


def test_faster_says_what_its_hooks_assume_of_a_call_before_they_fail_inside():
    """diffusers' FasterCache failed with IndexError / 'NoneType' object is not subscriptable / a permute
    error (24 corpus denoisers in the support matrix); the guard names the cause at the call."""
    from transformdsl.transforms.cache.guard import CacheContextError

    flux = models.tiny_flux()
    transformdsl.transform(flux, "cache faster")
    with pytest.raises(CacheContextError, match=r"splits the denoiser's output as BCFHW \(5 dimensions\), and this "
                                                r"call's hidden_states have 3 .*write is_guidance_distilled=true"):
        flux_loop(flux, steps=1)

    wan, inputs = corpus.build(corpus.entry("diffusers/WanTransformer3DModel"))
    transformdsl.transform(wan, "cache faster is_guidance_distilled=true")
    with pytest.raises(CacheContextError, match=r"the first call of a denoising loop \(after a reset\) must compute "
                                                r"attention.*\(-1, 681\); this call's timestep is 44"):
        _wan_call(wan, inputs, 44)
    wan._reset_stateful_cache()
    for t in (999, 600, 500, 400):  # as a pipeline calls it: above the range first, then reusing within it
        _wan_call(wan, inputs, t)
    wan._reset_stateful_cache()
    with pytest.raises(CacheContextError, match="this call's timestep is 400"):  # a new loop starts the count again
        _wan_call(wan, inputs, 400)

    cfg, inputs = corpus.build(corpus.entry("diffusers/WanTransformer3DModel"))
    transformdsl.transform(cfg, "cache faster")
    with pytest.raises(CacheContextError, match="expects the unconditional and conditional batches concatenated .* "
                                                "an even batch; this call's is 1"):
        _wan_call(cfg, inputs, 999)
    # With the CFG batch a loop may start inside the reuse range (an img2img at low strength): diffusers'
    # hooks compute on the first call there, and the guard lets it through.
    args, kwargs = inputs if isinstance(inputs, tuple) else ((), inputs)
    doubled = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 1 else v
               for k, v in kwargs.items()}
    cfg._reset_stateful_cache()
    for t in (400, 300, 200, 100):
        _wan_call(cfg, (args, doubled), t)


def test_an_identifier_list_is_capped_since_its_quoted_commas_escape_the_selector_cap():
    """2,000 plain patterns in one quoted option planned for 9 s on the tiny Flux (each matched against every
    module); a quoted list's commas do not count toward the script's selector cap."""
    patterns = ",".join(f"blk{i}" for i in range(2000))
    assert "2000 regular expressions; the limit is 64" in plan_error(
        models.tiny_flux(), f'cache taylorseer cache_identifiers="{patterns}"')


@pytest.mark.parametrize("ratios", ["1e309,1", "nan,1", "1,0", "1,-0.5"])
def test_mag_ratios_must_be_positive_finite_numbers(ratios):
    assert "mag_ratios must be positive finite numbers" in plan_error(
        models.tiny_flux(), f'cache mag mag_ratios="{ratios}"')


def test_explain_shows_what_the_cache_wraps_and_what_a_step_skips():
    text = str(transformdsl.plan(models.tiny_flux(), "cache first_block threshold=0.2"))
    assert "wraps 3 blocks: transformer_blocks.0 runs every step and decides; single_transformer_blocks.* (2) " \
           "may be skipped" in text
    assert "per step: the first block always runs" in text
    text = str(transformdsl.plan(models.tiny_flux(), "cache pyramid_broadcast"))
    assert "wraps transformer_blocks.0.attn, single_transformer_blocks.*.attn (2) (3 module(s))" in text


def test_the_fullgraph_rule_holds_across_transform_calls():
    """A cache enabled by one transform() and `compile fullgraph=true` planned by a later one (or the
    other way round) would fail at the first call, as within one script: refused at plan time."""
    import transformdsl
    from transformdsl import models

    cached = transformdsl.transform(models.tiny_flux(), "cache first_block")
    with pytest.raises(transformdsl.ScriptError, match=r"already runs a step cache \('cache first_block'\).*"
                                                       r"write fullgraph=false"):
        transformdsl.plan(cached, "compile fullgraph=true backend=eager")
    assert transformdsl.plan(cached, "compile backend=eager").steps[0].targets == [""]
    compiled = transformdsl.transform(models.tiny_flux(), "compile fullgraph=true backend=eager")
    with pytest.raises(transformdsl.ScriptError, match=r"was compiled with 'compile fullgraph=true backend=eager'"):
        transformdsl.plan(compiled, "cache first_block")


def test_identifier_regexes_keep_their_backslashes_and_match_under_the_plans_budget():
    import transformdsl
    from transformdsl import models

    step = transformdsl.plan(models.tiny_flux(), r'cache taylorseer cache_identifiers="transformer_blocks\.\d+\.attn'
                                                 r'|single_transformer_blocks\.0\.attn"').steps[0]
    assert step.notes[0] == "wraps transformer_blocks.0.attn, single_transformer_blocks.0.attn (2 module(s))"


@pytest.mark.parametrize("script", ["cache mag mag_ratios=flux num_inference_steps=1000000000",
                                    "cache taylorseer cache_interval=1000000000",
                                    "cache mag mag_ratios=\"" + ",".join(["1.0"] * 10_001) + "\""])
def test_a_step_count_past_any_sampler_is_a_script_error_before_anything_is_allocated(script):
    """mag interpolates its ratios to num_inference_steps points: 1e9 allocated 4 GB at plan time (issue 36)."""
    from transformdsl import ScriptError

    with pytest.raises(ScriptError, match="10000"):
        transformdsl.plan(models.tiny_flux(), script)


def test_a_saved_step_count_past_the_bound_is_refused_on_load(tmp_path):
    from transformdsl.errors import LoadError

    model = models.tiny_flux()
    transformdsl.transform(model, "cache mag mag_ratios=flux num_inference_steps=28")
    transformdsl.save(model, tmp_path / "m")
    edit_meta(tmp_path / "m", ("steps", 0, "options", "num_inference_steps"), 1_000_000_000)
    with pytest.raises(LoadError, match="num_inference_steps"):
        transformdsl.load(tmp_path / "m")


def test_slow_identifiers_in_a_saved_record_are_refused_within_the_regex_budget(tmp_path):
    """64 identifiers that backtrack made load() take 59 s before refusing (issue 36): the load's matching
    shares the plan's 0.5 s budget, and diffusers (Python's re, unbounded) only ever gets literal names."""
    import time

    from transformdsl.errors import LoadError

    model = models.tiny_flux()
    transformdsl.transform(model, 'cache taylorseer cache_identifiers="transformer_blocks\\.\\d+\\.attn"')
    transformdsl.save(model, tmp_path / "m")
    slow = ",".join([r"^(\w|\w\w|\w\w\w)+$"] * 64)
    edit_meta(tmp_path / "m", ("steps", 0, "options", "cache_identifiers"), slow)
    edit_meta(tmp_path / "m", ("steps", 0, "record", "options", "cache_identifiers"), slow)
    started = time.process_time()
    with pytest.raises(LoadError, match="takes too long"):
        transformdsl.load(tmp_path / "m")
    assert time.process_time() - started < 5


def test_diffusers_gets_the_names_the_identifiers_matched_not_the_patterns():
    model = models.tiny_flux()
    transformdsl.transform(model, 'cache taylorseer cache_identifiers="transformer_blocks\\.\\d+\\.attn"')
    config = model._cache_config
    assert config.cache_identifiers == [r"^(?:transformer_blocks\.0\.attn)$"]
