"""``fuse qkv`` on real diffusers / transformers modules (tiny configs, random weights)."""

from __future__ import annotations

import copy
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch import nn

from transformdsl.edit import Edit
from transformdsl.errors import LoadError
from transformdsl.passes import qkv
from transformdsl.passes.base import ApplyContext
from transformdsl.planner import plan
from transformdsl.tree import parameter_bytes


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a loaded 2-core machine OpenMP threads
    spinning against each other make a tiny UNet forward ~70x slower (5 s instead of 0.08 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- tiny models


def tiny_unet(**overrides):
    from diffusers import UNet2DConditionModel

    config = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=24,
                  attention_head_dim=8, norm_num_groups=8)
    return UNet2DConditionModel(**{**config, **overrides})


def tiny_sd3(**overrides):
    from diffusers import SD3Transformer2DModel

    config = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16,
                  pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16)
    return SD3Transformer2DModel(**{**config, **overrides})


def tiny_flux():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=24,
                                  pooled_projection_dim=12, axes_dims_rope=(2, 2, 4))


def tiny_llama(attn_implementation="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    # 4 query heads, 2 key/value heads: grouped-query attention, k/v half as wide as q.
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation=attn_implementation)
    return LlamaForCausalLM(config)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


BUILDERS = {"unet": tiny_unet, "sd3": tiny_sd3, "flux": tiny_flux, "llama": tiny_llama}
DIFFUSERS = ("unet", "sd3", "flux")


def build(arch: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[arch]().eval()


def inputs(arch: str) -> dict:
    g = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    if arch == "unet":
        return dict(sample=randn(2, 4, 8, 8), timestep=torch.tensor([3, 7]), encoder_hidden_states=randn(2, 5, 24))
    if arch == "sd3":
        return dict(hidden_states=randn(2, 4, 8, 8), encoder_hidden_states=randn(2, 5, 24),
                    pooled_projections=randn(2, 12), timestep=torch.tensor([3, 7]))
    if arch == "flux":
        return dict(hidden_states=randn(2, 16, 8), encoder_hidden_states=randn(2, 5, 24),
                    pooled_projections=randn(2, 12), timestep=torch.tensor([0.3, 0.7]),
                    img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3))
    return dict(input_ids=torch.randint(0, 64, (2, 7), generator=g))


def run(model: nn.Module, arch: str) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs(arch))
    return out.logits if hasattr(out, "logits") else out.sample


# --------------------------------------------------------------------------- harness (mirrors transform/save/load)


def fuse(model: nn.Module, script: str = "fuse qkv"):
    """Plan and apply the first statement of ``script``; returns (plan, step, record)."""
    p = plan(model, script)
    step = p.steps[0]
    edit = Edit()
    record = step.transform.apply(ApplyContext(model, edit, progress=lambda it, **k: it), step.targets)
    edit.commit()
    return p, step, record


def reload(arch: str, model: nn.Module, step, record) -> nn.Module:
    """A meta skeleton, rebuilt from ``record``, loaded with ``model``'s tensors."""
    with torch.device("meta"):
        torch.manual_seed(0)
        skeleton = BUILDERS[arch]().eval()
    type(step.transform).rebuild(skeleton, record, step.transform.options)
    skeleton.load_state_dict(model.state_dict(), strict=True, assign=True)
    saved = model.state_dict()
    for name, buffer in model.named_buffers():   # non-persistent buffers (rotary inv_freq): the loader's job
        if name not in saved:
            owner, _, leaf = name.rpartition(".")
            skeleton.get_submodule(owner)._buffers[leaf] = buffer.clone()
    return skeleton


def structure(model: nn.Module) -> list:
    """Everything rollback must restore besides tensors: module types, processors, flags."""
    return [(name, type(m), type(getattr(m, "processor", None)), m.__dict__.get("fused_projections"),
             m.__dict__.get("qkv_split")) for name, m in model.named_modules()]


def attention_paths(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]


# --------------------------------------------------------------------------- outputs, bytes, layout


