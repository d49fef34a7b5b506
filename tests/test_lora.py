"""``lora "PATH"``: merged or switchable, against diffusers' and PEFT's own LoRA paths (spec.md "lora").

LoRA files are written here with random weights in the key formats the community uses (diffusers',
PEFT's, kohya/A1111 ``lora_unet_...`` with alphas, diffusers' older attention-processor keys); the
references are the libraries' loaders: diffusers' ``lora_state_dict`` + ``load_lora_into_*`` /
``load_lora_adapter`` + ``fuse_lora``, PEFT's ``get_peft_model`` + ``merge_and_unload``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import transformdsl
from transformdsl import ScriptError, TransformError, models
from transformdsl.history import history_of

ROOT = Path(__file__).resolve().parent.parent
RANK = 4


def linears(model, *words):
    """Paths of the nn.Linear layers of ``model`` whose path contains one of ``words``."""
    return [n for n, m in model.named_modules()
            if type(m) is torch.nn.Linear and any(w in n for w in words)]


def random_pair(module, seed, rank=RANK):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(rank, module.in_features, generator=g) / module.in_features ** 0.5
    B = torch.randn(module.out_features, rank, generator=g) * 0.5
    return A, B


def diffusers_lora(model, prefix, names, seed=0):
    """diffusers' own format: ``<prefix>.<path>.lora_A.weight`` / ``lora_B.weight``."""
    sd = {}
    for i, name in enumerate(names):
        A, B = random_pair(model.get_submodule(name), seed + i)
        sd[f"{prefix}.{name}.lora_A.weight"], sd[f"{prefix}.{name}.lora_B.weight"] = A, B
    return sd


def kohya_unet_lora(unet, names, alpha=2.0, seed=0):
    """kohya/A1111: ``lora_unet_<path with _>.lora_down.weight`` / ``lora_up.weight`` / ``.alpha``."""
    sd = {}
    for i, name in enumerate(names):
        A, B = random_pair(unet.get_submodule(name), seed + i)
        base = "lora_unet_" + name.replace(".", "_")
        sd[base + ".lora_down.weight"], sd[base + ".lora_up.weight"] = A, B
        sd[base + ".alpha"] = torch.tensor(alpha)
    return sd


def kohya_flux_lora(flux, alpha=8.0, seed=0):
    """kohya's Flux keys (BFL names): the double block's fused ``img_attn.qkv`` and ``img_attn.proj``."""
    g = torch.Generator().manual_seed(seed)
    width = flux.transformer_blocks[0].attn.to_q.in_features
    sd = {}
    for name, out in (("double_blocks_0_img_attn_qkv", 3 * width), ("double_blocks_0_img_attn_proj", width),
                      ("double_blocks_0_txt_attn_qkv", 3 * width)):
        sd[f"lora_unet_{name}.lora_down.weight"] = torch.randn(6, width, generator=g) / width ** 0.5
        sd[f"lora_unet_{name}.lora_up.weight"] = torch.randn(out, 6, generator=g) * 0.5
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)
    return sd


def attn_procs_unet_lora(unet, blocks, seed=0):
    """diffusers' older attention-processor keys (its ``save_lora_weights`` before PEFT):
    ``unet.<attn>.processor.to_q_lora.down.weight``."""
    sd = {}
    for i, attn in enumerate(blocks):
        for j, proj in enumerate(("to_q", "to_k", "to_v", "to_out")):
            module = unet.get_submodule(f"{attn}.{proj}" + (".0" if proj == "to_out" else ""))
            A, B = random_pair(module, seed + 10 * i + j)
            sd[f"unet.{attn}.processor.{proj}_lora.down.weight"] = A
            sd[f"unet.{attn}.processor.{proj}_lora.up.weight"] = B
    return sd


