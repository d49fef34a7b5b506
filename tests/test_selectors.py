"""Selectors on real module trees (spec.md "Selectors").

Each row of the spec's table is checked on the built-in tiny models, with the expected modules
computed independently from ``named_modules()`` (class checks with ``isinstance``, path checks
with plain string operations), never with the selector code under test.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import transformdsl
from transformdsl.errors import ScriptError
from transformdsl.models import BUILTIN
from transformdsl.parser import make_selector
from transformdsl.selectors import select, topmost
from transformdsl.tree import ModuleTree


@functools.cache
def tiny(name: str):
    """A built-in model, built once per test module (selection and planning never change it)."""
    return BUILTIN[name]()


def component(name: str) -> nn.Module:
    """A built-in model, or ``sd-pipeline/<component>``."""
    if "/" in name:
        pipe, part = name.split("/")
        return tiny(pipe).components[part]
    return tiny(name)


def selected(selector_text: str, model: nn.Module) -> list[str]:
    return select(make_selector(selector_text), ModuleTree.of(model))


def paths_where(model: nn.Module, predicate) -> list[str]:
    """Paths (in ``named_modules()`` order, root excluded) of the modules for which ``predicate(path, module)``."""
    return [path for path, module in model.named_modules() if path and predicate(path, module)]


def last(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def below(path: str, roots) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


# --------------------------------------------------------------------------- capitalised globs: classes


@pytest.mark.parametrize("model, selector, cls", [
    ("flux", "Linear", nn.Linear),
    ("unet", "Conv?d", nn.Conv2d),
    ("unet", "Conv2d", nn.Conv2d),
    ("unet", "GroupNorm", nn.GroupNorm),
    ("gpt2", "Conv1D", "transformers.pytorch_utils.Conv1D"),
    ("llama", "Embedding", nn.Embedding),
    # Base classes: `_ConvNd` covers Conv2d, `GradientCheckpointingLayer` the decoder layers.
    ("unet", "_ConvNd", torch.nn.modules.conv._ConvNd),
    ("llama", "GradientCheckpointingLayer", "transformers.modeling_layers.GradientCheckpointingLayer"),
    ("gpt2", "GradientCheckpointingLayer", "transformers.modeling_layers.GradientCheckpointingLayer"),
    ("llama", "LlamaPreTrainedModel", "transformers.models.llama.modeling_llama.LlamaPreTrainedModel"),
])
def test_class_glob_matches_class_and_base_classes(model, selector, cls):
    if isinstance(cls, str):
        module_name, _, name = cls.rpartition(".")
        cls = getattr(__import__(module_name, fromlist=[name]), name)
    m = component(model)
    expected = [p for p, mod in m.named_modules() if isinstance(mod, cls)]
    assert expected
    assert selected(selector, m) == expected


@pytest.mark.parametrize("model, selector, names", [
    ("flux", "*Attention", {"FluxAttention"}),
    ("unet", "*Attention", {"Attention"}),
    ("sd3", "*Attention", {"Attention"}),
    ("llama", "*Attention", {"LlamaAttention"}),
    ("flux", "*TransformerBlock", {"FluxTransformerBlock", "FluxSingleTransformerBlock"}),
    ("flux", "Flux*Block", {"FluxTransformerBlock", "FluxSingleTransformerBlock"}),
    ("sd3", "AdaLayerNorm*", {"AdaLayerNormZero", "AdaLayerNormContinuous"}),
    ("sd-pipeline/text_encoder", "CLIP*Layer", {"CLIPEncoderLayer"}),
])
def test_class_glob_is_fnmatch_on_class_names(model, selector, names):
    m = component(model)
    assert selected(selector, m) == paths_where(m, lambda p, mod: type(mod).__name__ in names)


def test_class_glob_is_case_sensitive():
    assert selected("LINEAR", tiny("flux")) == []
    assert selected("*linear", tiny("flux")) == paths_where(tiny("flux"), lambda p, mod: last(p).endswith("linear"))


def test_subclass_of_linear_is_matched_by_linear():
    class ScaledLinear(nn.Linear):
        pass

    model = BUILTIN["flux"]()
    old = model.proj_out
    model.proj_out = ScaledLinear(old.in_features, old.out_features)
    linears = selected("Linear", model)
    assert "proj_out" in linears
    assert linears == paths_where(model, lambda p, mod: isinstance(mod, nn.Linear))
    assert selected("ScaledLinear", model) == ["proj_out"]


def test_class_glob_matches_mixin_base_classes():
    flux = tiny("flux")
    assert selected("AttentionModuleMixin", flux) == selected("FluxAttention", flux)


# --------------------------------------------------------------------------- dotted globs: paths


@pytest.mark.parametrize("model, selector, predicate", [
    # `*` stays within one segment: the double-stream blocks, not the single-stream ones.
    ("flux", "transformer_blocks.*", lambda p: p.count(".") == 1 and p.startswith("transformer_blocks.")),
    ("flux", "transformer_blocks.*.attn", lambda p: p == "transformer_blocks.0.attn"),
    ("flux", "single_transformer_blocks.*.attn.to_?",
     lambda p: p.startswith("single_transformer_blocks.") and p.split(".")[-2:-1] == ["attn"]
     and last(p) in ("to_q", "to_k", "to_v")),
    # `**` spans any number of segments, zero included.
    ("unet", "down_blocks.**", lambda p: p == "down_blocks" or p.startswith("down_blocks.")),
    ("unet", "**.attn2", lambda p: last(p) == "attn2"),
    ("unet", "**.attn2.**", lambda p: ".attn2" in "." + p and "attn2" in p.split(".")),
    ("unet", "up_blocks.**.proj_in", lambda p: p.startswith("up_blocks.") and last(p) == "proj_in"),
    # `[0-3]` is a class of characters; `?` one character.
    ("flux", "single_transformer_blocks.[1-9]", lambda p: p == "single_transformer_blocks.1"),
    ("flux", "single_transformer_blocks.[!1]", lambda p: p == "single_transformer_blocks.0"),
    ("llama", "model.layers.?.mlp", lambda p: p in ("model.layers.0.mlp", "model.layers.1.mlp")),
    ("gpt2", "transformer.h.0", lambda p: p == "transformer.h.0"),
])
def test_dotted_glob_matches_paths_segment_by_segment(model, selector, predicate):
    m = component(model)
    expected = paths_where(m, lambda p, mod: predicate(p))
    assert expected
    assert selected(selector, m) == expected


def test_dotted_glob_is_anchored_at_the_root():
    # `attn.to_q` is a path from the root: it does not name `transformer_blocks.0.attn.to_q`.
    assert selected("attn.to_q", tiny("flux")) == []
    assert selected("**.attn.to_q", tiny("flux")) == [
        "transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_q",
        "single_transformer_blocks.1.attn.to_q"]


# --------------------------------------------------------------------------- plain lowercase words

NORM_CLASSES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def norm_class(module: nn.Module) -> bool:
    """Normalisation layers, by class, without looking at names."""
    from diffusers.models.normalization import (
        AdaLayerNormContinuous,
        AdaLayerNormZero,
        AdaLayerNormZeroSingle,
        RMSNorm,
    )
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return isinstance(module, (*NORM_CLASSES, AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous,
                               RMSNorm, LlamaRMSNorm))


def norm_roots(model: nn.Module) -> list[str]:
    """The topmost normalisation layers (their subtrees are part of them)."""
    roots: list[str] = []
    for path, module in model.named_modules():
        if path and norm_class(module) and not below(path, roots):
            roots.append(path)
    return roots


@pytest.mark.parametrize("model", ["flux", "sd3", "unet", "llama", "gpt2", "sd-pipeline/text_encoder",
                                   "sd-pipeline/vae"])
def test_word_norm_names_exactly_the_normalisation_layers(model):
    m = component(model)
    assert topmost(selected("norm", m)) == norm_roots(m)


@pytest.mark.parametrize("model, path", [
    ("flux", "transformer_blocks.0.norm1"),
    ("flux", "transformer_blocks.0.norm1_context"),
    ("flux", "transformer_blocks.0.norm2_context"),
    ("flux", "transformer_blocks.0.attn.norm_q"),
    ("flux", "transformer_blocks.0.attn.norm_added_k"),
    ("flux", "single_transformer_blocks.0.norm"),
    ("flux", "norm_out"),
    ("unet", "conv_norm_out"),
    ("llama", "model.layers.0.input_layernorm"),  # class LlamaRMSNorm has the token Norm
    ("gpt2", "transformer.h.0.ln_1"),  # class LayerNorm has the token Norm
])
def test_word_norm_names(model, path):
    assert path in selected("norm", component(model))


def test_word_tokens_are_whole():
    model = nn.Module()
    for name in ("normalizer", "enorm", "norms", "layer_norm", "norm3", "nor"):
        model.add_module(name, nn.Linear(2, 2))
    model.add_module("pre", nn.LayerNorm(2))
    assert selected("norm", model) == ["layer_norm", "norm3", "pre"]


@pytest.mark.parametrize("model, word, predicate", [
    ("unet", "attn2", lambda p, mod: last(p) == "attn2"),
    ("flux", "attn", lambda p, mod: last(p) == "attn"),
    # Tokens split at digits: `attn` names attn1 and attn2; and the class token Attn names the UNet's
    # CrossAttnDownBlock2D, UNetMidBlock2DCrossAttn and CrossAttnUpBlock2D.
    ("unet", "attn", lambda p, mod: last(p) in ("attn1", "attn2") or "CrossAttn" in type(mod).__name__),
    ("flux", "pos_embed", lambda p, mod: p == "pos_embed"),
    ("llama", "lm_head", lambda p, mod: p == "lm_head"),
    ("flux", "proj_out", lambda p, mod: last(p) == "proj_out"),
    ("sd3", "context", lambda p, mod: "context" in last(p).split("_")),
    # A class-name token names the module too: FluxAttention has the token Attention; the
    # `attentions` lists of the UNet do not (tokens are whole).
    ("flux", "attention", lambda p, mod: type(mod).__name__ == "FluxAttention"),
    ("unet", "attention", lambda p, mod: type(mod).__name__ == "Attention"),
])
def test_word(model, word, predicate):
    m = component(model)
    expected = paths_where(m, predicate)
    assert expected
    assert selected(word, m) == expected


# --------------------------------------------------------------------------- lowercase globs, re:


@pytest.mark.parametrize("model, selector, predicate", [
    ("flux", "to_?", lambda p: last(p) in ("to_q", "to_k", "to_v")),
    ("flux", "*norm*", lambda p: "norm" in last(p)),
    ("llama", "*_proj", lambda p: last(p).endswith("_proj")),
    ("unet", "attn[12]", lambda p: last(p) in ("attn1", "attn2")),
])
def test_lowercase_glob_matches_the_last_segment(model, selector, predicate):
    m = component(model)
    expected = paths_where(m, lambda p, mod: predicate(p))
    assert expected
    assert selected(selector, m) == expected


@pytest.mark.parametrize("model, selector, predicate", [
    ("flux", "re:^proj_out$", lambda p: p == "proj_out"),
    ("flux", "re:.*norm.*", lambda p: "norm" in p),
    ("flux", r"re:blocks\.0\.attn$", lambda p: p.endswith("blocks.0.attn")),
    ('llama', 're:"layers\\.[01]\\.(self_attn|mlp)$"', lambda p: p.split(".")[-1] in ("self_attn", "mlp")),
])
def test_regex_searches_the_path(model, selector, predicate):
    m = component(model)
    expected = paths_where(m, lambda p, mod: predicate(p))
    assert expected
    assert selected(selector, m) == expected


# --------------------------------------------------------------------------- the spec's Flux examples


def plan_one(model, text):
    (step,) = transformdsl.plan(model, text).steps
    return step


def test_flux_except_norm_removes_every_normalisation_layer_and_nothing_else():
    flux = tiny("flux")
    linears = paths_where(flux, lambda p, mod: isinstance(mod, nn.Linear))
    in_norms = [p for p in linears if below(p, norm_roots(flux))]
    assert in_norms == ["transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
                        "single_transformer_blocks.0.norm.linear", "single_transformer_blocks.1.norm.linear",
                        "norm_out.linear"]

    step = plan_one(flux, "fp8 storage except norm default_except=false")
    assert step.targets == [p for p in linears if p not in in_norms]
    assert step.excluded == {"except norm": len(in_norms)}


def test_flux_in_transformer_blocks_scopes_to_the_double_stream_blocks():
    flux = tiny("flux")
    step = plan_one(flux, "fp8 storage in transformer_blocks.* default_except=false")
    assert step.targets == paths_where(
        flux, lambda p, mod: p.startswith("transformer_blocks.0.") and isinstance(mod, nn.Linear))


def test_flux_regex_proj_out_names_only_the_top_level_one():
    assert selected("re:^proj_out$", tiny("flux")) == ["proj_out"]
    assert selected("proj_out", tiny("flux")) == [
        "single_transformer_blocks.0.proj_out", "single_transformer_blocks.1.proj_out", "proj_out"]


# --------------------------------------------------------------------------- scope, targets, exclusions


def test_targets_name_modules_not_subtrees():
    step = plan_one(tiny("flux"), "fp8 storage Linear in transformer_blocks.0.attn default_except=false")
    assert step.targets == [f"transformer_blocks.0.attn.{n}" for n in (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")]


def test_exclusion_drops_targets_at_or_below_it_and_counts_per_selector():
    step = plan_one(tiny("flux"), "fp8 storage in transformer_blocks.* except attn, to_out, ff default_except=false")
    # to_out.0 is below attn: counted there; the word `ff` names ff and ff_context.
    assert step.excluded == {"except attn": 8, "except ff": 4}
    assert all(".attn." not in p and ".ff." not in p for p in step.targets)


def test_default_exclusions_are_counted_apart():
    step = plan_one(tiny("flux"), "fp8 storage except attn")
    # The statement's own exclusions are counted first: attn has 8 + 3 + 3 Linear layers; then
    # fp8's defaults (diffusers' layerwise-casting skips), each under its own label.
    assert step.excluded == {"except attn": 14, "default: norm": 5, "default: re:^proj_out$": 1}


def test_scope_without_targets_takes_the_topmost_modules_for_compile():
    step = plan_one(tiny("flux"), "compile regional in single_transformer_blocks.1, transformer_blocks.0.attn, "
                                  "*TransformerBlock")
    selected = step.targets + [path for path, _ in step.skipped]
    assert sorted(selected) == ["single_transformer_blocks.0", "single_transformer_blocks.1", "transformer_blocks.0"]
    assert plan_one(tiny("flux"), "compile").targets == [""]


# --------------------------------------------------------------------------- matching nothing


@pytest.mark.parametrize("model, text, column, nearest", [
    ("flux", "quantize int8 except nrm", 22, "norm"),
    ("unet", "fuse qkv in *Atention", 13, "Attention"),
    ("flux", "fp8 native Linear in transformer_block.*", 22, "transformer_blocks.0"),
    ("llama", "quantize int8 except lm_haed", 22, "lm_head"),
])
def test_selector_matching_nothing_is_an_error_with_the_nearest_names(model, text, column, nearest):
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(component(model), text)
    (problem,) = info.value.problems
    selector = text[column - 1:].split()[0]
    assert problem.message == f"selector '{selector}' matches no module"
    assert (problem.span.line, problem.span.column) == (1, column)
    assert problem.hint.startswith("nearest names: ") and nearest in problem.hint.split(": ")[1].split(", ")


def test_target_outside_the_scope_says_so():
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(tiny("flux"), "fp8 native Linear in pos_embed")
    (problem,) = info.value.problems
    assert problem.message == "selector 'Linear' matches no module in the scope ('in pos_embed')"
    assert problem.hint == "it matches time_text_embed.timestep_embedder.linear_1 (and 33 more), outside the scope"


def test_every_selector_matching_nothing_is_reported():
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(tiny("flux"), "quantize int8 except nrm\nfuse qkv in *Atention")
    assert [(p.span.line, p.span.column) for p in info.value.problems] == [(1, 22), (2, 13)]


def test_default_targets_and_exclusions_matching_nothing_are_not_errors():
    # GPT-2 has no `proj_out` and no `embedding` named module: the defaults of quantize still plan.
    step = plan_one(tiny("gpt2"), "quantize int8")
    assert step.targets


# --------------------------------------------------------------------------- GPT-2's Conv1D


def test_quantize_default_target_includes_gpt2_conv1d():
    gpt2 = tiny("gpt2")
    conv1d = paths_where(gpt2, lambda p, mod: type(mod).__name__ == "Conv1D")
    assert len(conv1d) == 8
    step = plan_one(gpt2, "quantize int8")
    assert step.targets == conv1d  # lm_head (Linear) is a default exclusion
    assert step.excluded == {"default: lm_head": 1}


def test_fp8_native_linear_on_gpt2_does_not_skip_conv1d_silently():
    gpt2 = tiny("gpt2")
    step = plan_one(gpt2, "fp8 native Linear default_except=false")
    conv1d = paths_where(gpt2, lambda p, mod: type(mod).__name__ == "Conv1D")
    mentioned = set(step.targets) | {path for path, _ in step.skipped}
    assert set(conv1d) <= mentioned or any("Conv1D" in note for note in step.notes)


def test_patterns_that_cannot_repeat_run_without_the_timeout_and_spend_no_budget():
    """``^proj_out$`` (diffusers' skip patterns) has one way to match at each position: it matches
    the same, outside the time budget; a pattern that repeats or branches still spends it and fails
    once it is gone (alternation alone backtracks exponentially: ``(\\w|.)`` repeated)."""
    from transformdsl.regexes import SelectorTooSlow, compile_regex, regex_budget, search

    paths = ["proj_out", "x.proj_out", "proj_out.0", "norm_out.linear"]
    for pattern in ("^proj_out$", r"\.linear$", "[pn]orm", "(out)$"):
        compiled = compile_regex(pattern)
        with regex_budget(0.0):
            assert [search(compiled, p) for p in paths] == [compiled.search(p) is not None for p in paths]
    for pattern in ("proj_(in|out)", "[pn]or?m", "x{2}", r"(\w|.)" * 16 + r"(\.|\.)(\.|\.)"):
        with regex_budget(0.0), pytest.raises(SelectorTooSlow):
            search(compile_regex(pattern), paths[0])