EXPECTED = {
    # arch: {attention module suffix: (fused names, names that must be gone)}
    "unet": {"attn1": (["to_qkv"], ["to_q", "to_k", "to_v"]), "attn2": (["to_q", "to_kv"], ["to_k", "to_v"])},
    "sd3": {"attn": (["to_qkv", "to_added_qkv"], ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"])},
    "flux": {"attn": (["to_qkv"], ["to_q", "to_k", "to_v"])},
    "llama": {"self_attn": (["qkv_proj"], ["q_proj", "k_proj", "v_proj"])},
}


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_fused_outputs_match_and_bytes_do_not_grow(arch):
    model = build(arch)
    before, bytes_before = run(model, arch), parameter_bytes(model)
    p, step, record = fuse(model)
    assert step.targets == attention_paths(model) and not step.skipped
    assert len(record["modules"]) == len(step.targets)
    assert (run(model, arch) - before).abs().max().item() <= 1e-5
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
    assert double.fused_projections and single.fused_projections
    assert double.to_added_qkv.weight.shape == (48, 16) and not hasattr(single, "to_added_qkv")
    assert single.pre_only and not hasattr(single, "to_out")


def test_sd3_last_block_is_context_pre_only():
    model = build("sd3")
    fuse(model)
    last = model.transformer_blocks[-1].attn
    assert last.context_pre_only and last.to_add_out is None and hasattr(last, "to_added_qkv")


def test_llama_grouped_query_split_and_cache():
    model = build("llama")
    reference = copy.deepcopy(model)
    fuse(model)
    attention = model.model.layers[0].self_attn
    assert attention.qkv_split == (32, 16, 16) and attention.qkv_proj.weight.shape == (64, 32)
    assert isinstance(attention, type(reference.model.layers[0].self_attn))
    # Prefill and decoding through the key/value cache.
    ids = inputs("llama")["input_ids"]
    kwargs = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=0)
    got, expected = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(got.logits, expected.logits)) <= 1e-5


def test_llama_eager_attention():
    torch.manual_seed(0)
    model = tiny_llama("eager").eval()
    before = run(model, "llama")
    fuse(model)
    assert (run(model, "llama") - before).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", DIFFUSERS)
def test_matches_diffusers_fuse_qkv_projections(arch):
    model = build(arch)
    theirs = copy.deepcopy(model)
    theirs.fuse_qkv_projections()
    fuse(model)
    assert (run(model, arch) - run(theirs, arch)).abs().max().item() <= 1e-5
    # Same fused tensors, but diffusers keeps the old projections too (more bytes).
    ours_sd, theirs_sd = model.state_dict(), theirs.state_dict()
    assert all(torch.equal(t, theirs_sd[k]) for k, t in ours_sd.items())
    assert parameter_bytes(model) < parameter_bytes(theirs)


# --------------------------------------------------------------------------- cross-attention


def test_cross_attention_kv_and_skip():
    kv, skip = build("unet"), build("unet")
    before = run(kv, "unet")
    _, step_kv, _ = fuse(kv, "fuse qkv cross=kv")
    _, step_skip, _ = fuse(skip, "fuse qkv cross=skip")
    cross = [p for p in attention_paths(kv) if p.endswith("attn2")]
    assert set(cross) <= set(step_kv.targets)
    assert not set(cross) & set(step_skip.targets)
    assert sorted(p for p, _ in step_skip.skipped) == sorted(cross)
    assert all("cross-attention" in reason and "cross=skip" in reason for _, reason in step_skip.skipped)
    for model in (kv, skip):
        assert (run(model, "unet") - before).abs().max().item() <= 1e-5
    attn2_kv, attn2_skip = kv.get_submodule(cross[0]), skip.get_submodule(cross[0])
    # k/v read the encoder states (24 features), q the hidden states (32): q is never fused with them.
    assert attn2_kv.to_kv.in_features == 24 and attn2_kv.to_q.in_features == 32
    assert all(hasattr(attn2_skip, n) for n in ("to_q", "to_k", "to_v")) and not hasattr(attn2_skip, "to_kv")
    assert type(attn2_skip.processor).__name__ == "AttnProcessor2_0"


# --------------------------------------------------------------------------- near misses


def test_gpt2_is_a_near_miss():
    model = tiny_gpt2()
    p = plan(model, "fuse qkv")
    [(path, reason)] = p.steps[0].skipped
    assert path == "transformer.h.0.attn" and reason.startswith("already fused: c_attn (Conv1D)")
    assert p.steps[0].targets == []
    assert "already fused: c_attn" in str(p)