def write(tmp_path, sd, name="style.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def diffusers_merged(factory, sd, scale=1.0):
    """The reference: diffusers reads the file's dict with the model's loader mixin, loads it as a
    PEFT adapter, and fuses it (``fuse_lora``), on the unfused float model."""
    from diffusers.loaders import FluxLoraLoaderMixin, SD3LoraLoaderMixin, StableDiffusionLoraLoaderMixin

    model = factory()
    name = type(model).__name__
    if name == "UNet2DConditionModel":
        state, alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(dict(sd))
        StableDiffusionLoraLoaderMixin.load_lora_into_unet(state, alphas, unet=model, adapter_name="x")
    elif name == "FluxTransformer2DModel":
        state, alphas = FluxLoraLoaderMixin.lora_state_dict(dict(sd), return_alphas=True)
        FluxLoraLoaderMixin.load_lora_into_transformer(state, alphas, transformer=model, adapter_name="x")
    else:
        state = SD3LoraLoaderMixin.lora_state_dict(dict(sd))
        SD3LoraLoaderMixin.load_lora_into_transformer(state, transformer=model, adapter_name="x")
    model.fuse_lora(lora_scale=scale)
    model.unload_lora()
    return model


def script(path, *lines, **options):
    extra = "".join(f" {k}={v}" for k, v in options.items())
    return "\n".join([f'lora "{path}"{extra}', *lines])


def close(a, b, tol=1e-5):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


# --------------------------------------------------------------------------- merged: equal to the libraries


@pytest.mark.parametrize("factory, prefix, words", [
    (models.tiny_flux, "transformer", ("attn.to_", "attn.add_", "proj_mlp", "ff.net")),
    (models.tiny_sd3, "transformer", ("attn.to_", "attn.add_", "ff.net")),
])
@pytest.mark.parametrize("before, after", [((), ()), (("fuse qkv",), ()), ((), ("fuse qkv",))])
def test_merged_equals_diffusers_fuse_lora_with_and_without_fuse_qkv(tmp_path, factory, prefix, words, before, after):
    model = factory()
    sd = diffusers_lora(model, prefix, linears(model, *words))
    path = write(tmp_path, sd)
    expected = models.run(diffusers_merged(factory, sd, scale=0.8))
    transformdsl.transform(model, "\n".join([*before, f'lora "{path}" scale=0.8', *after]))
    if before or after:
        assert hasattr(model.transformer_blocks[0].attn, "to_qkv")
    got = models.run(model)
    assert not close(models.run(factory()), expected)  # the LoRA changes the output
    assert close(got, expected), (got - expected).abs().max()


def test_two_merged_loras_on_one_layer_both_add_their_deltas(tmp_path):
    """Neither wins: the second LoRA's delta is added to the weights the first one left (spec.md, lora)."""
    model = models.tiny_flux()
    names = linears(model, "attn.to_")
    first, second = diffusers_lora(model, "transformer", names, seed=0), diffusers_lora(model, "transformer", names, seed=7)
    a, b = write(tmp_path, first, "a.safetensors"), write(tmp_path, second, "b.safetensors")
    # diffusers fuses the first, then the second into what the first left
    expected = diffusers_merged(lambda: diffusers_merged(models.tiny_flux, first, scale=0.5), second, scale=0.25)
    transformdsl.transform(model, f'lora "{a}" scale=0.5\nlora "{b}" scale=0.25')
    assert close(models.run(model), models.run(expected))
    only_first = models.tiny_flux()
    transformdsl.transform(only_first, f'lora "{a}" scale=0.5')
    assert not close(models.run(only_first), models.run(expected))


def test_merged_llama_equals_peft_merge_and_unload(tmp_path):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    peft_model = get_peft_model(models.tiny_llama(), LoraConfig(
        r=RANK, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]))
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(peft_model.named_parameters())):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
    path = write(tmp_path, get_peft_model_state_dict(peft_model), "adapter_model.safetensors")
    assert next(iter(get_peft_model_state_dict(peft_model))).startswith("base_model.model.")
    expected = models.run(peft_model.merge_and_unload())
    for text in (script(path, alpha=8), script(path, "fuse qkv", alpha=8), f'fuse qkv; lora "{path}" alpha=8'):
        model = models.tiny_llama()
        transformdsl.transform(model, text)
        assert close(models.run(model), expected)
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")


