"""``fuse qkv`` on the built-in tiny models (real diffusers / transformers classes, random weights)."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from torch import nn

import transformdsl
from transformdsl import models
from transformdsl.errors import LoadError, TransformError
from transformdsl.history import history_of
from transformdsl.models import run
from transformdsl.planner import plan
from transformdsl.transforms.qkv import analysis, fusion
from transformdsl.transforms.qkv import install as qkv_install
from transformdsl.transforms.qkv.shared_projection import ProjectionSlice
from transformdsl.tree import ModuleTree, parameter_bytes

ARCHS = ["unet", "sd3", "flux", "llama"]
DIFFUSERS = ["unet", "sd3", "flux"]
#: First transformer block of the tiny UNet: 32 channels, text states 32 wide too.
ATTN1 = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
ATTN2 = "down_blocks.0.attentions.0.transformer_blocks.0.attn2"


def build(arch: str) -> nn.Module:
    return models.BUILTIN[arch]()


def fuse(model, script: str = "fuse qkv"):
    """``transformdsl.transform``; returns (the planned step, the record ``apply`` returned)."""
    step = plan(model, script).steps[0]
    transformdsl.transform(model, script)
    return step, history_of(model).steps[0].record


def structure(model: nn.Module) -> list:
    """What rollback and reload must reproduce besides tensors: module types, processors, flags."""
    return [(name, type(m), type(getattr(m, "processor", None)), m.__dict__.get("fused_projections"),
             m.__dict__.get("qkv_split")) for name, m in model.named_modules()]


def attention_paths(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------- outputs, bytes, layout


#: arch → attention name → (attributes that must be plain Linears, attributes that must be gone)
EXPECTED = {
    "unet": {"attn1": (["to_qkv"], ["to_q", "to_k", "to_v"]), "attn2": (["to_q", "to_kv"], ["to_k", "to_v"])},
    "sd3": {"attn": (["to_qkv", "to_added_qkv"], ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"])},
    "flux": {"attn": (["to_qkv"], ["to_q", "to_k", "to_v"])},
    "llama": {"self_attn": (["qkv_proj"], ["q_proj", "k_proj", "v_proj"])},
}


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_outputs_match_and_bytes_do_not_grow(arch):
    model = build(arch)
    before, bytes_before = run(model), parameter_bytes(model)
    step, record = fuse(model)
    assert step.targets == attention_paths(model) and not step.skipped
    assert [m["path"] for m in record["modules"]] == step.targets
    assert max_diff(run(model), before) <= 1e-5
    assert parameter_bytes(model) == bytes_before        # old projections deleted, not kept beside
    for path in step.targets:
        attention = model.get_submodule(path)
        present, gone = EXPECTED[arch][path.rsplit(".", 1)[-1]]
        assert all(type(getattr(attention, n)) is nn.Linear for n in present)
        assert not any(hasattr(attention, n) for n in gone)


def test_flux_double_and_single_blocks():
    model = build("flux")
    fuse(model)
    double, single = model.transformer_blocks[0].attn, model.single_transformer_blocks[0].attn
    assert double.fused_projections and single.fused_projections   # FluxAttnProcessor's fused path
    assert double.to_added_qkv.weight.shape == (48, 16) and not hasattr(single, "to_added_qkv")
    assert single.pre_only and not hasattr(single, "to_out")


def test_sd3_last_block_is_context_pre_only():
    model = build("sd3")
    fuse(model)
    last = model.transformer_blocks[-1].attn
    assert last.context_pre_only and last.to_add_out is None and last.to_added_qkv.weight.shape == (96, 32)
    assert type(last.processor).__name__ == "FusedJointAttnProcessor2_0"


def test_llama_grouped_query_attention_and_cache():
    model = build("llama")
    reference = copy.deepcopy(model)
    fuse(model)
    attention = model.model.layers[0].self_attn
    assert attention.qkv_split == (64, 32, 32) and attention.qkv_proj.weight.shape == (128, 64)
    assert isinstance(attention, type(reference.model.layers[0].self_attn))   # still a LlamaAttention
    # Prefill, then decoding through the key/value cache.
    (ids,), _ = models.sample_inputs(model)
    kwargs = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    got, expected = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert max(max_diff(a, b) for a, b in zip(got.logits, expected.logits)) <= 1e-5


def test_llama_eager_attention():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**models.LLAMA_CONFIG, attn_implementation="eager")).eval()
    before = run(model)
    fuse(model)
    assert max_diff(run(model), before) <= 1e-5


def test_fused_llama_pickles():
    model = build("llama")
    fuse(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.equal(run(torch.load(buffer, weights_only=False)), run(model))


@pytest.mark.parametrize("arch", DIFFUSERS)
def test_matches_diffusers_fuse_qkv_projections(arch):
    model = build(arch)
    theirs = copy.deepcopy(model)
    theirs.fuse_qkv_projections()
    fuse(model)
    assert max_diff(run(model), run(theirs)) <= 1e-5
    # The same fused tensors under the same names; diffusers also keeps the old projections.
    ours_state, theirs_state = model.state_dict(), theirs.state_dict()
    assert all(torch.equal(t, theirs_state[k]) for k, t in ours_state.items())
    assert parameter_bytes(model) < parameter_bytes(theirs)


def test_pipeline_unet_and_vae(tmp_path):
    pipe = models.tiny_sd_pipeline()
    before = run(pipe)
    # The VAE's mid-block attention (group norm, residual connection, rescaling) is an Attention too.
    transformdsl.transform(pipe, "fuse qkv\nfuse qkv component=vae")
    vae_attention = pipe.vae.decoder.mid_block.attentions[0]
    assert hasattr(vae_attention, "to_qkv") and not hasattr(vae_attention, "to_q")
    after = run(pipe)
    assert max_diff(after, before) <= 1e-5
    transformdsl.save(pipe, tmp_path / "pipe")
    assert torch.equal(run(transformdsl.load(tmp_path / "pipe")), after)


# --------------------------------------------------------------------------- cross-attention


def test_cross_attention_kv_and_skip():
    kv, skip = build("unet"), build("unet")
    before = run(kv)
    step_kv, _ = fuse(kv, "fuse qkv cross=kv")
    step_skip, _ = fuse(skip, "fuse qkv cross=skip")
    cross = [p for p in attention_paths(kv) if p.endswith("attn2")]
    assert set(cross) <= set(step_kv.targets) and not set(cross) & set(step_skip.targets)
    assert sorted(p for p, _ in step_skip.skipped) == sorted(cross)
    assert {r for _, r in step_skip.skipped} == {analysis.CROSS_SKIPPED}
    for model in (kv, skip):
        assert max_diff(run(model), before) <= 1e-5
    fused, left = kv.get_submodule(ATTN2), skip.get_submodule(ATTN2)
    # Here text and hidden states are both 32 wide, so shapes alone would allow a to_qkv; but k/v
    # read the encoder states: diffusers built this module as cross-attention, q stays apart.
    assert fused.to_kv.in_features == fused.to_q.in_features == 32
    assert all(hasattr(left, n) for n in ("to_q", "to_k", "to_v")) and not hasattr(left, "to_kv")
    assert type(left.processor).__name__ == "AttnProcessor2_0"


# --------------------------------------------------------------------------- near misses


def test_gpt2_is_a_near_miss():
    p = plan(build("gpt2"), "fuse qkv")
    step = p.steps[0]
    assert step.targets == [] and [path for path, _ in step.skipped] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert {r for _, r in step.skipped} == {"already fused: c_attn (Conv1D) projects q, k and v together"}
    assert "already fused: c_attn (Conv1D)" in str(p)


def test_near_miss_reasons():
    llama = build("llama")
    llama.model.layers[0].self_attn.k_proj = nn.Linear(24, 32, bias=False)     # reads another input
    llama.model.layers[1].self_attn.v_proj = nn.Sequential(nn.Linear(64, 32))   # not a plain Linear
    reasons = dict(plan(llama, "fuse qkv").steps[0].skipped)
    assert reasons["model.layers.0.self_attn"] == "projections read different inputs: v_proj has in_features 64, k_proj 24"
    assert reasons["model.layers.1.self_attn"] == ("v_proj is a Sequential, not a plain nn.Linear (in one script fuse qkv "
                                                      "runs before the statements that replace layers: put them in one "
                                                      "script, or fuse first)")

    unet = build("unet")
    unet.fuse_qkv_projections()          # diffusers' own: to_qkv / to_kv beside to_q, to_k, to_v
    assert {r.split(" (")[0] for _, r in plan(unet, "fuse qkv").steps[0].skipped} == \
        {"already fused: to_qkv", "already fused: to_kv"}


def test_a_second_statement_finds_the_modules_fused():
    step = plan(build("flux"), "fuse qkv\nfuse qkv in single_transformer_blocks").steps[1]
    assert not step.targets and {r for _, r in step.skipped} == {"already fused by an earlier statement"}


def test_a_llama_forward_of_another_version_shares_the_fused_projection(monkeypatch):
    monkeypatch.setattr(analysis, "LLAMA_FORWARD_FINGERPRINT", "0" * 16)
    model = build("llama")
    before = run(model)
    step, record = fuse(model)
    assert len(step.targets) == 2 and {m["forward"] for m in record["modules"]} == {"shared"}
    attention = model.model.layers[0].self_attn
    assert type(attention).__name__ == "LlamaAttention" and isinstance(attention.q_proj, ProjectionSlice)
    assert max_diff(run(model), before) <= 1e-5


# --------------------------------------------------------------------------- planning


def test_plan_effect_lets_quantize_target_the_fused_projection():
    model = build("unet")
    targets = plan(model, "fuse qkv; quantize int8").steps[1].targets
    assert {f"{ATTN1}.to_qkv", f"{ATTN2}.to_kv", f"{ATTN2}.to_q"} <= set(targets)
    assert not any(t.endswith((".to_k", ".to_v")) or t == f"{ATTN1}.to_q" for t in targets)
    # The snapshot after plan_effect is the tree apply produces, with the fused Linear's facts.
    tree = ModuleTree.of(model)
    step = plan(model, "fuse qkv").steps[0]
    step.transform.plan_effect(tree, step.targets)
    info = tree[f"{ATTN1}.to_qkv"]
    assert info.cls is nn.Linear and info.facts["weight_shape"] == (96, 32)
    assert (info.facts["in_features"], info.facts["out_features"]) == (32, 96)
    fuse(model)
    assert [i.path for i in tree] == [n for n, _ in model.named_modules()]
    assert info.own_bytes == parameter_bytes(model.get_submodule(f"{ATTN1}.to_qkv"))


# --------------------------------------------------------------------------- persistence


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_is_bit_equal(arch, tmp_path):
    model = build(arch)
    fuse(model)
    transformdsl.save(model, tmp_path / "saved")
    # load() builds the architecture on the meta device from the saved config, QKVFusion.rebuild
    # replays the record, then the saved tensors are assigned as they are.
    reloaded = transformdsl.load(tmp_path / "saved")
    assert structure(reloaded) == structure(model)
    assert torch.equal(run(reloaded), run(model))


def test_rebuild_on_a_meta_skeleton_computes_nothing():
    model = build("unet")
    step, record = fuse(model)
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        skeleton = UNet2DConditionModel(**models.UNET_CONFIG).eval()
    fusion.QKVFusion.rebuild(skeleton, json.loads(json.dumps(record)), step.transform.options)
    assert structure(skeleton) == structure(model)
    assert skeleton.state_dict().keys() == model.state_dict().keys()
    assert all(t.is_meta for t in skeleton.state_dict().values())


def edit_record(directory, change) -> None:
    meta_path = directory / "transformdsl.json"
    meta = json.loads(meta_path.read_text())
    change(meta["steps"][0]["record"]["modules"][0])
    meta_path.write_text(json.dumps(meta))


def test_load_refuses_what_it_cannot_replay_exactly(tmp_path, monkeypatch):
    model = build("llama")
    fuse(model)
    for name in ("splits", "sources", "version"):
        transformdsl.save(model, tmp_path / name)
    # A record that does not fit the architecture (as if saved from another model).
    edit_record(tmp_path / "splits", lambda entry: entry["groups"][0].update(splits=[64, 64, 64]))
    with pytest.raises(LoadError, match=r"layers\.0\.self_attn was saved as qkv_proj = q_proj\+k_proj\+v_proj "
                                         r"\(64\+64\+64 x 64\) through the fused Llama forward, but fuses as "
                                         r".* \(64\+32\+32 x 64\)"):
        transformdsl.load(tmp_path / "splits")
    # A record naming projections this pass never fuses.
    edit_record(tmp_path / "sources", lambda entry: entry["groups"][0].update(sources=["q_proj", "o_proj"]))
    with pytest.raises(LoadError, match="malformed record entry"):
        transformdsl.load(tmp_path / "sources")
    # A transformers whose LlamaAttention.forward is not the one the fused forward mirrors.
    monkeypatch.setattr(analysis, "LLAMA_FORWARD_FINGERPRINT", "0" * 16)
    with pytest.raises(LoadError, match=r"was saved as .* through the fused Llama forward, but fuses as .* "
                                         r"through slices of the shared fused projection on this model"):
        transformdsl.load(tmp_path / "version")


# --------------------------------------------------------------------------- atomicity


#: Where each helper a failure is injected into is looked up when the transform calls it.
HELPER_HOME = {"concatenated": fusion, "_fused_processor": qkv_install}


def fail_on_call(monkeypatch, name: str, number: int) -> None:
    """Make the ``fuse qkv`` helper ``name`` raise on its ``number``-th call."""
    original = getattr(HELPER_HOME[name], name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(HELPER_HOME[name], name, failing)


@pytest.mark.parametrize("arch, helper", [(a, "concatenated") for a in ARCHS] + [("unet", "_fused_processor")])
def test_failure_midway_rolls_back_bit_identically(arch, helper, monkeypatch):
    model = build(arch)
    state = model.state_dict(keep_vars=True)
    shape, before = structure(model), run(model)
    step = plan(model, "fuse qkv").steps[0]
    # Fail in the second module, after the first was fused (Linears, processor, class, flags);
    # with _fused_processor, halfway through the second module (its Linears already swapped).
    first = analysis.analyse(model.get_submodule(step.targets[0]), step.transform.options)
    fail_on_call(monkeypatch, helper, len(first.groups) + 1 if helper == "concatenated" else 2)
    with pytest.raises(TransformError, match="injected failure; the model was left unchanged"):
        transformdsl.transform(model, "fuse qkv")
    assert structure(model) == shape
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(state) and all(after[k] is state[k] for k in state)   # the very same tensors
    assert torch.equal(run(model), before)
    assert history_of(model) is None


# --------------------------------------------------------------------------- the shared fused projection

#: Real transformers classes from tiny configs: (config class, model class, config, input kind).
TRANSFORMERS = {
    "mistral": ("MistralConfig", "MistralModel", dict(num_key_value_heads=2), "ids"),
    "gemma2": ("Gemma2Config", "Gemma2Model", dict(num_key_value_heads=2, head_dim=8), "ids"),
    "gptj": ("GPTJConfig", "GPTJModel", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4), "ids"),
    "opt": ("OPTConfig", "OPTModel", dict(ffn_dim=37, word_embed_proj_dim=32), "ids"),
    "bert": ("BertConfig", "BertModel", {}, "ids"),
    "t5-encoder": ("T5Config", "T5EncoderModel", dict(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4), "ids"),
    "clip-vision": ("CLIPVisionConfig", "CLIPVisionModel", dict(image_size=32, patch_size=8), "pixels"),
    "vit": ("ViTConfig", "ViTModel", dict(image_size=32, patch_size=8), "pixels"),
}
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=99,
             max_position_embeddings=64, pad_token_id=0)


def build_transformers(name: str):
    import transformers

    config_class, model_class, extra, kind = TRANSFORMERS[name]
    config = getattr(transformers, config_class)(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    generator = torch.Generator().manual_seed(1)
    if kind == "pixels":
        return model, {"pixel_values": torch.randn(2, 3, 32, 32, generator=generator)}
    return model, {"input_ids": torch.randint(1, 99, (2, 7), generator=generator)}


def hidden(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).last_hidden_state


def projection_owners(model: nn.Module) -> list[str]:
    """Modules with separate q/k/v projections of a :data:`analysis.PROJECTIONS` convention."""
    return [n for n, m in model.named_modules()
            if any(type(m._modules.get(r.k)) is nn.Linear and type(m._modules.get(r.v)) is nn.Linear
                   for r in analysis.PROJECTIONS)]


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_transformers_attention_shares_one_fused_projection(name, tmp_path):
    model, inputs = build_transformers(name)
    owners = projection_owners(model)
    before, bytes_before, keys_before = hidden(model, inputs), parameter_bytes(model), set(model.state_dict())
    step, record = fuse(model)
    assert owners and step.targets == owners
    assert {m["forward"] for m in record["modules"]} == {"shared"}
    after = hidden(model, inputs)
    assert max_diff(after, before) <= 1e-6 * before.abs().max().item()
    assert parameter_bytes(model) == bytes_before
    # The projections' weights are gone from the state_dict: one fused key per attention.
    keys = set(model.state_dict())
    gone, new = keys_before - keys, keys - keys_before
    assert gone and all(k.rsplit(".", 2)[-2] in {"q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value"}
                        for k in gone)
    assert {k.rsplit(".", 2)[-2] for k in new} <= {"qkv", "qkv_proj", "query_key_value"}
    transformdsl.save(model, tmp_path / "saved")
    reloaded = transformdsl.load(tmp_path / "saved")          # no model=: rebuilt on a meta skeleton
    assert torch.equal(hidden(reloaded, inputs), after)


def test_sd35_qk_norm_and_dual_attention_fuse():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**models.SD3_CONFIG, qk_norm="rms_norm", dual_attention_layers=(0,)).eval()
    before = run(model)
    step, record = fuse(model)
    assert step.targets == attention_paths(model) and not step.skipped
    block = model.transformer_blocks[0]
    # qk-norm: diffusers' FusedJointAttnProcessor2_0 would skip it; the processor is kept and
    # reads the slices.  The second (dual) attention has no added projections.
    assert type(block.attn.processor).__name__ == "JointAttnProcessor2_0"
    assert isinstance(block.attn.to_q, ProjectionSlice) and isinstance(block.attn.add_k_proj, ProjectionSlice)
    assert hasattr(block.attn, "to_added_qkv") and hasattr(block.attn2, "to_qkv")
    assert max_diff(run(model), before) <= 1e-5


def test_cross_attention_q_never_joins_k_v():
    from transformers import T5Config, T5Model

    torch.manual_seed(0)
    model = T5Model(T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4)).eval()
    inputs = {"input_ids": torch.randint(1, 99, (2, 7)), "decoder_input_ids": torch.randint(1, 99, (2, 5))}
    before = hidden(model, inputs)
    step, record = fuse(model)
    cross = model.decoder.block[0].layer[1].EncDecAttention     # declared by its name
    assert type(cross.q) is nn.Linear and isinstance(cross.k, ProjectionSlice) and cross.kv.out_features == 64
    assert isinstance(model.decoder.block[0].layer[0].SelfAttention.q, ProjectionSlice)
    assert "2 cross-attention module(s)" in " ".join(step.notes)
    assert max_diff(hidden(model, inputs), before) <= 1e-6
    # A diffusers cross-attention whose processor has no fused counterpart shares to_kv too.
    from diffusers.models.attention_processor import AttnProcessor

    unet = build("unet")
    unet.set_attn_processor(AttnProcessor())
    before = run(unet)
    fuse(unet)
    attn2 = unet.get_submodule(ATTN2)
    assert type(attn2.to_q) is nn.Linear and isinstance(attn2.to_k, ProjectionSlice) and hasattr(attn2, "to_kv")
    assert max_diff(run(unet), before) <= 1e-5


def test_slices_are_exact_in_any_order_and_with_any_input():
    module, reference = _fused_toy()
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    expected = {n: getattr(reference, n)(x) for n in ("q_proj", "k_proj", "v_proj")}
    for order in (("v_proj", "q_proj", "k_proj"), ("k_proj", "k_proj", "q_proj", "v_proj")):
        for n in order:
            got = getattr(module, n)(x)
            assert got.is_contiguous() and torch.allclose(got, expected[n], atol=1e-6, rtol=0)
    # Another input (a cross-attention's encoder states): computed afresh, not a stale slice.
    assert torch.allclose(module.q_proj(x), expected["q_proj"], atol=1e-6, rtol=0)
    assert torch.allclose(module.k_proj(input=y), reference.k_proj(y), atol=1e-6, rtol=0)
    # The same tensor changed in place after q took its part: k does not reuse the old result.
    module.q_proj(x)
    x.mul_(2)
    assert torch.allclose(module.k_proj(x), reference.k_proj(x), atol=1e-6, rtol=0)
    # Nothing is held once every slice has taken its part.
    z = torch.randn(5, 8)
    for n in ("q_proj", "k_proj", "v_proj"):
        getattr(module, n)(z)
    assert module.q_proj.shared.cache is None


def _fused_toy():
    torch.manual_seed(0)
    module = nn.Module()
    module.q_proj, module.k_proj, module.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    reference = copy.deepcopy(module)
    fusion = analysis.analyse(module, analysis.QKVOptions())
    from transformdsl.edit import Edit

    qkv_install.install(Edit(), module, fusion, qkv_install.concatenated)
    return module, reference


def test_slices_read_like_linears_and_follow_a_replaced_fused_layer():
    module, reference = _fused_toy()
    q, k = module.q_proj, module.k_proj
    assert (q.in_features, q.out_features, k.out_features) == (8, 8, 4)
    assert torch.equal(k.weight, reference.k_proj.weight) and torch.equal(k.bias, reference.k_proj.bias)
    assert k.weight.data_ptr() == module.qkv_proj.weight[8:].data_ptr()      # a view, no copy
    assert not list(q.parameters()) and "q_proj.weight" not in module.state_dict()
    # The fused layer is looked up at call time: replace it, the slices use the new one.
    module.qkv_proj = nn.Linear(8, 16, bias=False)
    x = torch.randn(3, 8)
    assert torch.equal(module.v_proj(x), module.qkv_proj(x)[:, 12:])
    # Copies (deepcopy, pickle) slice their own copy of the fused layer.
    clone = copy.deepcopy(module)
    assert clone.q_proj.shared.owner is clone
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.k_proj.shared.owner is loaded and torch.equal(loaded.k_proj(x), module.k_proj(x))


def test_fuse_then_quantize_int8_quantizes_the_one_fused_layer(tmp_path):
    model, inputs = build_transformers("mistral")
    before = hidden(model, inputs)
    script = "fuse qkv; quantize int8"
    targets = plan(model, script).steps[1].targets
    assert "layers.0.self_attn.qkv_proj" in targets and not any(t.endswith((".q_proj", ".k_proj")) for t in targets)
    transformdsl.transform(model, script)
    attention = model.layers[0].self_attn
    assert type(attention.qkv_proj).__name__ == "Int8Linear" and isinstance(attention.q_proj, ProjectionSlice)
    after = hidden(model, inputs)
    assert max_diff(after, before) <= 0.05 * before.abs().max().item()
    transformdsl.save(model, tmp_path / "saved")
    assert torch.equal(hidden(transformdsl.load(tmp_path / "saved"), inputs), after)


def test_fused_model_compiles_fullgraph():
    model, inputs = build_transformers("mistral")
    fuse(model)
    eager = hidden(model, inputs)
    torch._dynamo.reset()
    graphs = []

    def count_linears(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)))
        return gm

    compiled = torch.compile(model, fullgraph=True, backend=count_linears)
    assert torch.equal(hidden(compiled, inputs), eager)
    # Per layer: qkv_proj once (not three slices), o_proj, and the MLP's gate, up and down.
    assert graphs == [2 * 5]


def test_version_1_records_still_load(tmp_path):
    for arch in ("unet", "llama"):
        model = build(arch)
        fuse(model)
        transformdsl.save(model, tmp_path / arch)
        meta_path = tmp_path / arch / "transformdsl.json"
        meta = json.loads(meta_path.read_text())
        meta["steps"][0]["record"]["version"] = 1       # as saved before the shared projection existed
        meta_path.write_text(json.dumps(meta))
        assert torch.equal(run(transformdsl.load(tmp_path / arch)), run(model))


# --------------------------------------------------------------------------- the corpus (tests/zoo)

#: Diffusers denoisers whose attention has no exact fused path of its own: every one fuses
#: through the shared projection, including qk-norm, dual, added-kv and cross attentions.
CORPUS = [
    "diffusers/Flux2Transformer2DModel[Flux2Transformer]",
    "diffusers/WanTransformer3DModel",
    "diffusers/QwenImageTransformer2DModel",
    "diffusers/LTXVideoTransformer3DModel",
    "diffusers/SanaTransformer2DModel",
    "diffusers/CogVideoXTransformer3DModel[CogVideoXTransformer]",
    "diffusers/HunyuanVideoTransformer3DModel[HunyuanVideoTransformer]",
    "diffusers/Lumina2Transformer2DModel",
    "diffusers/MochiTransformer3DModel",
    "diffusers/AuraFlowTransformer2DModel",
    "diffusers/HiDreamImageTransformer2DModel",
    "diffusers/SD3Transformer2DModel[SD35Transformer]",
]


@pytest.mark.parametrize("model_id", CORPUS)
def test_corpus_denoisers_fuse_every_attention(model_id, tmp_path):
    from tests.zoo import corpus

    model, inputs = corpus.build(corpus.entry(model_id))
    owners = projection_owners(model)
    before, bytes_before = corpus.run(model, inputs), parameter_bytes(model)
    step, record = fuse(model)
    assert owners and set(owners) <= set(step.targets), dict(step.skipped)
    after = corpus.run(model, inputs)
    assert max_diff(after, before) <= 1e-6 * before.abs().max().item()
    assert parameter_bytes(model) == bytes_before
    # k and v always fuse (q too, unless a cross-attention): their tensors are gone.
    state = model.state_dict()
    assert not any(f"{path}.{n}.weight" in state for path in owners for n in ("to_k", "to_v", "add_k_proj", "add_v_proj"))
    transformdsl.save(model, tmp_path / "saved")
    assert torch.equal(corpus.run(transformdsl.load(tmp_path / "saved"), inputs), after)


# --------------------------------------------------------------------------- near misses that fuse now, or say why not


def test_whisper_k_proj_without_bias_fuses_with_a_zero_bias_segment(tmp_path):
    """Whisper's k_proj has no bias (q_proj, v_proj have): the fused bias holds zeros in its rows,
    adding 0 changes nothing, so the fusion is exact; the stock loader reads the unfused save."""
    from transformers import WhisperModel

    from tests.zoo import corpus

    model, inputs = corpus.build(corpus.entry("transformers/Whisper"))
    owners = projection_owners(model)
    before, bytes_before = corpus.run(model, inputs), parameter_bytes(model)
    step, record = fuse(model)
    assert step.targets == owners and len(owners) == 6 and not step.skipped
    assert {tuple(g.get("zero_bias", ())) for m in record["modules"] for g in m["groups"]} == {("k_proj",)}
    after = corpus.run(model, inputs)
    assert max_diff(after, before) <= 1e-6 * before.abs().max().item()
    attention = model.encoder.layers[0].self_attn
    assert attention.k_proj.bias is None and attention.q_proj.bias.shape == (32,)
    assert torch.count_nonzero(attention.qkv_proj.bias[32:64]) == 0
    assert parameter_bytes(model) == bytes_before + 6 * 32 * 4  # the zero rows: 32 floats per attention
    transformdsl.save(model, tmp_path / "saved")
    assert torch.equal(corpus.run(transformdsl.load(tmp_path / "saved"), inputs), after)
    # format="transformers": written unfused, k_proj without a bias; transformdsl restores the zeros.
    transformdsl.save(model, tmp_path / "stock", format="transformers")
    stock = WhisperModel.from_pretrained(tmp_path / "stock").eval()
    assert stock.encoder.layers[0].self_attn.k_proj.bias is None
    torch.testing.assert_close(corpus.run(stock, inputs), after, rtol=0, atol=1e-5)
    assert torch.equal(corpus.run(transformdsl.load(tmp_path / "stock"), inputs), after)


def test_attention_pool_reading_its_projection_weights_is_named_in_the_plan():
    """HunyuanDiT's AttentionPool is not an `*Attention` and passes q/k/v `.weight` to
    F.multi_head_attention_forward itself: the plan says so; named, it is a near miss."""
    from tests.zoo import corpus

    model, _ = corpus.build(corpus.entry("diffusers/HunyuanDiT2DModel"))
    step = plan(model, "fuse qkv").steps[0]
    assert "time_extra_emb.pooler" not in step.targets
    reason = ("HunyuanDiTAttentionPool.forward reads k_proj.weight, q_proj.weight, v_proj.weight itself and never "
              "calls the projections (F.multi_head_attention_forward): a fused projection would never run")
    assert any(note.startswith("not selected (not named *Attention), though it has separate q/k/v projections: "
                               f"time_extra_emb.pooler (HunyuanDiTAttentionPool: {reason})") for note in step.notes)
    named = plan(model, "fuse qkv HunyuanDiTAttentionPool").steps[0]
    assert dict(named.skipped) == {"time_extra_emb.pooler": reason}
    assert not any(n.startswith("not selected") for n in named.notes)  # the user named the targets
    assert not any(n.startswith("not selected") for n in plan(model, "fuse qkv in blocks").steps[0].notes)