def test_near_miss_reasons():
    from transformers import CLIPTextConfig, CLIPTextModel

    clip = CLIPTextModel(CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=16))
    [(_, reason)] = plan(clip, "fuse qkv").steps[0].skipped
    assert reason.startswith("unknown attention layout: CLIPAttention.forward reads q_proj/k_proj/v_proj")

    llama = build("llama")
    llama.model.layers[0].self_attn.k_proj = nn.Linear(24, 16, bias=False)     # reads another input
    llama.model.layers[1].self_attn.v_proj = nn.Sequential(nn.Linear(32, 16))   # not a plain Linear
    reasons = dict(plan(llama, "fuse qkv").steps[0].skipped)
    assert reasons["model.layers.0.self_attn"].startswith("projections read different inputs: k_proj")
    assert reasons["model.layers.1.self_attn"] == "v_proj is a Sequential, not a plain nn.Linear (fuse qkv runs first)"

    unet = build("unet")
    unet.fuse_qkv_projections()          # diffusers' own: to_qkv beside to_q
    assert all(r.startswith("already fused: to_") for _, r in plan(unet, "fuse qkv").steps[0].skipped)

    sd3 = tiny_sd3(qk_norm="rms_norm")
    reasons = {r for _, r in plan(sd3, "fuse qkv").steps[0].skipped}
    assert reasons == {"qk-norm (norm_q, norm_k, norm_added_q, norm_added_k): diffusers' "
                       "FusedJointAttnProcessor2_0 skips it, so fusing would change outputs"}


def test_llama_forward_of_another_version_is_not_fused(monkeypatch):
    monkeypatch.setattr(qkv, "LLAMA_FORWARD_FINGERPRINT", "0" * 16)
    step = plan(build("llama"), "fuse qkv").steps[0]
    assert not step.targets and "differs from the one this pass mirrors" in step.skipped[0][1]


# --------------------------------------------------------------------------- planning


def test_plan_effect_lets_quantize_target_the_fused_projection():
    model = build("unet")
    p = plan(model, "fuse qkv; quantize int8")
    targets = p.steps[1].targets
    attn1 = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    attn2 = attn1[:-1] + "2"
    assert f"{attn1}.to_qkv" in targets and f"{attn2}.to_kv" in targets and f"{attn2}.to_q" in targets
    assert not any(t.endswith((".to_k", ".to_v")) or t == f"{attn1}.to_q" for t in targets)
    # The snapshot describes the fused Linear as apply will build it.
    from transformdsl.tree import ModuleTree

    tree = ModuleTree.of(model)
    step = p.steps[0]
    step.transform.plan_effect(tree, step.targets)
    info = tree[f"{attn1}.to_qkv"]
    assert info.cls is nn.Linear and info.facts["weight_shape"] == (96, 32)
    assert info.facts["in_features"] == 32 and info.facts["out_features"] == 96
    fuse(model)
    assert sorted(i.path for i in tree) == sorted(n for n, _ in model.named_modules())
    assert tree[f"{attn1}.to_qkv"].own_bytes == parameter_bytes(model.get_submodule(f"{attn1}.to_qkv"))


# --------------------------------------------------------------------------- persistence


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_rebuild_and_load_is_bit_equal(arch):
    model = build(arch)
    _, step, record = fuse(model)
    record = json.loads(json.dumps(record))          # what persistence stores: JSON, no tensors
    reloaded = reload(arch, model, step, record)
    assert structure(reloaded) == structure(model)
    assert torch.equal(run(reloaded, arch), run(model, arch))


def test_rebuild_rejects_a_different_model():
    model = build("llama")
    _, step, record = fuse(model)
    record["modules"][0]["groups"][0]["splits"] = [32, 32, 32]
    with pytest.raises(LoadError, match="k_proj is not a Linear of shape"):
        reload("llama", model, step, record)


# --------------------------------------------------------------------------- atomicity


def fail_on_call(monkeypatch, name, number):
    """Make ``qkv.<name>`` raise on its ``number``-th call."""
    original = getattr(qkv, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(qkv, name, failing)


@pytest.mark.parametrize("arch, helper", [(a, "_concatenated") for a in BUILDERS] + [("unet", "_fused_processor")])
def test_rollback_restores_the_model_bit_identically(arch, helper, monkeypatch):
    model = build(arch)
    state = model.state_dict(keep_vars=True)
    shape, before = structure(model), run(model, arch)
    step = plan(model, "fuse qkv").steps[0]
    # Fail in the second module: after the first is fused (groups, processor, class, flags).
    first = qkv.analyse(model.get_submodule(step.targets[0]), step.transform.options)
    fail_on_call(monkeypatch, helper, len(first.groups) + 1 if helper == "_concatenated" else 2)
    edit = Edit()
    with pytest.raises(RuntimeError, match="injected failure"):
        step.transform.apply(ApplyContext(model, edit, progress=lambda it, **k: it), step.targets)
    assert structure(model) != shape                 # the first module was fused before the failure
    edit.rollback()
    assert structure(model) == shape
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(state) and all(after[k] is state[k] for k in state)   # the same tensors
    assert torch.equal(run(model, arch), before)