@pytest.mark.parametrize("statement", ["quantize nf4", "quantize int8", "fp8 storage", "quantize int8 weight_only=true"])
@pytest.mark.parametrize("fuse", [False, True])
def test_merged_then_quantized_equals_merging_by_hand_then_quantizing(tmp_path, statement, fuse):
    model = models.tiny_flux()
    sd = diffusers_lora(model, "transformer", linears(model, "attn.to_", "ff.net"))
    path = write(tmp_path, sd)
    rest = (["fuse qkv"] if fuse else []) + [statement]
    by_hand = diffusers_merged(models.tiny_flux, sd, scale=0.5)
    transformdsl.transform(by_hand, "\n".join(rest))
    # the lora line last: it runs first all the same (before fuse, quantize and fp8)
    transformdsl.transform(model, "\n".join([*rest, f'lora "{path}" scale=0.5']))
    assert torch.equal(models.run(model), models.run(by_hand))


@pytest.mark.parametrize("fuse", [False, True])
def test_kohya_unet_lora_with_alphas_equals_diffusers(tmp_path, fuse):
    unet = models.tiny_unet()
    names = linears(unet, "attn1.to_", "attn2.to_", "ff.net", "time_embedding", "proj_in")
    sd = kohya_unet_lora(unet, names)
    assert all(k.startswith("lora_unet_") for k in sd)
    path = write(tmp_path, sd)
    expected = models.run(diffusers_merged(models.tiny_unet, sd))
    transformdsl.transform(unet, script(path, *(["fuse qkv"] if fuse else [])))
    assert close(models.run(unet), expected)


def test_kohya_flux_lora_of_fused_bfl_layers_equals_diffusers(tmp_path):
    flux = models.tiny_flux()
    sd = kohya_flux_lora(flux)
    path = write(tmp_path, sd)
    expected = models.run(diffusers_merged(models.tiny_flux, sd))
    transformdsl.transform(flux, script(path, "fuse qkv"))
    assert close(models.run(flux), expected)


def test_older_diffusers_attention_processor_keys_equal_diffusers(tmp_path):
    unet = models.tiny_unet()
    blocks = sorted({n.rsplit(".", 1)[0] for n in linears(unet, "attn1.to_q", "attn2.to_q")})
    sd = attn_procs_unet_lora(unet, blocks)
    path = write(tmp_path, sd)
    expected = models.run(diffusers_merged(models.tiny_unet, sd))
    assert not close(models.run(models.tiny_unet()), expected)
    transformdsl.transform(unet, script(path))
    assert close(models.run(unet), expected)


# --------------------------------------------------------------------------- planning checks and errors


def error(model, text) -> str:
    with pytest.raises((ScriptError, TransformError)) as info:
        transformdsl.transform(model, text)
    return str(info.value)


def test_keys_that_match_no_module_list_the_nearest_names_or_are_ignored(tmp_path):
    flux = models.tiny_flux()
    sd = diffusers_lora(flux, "transformer", ["transformer_blocks.0.attn.to_q"])
    for part in ("lora_A", "lora_B"):
        sd[f"transformer.transformer_blocks.0.attn.to_qq.{part}.weight"] = \
            sd[f"transformer.transformer_blocks.0.attn.to_q.{part}.weight"].clone()
    path = write(tmp_path, sd)
    before = models.run(flux)
    message = error(flux, script(path))
    assert "1 LoRA module(s) match no module" in message and "'transformer_blocks.0.attn.to_qq'" in message
    assert "nearest: transformer_blocks.0.attn.to_q" in message and "unmatched=ignore" in message
    assert torch.equal(models.run(flux), before)
    plan = transformdsl.plan(flux, script(path, unmatched="ignore"))
    assert any("1 LoRA module(s) ignored" in n for n in plan.steps[0].notes)
    transformdsl.transform(flux, script(path, unmatched="ignore"))
    assert not torch.equal(models.run(flux), before)


def test_a_lora_of_another_size_names_the_module(tmp_path):
    flux = models.tiny_flux()
    path = write(tmp_path, {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight": torch.zeros(4, 7),
                            "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": torch.zeros(16, 4)})
    message = error(flux, script(path))
    assert "'transformer_blocks.0.attn.to_k': the LoRA maps 7 -> 16 features (rank 4), the module 16 -> 16" in message


@pytest.mark.parametrize("name, content, expected", [
    ("x.ckpt", b"\x80\x02}q\x00.", "a .ckpt file is a pickle"),
    ("x.bin", b"\x80\x02}q\x00.", "a .bin file is a pickle"),
    ("x.safetensors", b"\x80\x02}q\x00.\x00\x00\x00\x00\x00\x00\x00\x00", "a pickle (its first 8 bytes"),
    ("x.safetensors", b"\xff\x00\x00\x00\x00\x00\x00\x00{}", "not a safetensors file"),
    ("x.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}        ", "malformed header entry"),
    ("x.safetensors", b"", "too short to be a safetensors file"),
])
def test_files_that_are_not_safetensors_are_refused_without_unpickling(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content)
    assert expected in error(models.tiny_flux(), script(path))


def test_a_missing_file_or_a_directory_is_an_error_at_the_argument(tmp_path):
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(models.tiny_flux(), 'lora "nowhere/x.safetensors"')
    (problem,) = info.value.problems
    assert "no such file" in problem.message and problem.span.column == 6
    assert "not a regular file" in error(models.tiny_flux(), f'lora "{tmp_path}"')


def test_planning_reads_the_header_only(tmp_path, monkeypatch):
    flux = models.tiny_flux()
    path = write(tmp_path, diffusers_lora(flux, "transformer", ["transformer_blocks.0.attn.to_q"]))
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("planning read tensor data")

    monkeypatch.setattr(safetensors.torch, "load", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    plan = transformdsl.plan(flux, script(path, "quantize nf4"))
    assert [s.transform.key() for s in plan.steps] == ["lora", "quantize nf4"]


def test_merging_into_a_layer_quantized_before_says_what_to_do(tmp_path):
    flux = models.tiny_flux()
    path = write(tmp_path, diffusers_lora(flux, "transformer", ["transformer_blocks.0.attn.to_q"]))
    transformdsl.transform(flux, "quantize nf4")
    message = error(flux, script(path))
    assert "no float weight" in message and "merge=false" in message


def test_the_save_records_the_file_name_and_sha256_not_its_path(tmp_path):
    import hashlib

    flux = models.tiny_flux()
    path = write(tmp_path, diffusers_lora(flux, "transformer", linears(flux, "attn.to_")))
    transformdsl.transform(flux, f'# style\nfuse qkv; lora "{path}" scale=0.5 # x\nquantize nf4')
    step = next(s for s in history_of(flux).steps if s.key == "lora")
    assert step.record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert step.record["file"] == "style.safetensors" and step.statement == 'lora "style.safetensors" scale=0.5'
    out = transformdsl.save(flux, tmp_path / "saved")
    text = "".join(p.read_text(errors="replace") for p in Path(out).iterdir() if p.suffix in (".json", ".tfm"))
    assert str(tmp_path) not in text and "style.safetensors" in text
    loaded = transformdsl.load(out)
    assert torch.equal(models.run(loaded), models.run(flux))


def test_execution_order_merged_before_the_weight_format_switchable_after():
    from transformdsl.validate import check_text

    order = [t.statement.line for t in check_text(
        "compile\nquantize nf4\nfuse qkv\nlora a.safetensors\nlora 'b.safetensors' merge=false").steps]
    assert order == [4, 3, 2, 5, 1]


def test_lora_statement_problems_are_found_without_a_model():
    from transformdsl.validate import check_text

    for text, message in [("lora", "'lora' needs the LoRA file"), ("lora a.safetensors, b", "needs the LoRA file"),
                          ("lora x.safetensors name='a b'", "an adapter name is letters"),
                          ("lora a.safetensors merge=false\nlora 'b/a.safetensors' merge=false", "two LoRAs named 'a'"),
                          ("lora a.safetensors\nlora './a.safetensors' scale=0.5", "the same LoRA file twice, merged")]:
        with pytest.raises(ScriptError) as info:
            check_text(text)
        assert message in str(info.value), text


# --------------------------------------------------------------------------- switchable


def peft_reference(factory, sd, scale=1.0, prefix="transformer"):
    """The unfused float model with the same adapter through diffusers/PEFT (not fused)."""
    model = factory()
    model.load_lora_adapter(dict(sd), prefix=prefix, adapter_name="style")
    model.set_adapters(["style"], weights=[scale])
    return model


@pytest.mark.parametrize("statement, bound", [
    ("", 1e-5), ("fuse qkv", 1e-5), ("quantize nf4", 0.4), ("quantize int8", 0.05),
    ("quantize hqq bits=8 group_size=8", 0.03), ("fp8 storage", 0.2), ("quantize int8 weight_only=true", 0.03),
    ("fuse qkv\nquantize nf4", 0.4),
])
def test_switchable_beside_quantized_and_fused_layers_equals_peft(tmp_path, statement, bound):
    flux = models.tiny_flux()
    sd = diffusers_lora(flux, "transformer", linears(flux, "attn.to_", "attn.add_", "ff.net"))
    path = write(tmp_path, sd)
    reference = peft_reference(models.tiny_flux, sd, scale=0.7)
    expected = models.run(reference)
    transformdsl.transform(flux, script(path, statement, merge="false", scale=0.7))
    got = models.run(flux)
    error_ = (got - expected).abs().max().item() / expected.abs().max().item()
    assert error_ <= bound + 1e-5, error_
    # the adapter stays beside the layer: its contribution moves with the scale, without reloading
    transformdsl.set_lora(flux, "style", 0.0)
    reference.set_adapters(["style"], weights=[0.0])
    base = models.run(flux)
    assert (base - models.run(reference)).abs().max().item() / expected.abs().max().item() <= bound + 1e-5
    transformdsl.set_lora(flux, "style", 0.7, enabled=False)
    assert torch.equal(models.run(flux), base)
    transformdsl.set_lora(flux, "style", enabled=True)
    assert torch.equal(models.run(flux), got)


def test_switchable_lora_on_a_fused_qkv_stacks_the_parts_exactly(tmp_path):
    flux = models.tiny_flux()
    names = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v"]
    sd = diffusers_lora(flux, "transformer", names)
    path = write(tmp_path, sd)
    transformdsl.transform(flux, script(path, "fuse qkv", merge="false"))
    layer = flux.transformer_blocks[0].attn.to_qkv
    adapter = layer.lora_adapters["style"]
    assert type(layer).__name__ == "LinearWithLora" and tuple(adapter.A.shape) == (2 * RANK, 16)
    delta = adapter.B @ adapter.A
    q = sd["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"] @ sd["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"]
    assert torch.allclose(delta[:16], q) and torch.equal(delta[16:32], torch.zeros(16, 16))
    assert transformdsl.lora_adapters(flux) == {"style": {"scale": 1.0, "enabled": True, "layers": 1}}


def test_fuse_in_a_later_call_than_a_switchable_lora_says_to_put_them_in_one_script(tmp_path):
    flux = models.tiny_flux()
    path = write(tmp_path, diffusers_lora(flux, "transformer", ["transformer_blocks.0.attn.to_q"]))
    transformdsl.transform(flux, script(path, merge="false"))
    reasons = dict(transformdsl.plan(flux, "fuse qkv").steps[0].skipped)
    assert reasons["transformer_blocks.0.attn"].startswith(
        "to_q carries switchable LoRA adapters from an earlier call: fuse qkv maps adapters onto the fused rows "
        "only when both are in one script")
    assert "merge=true" in reasons["transformer_blocks.0.attn"]


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                               num_decoder_layers=1, num_heads=4)).eval()


@pytest.mark.parametrize("model_id, child", [("transformers/DistilBERT", "transformer"), ("T5", "decoder")])
def test_a_model_child_named_like_a_pipeline_component_is_the_models_own_path(tmp_path, model_id, child):
    """DistilBERT's 'transformer' and T5's 'decoder' are also diffusers' component prefixes: their keys were
    taken for another component's and left out (DistilBERT: 'no LoRA pair'; T5: the decoder's half dropped)."""
    from tests.zoo import corpus
    from tests.zoo.matrix import lora_file

    model = _t5() if model_id == "T5" else corpus.build(corpus.entry(model_id))[0]
    path = lora_file(model, tmp_path)
    named = [name for name, m in model.named_modules() if type(m) is nn.Linear and name]
    before = {name: model.get_submodule(name).weight.detach().clone() for name in named}
    transformdsl.transform(model, f'lora "{path}"')
    changed = [name for name in named if not torch.equal(model.get_submodule(name).weight, before[name])]
    assert changed == named and any(name.startswith(child + ".") for name in changed)


@pytest.mark.parametrize("merge", ["true", "false"])
@pytest.mark.parametrize("extra, expected", [
    ({"alpha": float("nan")}, "has alpha nan: a LoRA's alpha must be a finite number"),
    ({"lora_B.weight": float("inf")}, "its lora_B holds NaN or infinite values"),
], ids=["nan alpha", "inf in B"])
def test_a_lora_with_non_finite_values_is_refused_and_the_model_left_as_it_was(tmp_path, merge, extra, expected):
    flux = models.tiny_flux()
    before = models.run(flux)
    sd = diffusers_lora(flux, "transformer", ["transformer_blocks.0.attn.to_q"])
    for suffix, value in extra.items():
        key = f"transformer.transformer_blocks.0.attn.to_q.{suffix}"
        sd[key] = torch.full_like(sd[key], value) if key in sd else torch.tensor(value)
    path = write(tmp_path, sd)
    with pytest.raises(TransformError, match=expected):
        transformdsl.transform(flux, script(path, merge=merge))
    assert torch.equal(models.run(flux), before)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_a_lora_stored_in_a_narrow_float_dtype_applies(tmp_path, dtype):
    """isfinite has no float8_e4m3fn kernel: the finiteness check widened it first (the LoRA failed to apply)."""
    flux = models.tiny_flux()
    before = flux.transformer_blocks[0].attn.to_q.weight.detach().clone()
    sd = {k: v.to(dtype) for k, v in diffusers_lora(flux, "transformer", ["transformer_blocks.0.attn.to_q"]).items()}
    transformdsl.transform(flux, script(write(tmp_path, sd)))
    assert not torch.equal(flux.transformer_blocks[0].attn.to_q.weight, before)


def test_several_named_loras_and_an_unknown_name(tmp_path):
    flux = models.tiny_flux()
    a = write(tmp_path, diffusers_lora(flux, "transformer", linears(flux, "attn.to_q"), seed=1), "a.safetensors")
    b = write(tmp_path, diffusers_lora(flux, "transformer", linears(flux, "attn.to_q", "ff.net"), seed=2), "b.safetensors")
    base = models.run(flux)
    transformdsl.transform(flux, f'lora "{a}" merge=false\nlora "{b}" merge=false name=detail scale=0.5\nquantize int8')
    assert set(transformdsl.lora_adapters(flux)) == {"a", "detail"}
    both = models.run(flux)
    transformdsl.set_lora(flux, "a", 0.0)
    transformdsl.set_lora(flux, "detail", 0.0)
    none = models.run(flux)
    assert (none - base).abs().max() < 0.05 * base.abs().max() and not torch.equal(both, none)
    with pytest.raises(TransformError, match="no switchable LoRA named 'c'; the model has: a, detail"):
        transformdsl.set_lora(flux, "c", 1.0)


def test_switchable_save_loads_in_a_fresh_process_with_identical_outputs(tmp_path):
    flux = models.tiny_flux()
    path = write(tmp_path, diffusers_lora(flux, "transformer", linears(flux, "attn.to_", "ff.net")))
    transformdsl.transform(flux, script(path, "fuse qkv\nquantize nf4", merge="false", scale=0.7))
    transformdsl.set_lora(flux, "style", 0.3)
    out = transformdsl.save(flux, tmp_path / "saved")
    expected = models.run(flux)
    torch.save(expected, tmp_path / "expected.pt")
    code = textwrap.dedent(f"""
        import torch, transformdsl
        from transformdsl import models
        model = transformdsl.load({str(out)!r})
        assert abs(transformdsl.lora_adapters(model)["style"]["scale"] - 0.3) < 1e-7
        got = models.run(model)
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        assert torch.equal(got, expected), (got - expected).abs().max()
        transformdsl.set_lora(model, "style", 0.0)
        assert not torch.equal(models.run(model), expected)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_a_failed_switchable_lora_leaves_the_model_as_it_was(tmp_path):
    flux = models.tiny_flux()
    path = write(tmp_path, diffusers_lora(flux, "transformer", linears(flux, "attn.to_q")))
    transformdsl.transform(flux, script(path, merge="false"))
    before = {k: v.clone() for k, v in flux.state_dict().items()}
    classes = [type(m) for m in flux.modules()]
    # the same name again: refused when applied, after other layers were changed
    with pytest.raises(TransformError, match="already has a LoRA adapter named 'style'"):
        transformdsl.transform(flux, f'quantize int8\nlora "{path}" merge=false')
    assert [type(m) for m in flux.modules()] == classes
    assert all(torch.equal(before[k], v) for k, v in flux.state_dict().items())


# --------------------------------------------------------------------------- exports


def test_a_merged_lora_exports_to_diffusers_and_a_switchable_one_is_refused(tmp_path):
    from diffusers import FluxTransformer2DModel

    flux = models.tiny_flux()
    sd = diffusers_lora(flux, "transformer", linears(flux, "attn.to_"))
    path = write(tmp_path, sd)
    transformdsl.transform(flux, script(path, "fuse qkv"))
    out = transformdsl.save(flux, tmp_path / "merged", format="diffusers")
    stock = FluxTransformer2DModel.from_pretrained(out).eval()
    assert close(models.run(stock), models.run(flux))
    switchable = models.tiny_flux()
    transformdsl.transform(switchable, script(path, merge="false"))
    with pytest.raises(TransformError, match="cannot carry line 1: 'lora \"style.safetensors\" merge=false'"):
        transformdsl.save(switchable, tmp_path / "switchable", format="diffusers")


def test_a_kohya_file_for_unet_and_text_encoder_equals_the_pipelines_load_lora_weights(tmp_path):
    pipe = models.tiny_sd_pipeline()
    unet_names = linears(pipe.unet, "attn1.to_", "attn2.to_", "ff.net")
    text_names = linears(pipe.text_encoder, "self_attn.", "mlp.fc")
    sd = kohya_unet_lora(pipe.unet, unet_names)
    for i, name in enumerate(text_names):
        A, B = random_pair(pipe.text_encoder.get_submodule(name), 100 + i)
        base = "lora_te_text_model_" + name.replace(".", "_")
        sd[base + ".lora_down.weight"], sd[base + ".lora_up.weight"] = A, B
        sd[base + ".alpha"] = torch.tensor(2.0)
    path = write(tmp_path, sd)
    reference = models.tiny_sd_pipeline()
    reference.load_lora_weights(str(path), adapter_name="style")
    reference.fuse_lora(lora_scale=0.6)
    reference.unload_lora_weights()
    expected = models.run(reference)
    plan = transformdsl.plan(pipe, script(path, scale=0.6))
    assert any("component 'text_encoder' left alone" in n for n in plan.steps[0].notes)
    transformdsl.transform(pipe, f'lora "{path}" scale=0.6\nlora "{path}" scale=0.6 component=text_encoder')
    assert close(models.run(pipe), expected, 1e-4)
    assert not close(models.run(models.tiny_sd_pipeline()), expected, 1e-4)


# --------------------------------------------------------------------------- compile


@pytest.mark.slow
def test_compiled_fullgraph_a_scale_change_reuses_the_graph_disabling_compiles_once(tmp_path):
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    flux = models.tiny_flux()
    path = write(tmp_path, diffusers_lora(flux, "transformer", linears(flux, "attn.to_", "ff.net")))
    transformdsl.transform(flux, script(path, "fuse qkv\nquantize int8 weight_only=true\ncompile fullgraph=true "
                                        "backend=eager", merge="false"))

    def graphs():
        return dynamo_utils.counters["stats"]["unique_graphs"]

    first = models.run(flux)
    compiled = graphs()
    transformdsl.set_lora(flux, "style", 0.3)
    scaled = models.run(flux)
    assert graphs() == compiled and not torch.equal(first, scaled)  # the scale is a buffer the graph reads
    transformdsl.set_lora(flux, "style", enabled=False)
    off = models.run(flux)
    assert graphs() == compiled + 1  # `enabled` is guarded: one more graph...
    transformdsl.set_lora(flux, "style", enabled=True)
    assert torch.equal(models.run(flux), scaled)
    transformdsl.set_lora(flux, "style", enabled=False)
    assert torch.equal(models.run(flux), off) and graphs() == compiled + 1  # ...then both are cached
    torch._dynamo.reset()


def test_an_in_clause_narrows_the_modules_the_file_names(tmp_path):
    flux = models.tiny_flux()
    sd = diffusers_lora(flux, "transformer", linears(flux, "attn.to_"))
    path = write(tmp_path, sd)
    before = {k: v.clone() for k, v in flux.state_dict().items()}
    plan = transformdsl.plan(flux, f'lora "{path}" in single_transformer_blocks')
    assert plan.steps[0].targets == ["single_transformer_blocks"]
    assert "6 module(s)" in plan.steps[0].notes[0]  # to_q, to_k, to_v of the two single blocks
    transformdsl.transform(flux, plan)
    changed = {k.rsplit(".", 1)[0] for k, v in flux.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("single_transformer_blocks.") for k in changed)


def test_a_rank_0_or_empty_lora_file_is_refused_at_plan_time(tmp_path):
    """A file that would divide by its rank when applied, or apply nothing, is a plan error naming it."""
    import torch
    from safetensors.torch import save_file

    import transformdsl
    from transformdsl import models

    flux = models.tiny_flux()
    names = [n for n, _ in flux.named_modules() if n.endswith("attn.to_q")]
    save_file({f"transformer.{n}.lora_{x}.weight": torch.zeros(0, 16) if x == "A" else torch.zeros(16, 0)
               for n in names for x in "AB"}, tmp_path / "rank0.safetensors")
    save_file({}, tmp_path / "empty.safetensors")
    with pytest.raises(transformdsl.ScriptError, match="rank0.safetensors: '.*' has rank 0"):
        transformdsl.plan(flux, f'lora "{tmp_path / "rank0.safetensors"}"')
    with pytest.raises(transformdsl.ScriptError, match="empty.safetensors: the file holds no LoRA pair"):
        transformdsl.plan(flux, f'lora "{tmp_path / "empty.safetensors"}"')
