"""The built-in tiny models: real classes, deterministic, the expected attention layout, --model SPEC."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from transformdsl import LoadError, models

NAMES = list(models.BUILTIN)
ROOT = Path(__file__).resolve().parent.parent


def module_parts(model):
    """The nn.Modules of a model or of a pipeline."""
    if isinstance(model, nn.Module):
        return [model]
    return [c for c in model.components.values() if isinstance(c, nn.Module)]


def state(model):
    return {f"{i}.{k}": v for i, part in enumerate(module_parts(model)) for k, v in part.state_dict().items()}


def by_class(model, class_name):
    return {path: m for path, m in model.named_modules() if type(m).__name__ == class_name}


# --------------------------------------------------------------------------- every built-in


def test_registry_names():
    assert NAMES == ["unet", "sd3", "flux", "llama", "gpt2", "sd-pipeline"]


@pytest.mark.parametrize("name", NAMES)
def test_builds_in_eval_mode_float32_on_cpu_without_touching_the_global_rng(name):
    rng = torch.get_rng_state()
    model = models.BUILTIN[name]()
    assert torch.equal(torch.get_rng_state(), rng)
    for part in module_parts(model):
        assert not any(m.training for m in part.modules())
        for tensor in [*part.parameters(), *part.buffers()]:
            assert tensor.device.type == "cpu"
            assert tensor.dtype == torch.float32 or not tensor.is_floating_point()


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_weights_and_output(name):
    first, second, other = (models.BUILTIN[name](seed=s) for s in (0, 0, 1))
    weights, again = state(first), state(second)
    assert weights.keys() == again.keys()
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    out = models.run(first)
    assert isinstance(out, torch.Tensor) and out.numel() > 0
    assert torch.isfinite(out).all()
    assert torch.equal(out, models.run(second))
    assert not torch.equal(out, models.run(other))


@pytest.mark.parametrize("name", NAMES)
def test_sample_inputs_from_a_name_equal_those_from_the_model(name):
    model = models.BUILTIN[name]()
    from_name, from_model = models.sample_inputs(name, seed=3), models.sample_inputs(model, seed=3)
    flat_name, flat_model = _flatten(from_name), _flatten(from_model)
    assert flat_name.keys() == flat_model.keys()
    for key, value in flat_name.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, flat_model[key]), key
        elif not isinstance(value, torch.Generator):
            assert value == flat_model[key], key


def _flatten(inputs):
    args, kwargs = inputs
    return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}


def test_run_output_shapes():
    assert models.run(models.tiny_unet()).shape == (2, 4, 8, 8)
    assert models.run(models.tiny_sd3()).shape == (2, 4, 8, 8)
    assert models.run(models.tiny_flux()).shape == (2, 16, 16)
    assert models.run(models.tiny_llama()).shape == (2, 8, 256)
    image = models.run(models.tiny_sd_pipeline())
    assert image.shape == (1, 32, 32, 3) and image.dtype == torch.float32
    assert 0 <= image.min() and image.max() <= 1


def test_sample_inputs_token_counts_are_multiples_of_16():
    (sample,), kwargs = models.sample_inputs("flux")
    assert sample.shape[0] * sample.shape[1] % 16 == 0
    assert kwargs["encoder_hidden_states"].shape[:2].numel() % 16 == 0
    (ids,), _ = models.sample_inputs("llama")
    assert ids.numel() % 16 == 0


def test_sample_inputs_follow_the_model_class_dtype_and_wrappers():
    class MyUNet(type(models.tiny_unet())):
        pass

    unet = MyUNet(**models.UNET_CONFIG).eval()
    (sample,), kwargs = models.sample_inputs(unet)
    assert sample.shape == (2, 4, 8, 8) and kwargs["encoder_hidden_states"].shape == (2, 8, 32)
    (sample,), kwargs = models.sample_inputs(unet.to(torch.bfloat16))
    assert sample.dtype == kwargs["encoder_hidden_states"].dtype == torch.bfloat16
    assert kwargs["timestep"].dtype == torch.int64
    (sample,), _ = models.sample_inputs(unet, dtype=torch.float16)
    assert sample.dtype == torch.float16

    gpt2 = models.tiny_gpt2()
    compiled = torch.compile(gpt2)  # nothing is compiled until it is called
    assert torch.equal(models.sample_inputs(compiled)[0][0], models.sample_inputs(gpt2)[0][0])

    with pytest.raises(ValueError, match="no sample inputs for a Linear"):
        models.sample_inputs(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="did you mean 'llama'"):
        models.sample_inputs("lama")


# --------------------------------------------------------------------------- attention layout


def test_unet_has_self_and_cross_attention():
    unet = models.tiny_unet()
    attention = by_class(unet, "Attention")
    self_attn = {p: m for p, m in attention.items() if p.endswith(".attn1")}
    cross_attn = {p: m for p, m in attention.items() if p.endswith(".attn2")}
    assert len(self_attn) == len(cross_attn) == 4 and len(attention) == 8
    assert not any(m.is_cross_attention for m in self_attn.values())
    assert all(m.is_cross_attention for m in cross_attn.values())
    for m in cross_attn.values():  # k/v read the 32-wide text states, q the image features
        assert m.to_k.in_features == m.to_v.in_features == unet.config.cross_attention_dim == 32
    assert {m.to_q.in_features for m in cross_attn.values()} == {32, 64}
    for m in self_attn.values():
        assert m.to_k.in_features == m.to_v.in_features == m.to_q.in_features
    assert all(hasattr(m, "to_q") and hasattr(m, "to_out") for m in attention.values())


def test_sd3_has_joint_attention_and_a_context_pre_only_last_block():
    sd3 = models.tiny_sd3()
    attention = [block.attn for block in sd3.transformer_blocks]
    assert len(attention) == 2
    for attn in attention:
        assert all(hasattr(attn, n) for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"))
    assert attention[0].to_add_out is not None
    assert sd3.transformer_blocks[-1].context_pre_only
    assert getattr(attention[-1], "to_add_out", None) is None


def test_flux_has_double_and_pre_only_single_blocks():
    flux = models.tiny_flux()
    assert len(flux.transformer_blocks) == 1 and len(flux.single_transformer_blocks) == 2
    double = flux.transformer_blocks[0].attn
    assert type(double).__name__ == "FluxAttention" and not double.pre_only
    assert hasattr(double, "add_q_proj") and hasattr(double, "to_out")
    for block in flux.single_transformer_blocks:
        assert type(block.attn).__name__ == "FluxAttention"
        assert block.attn.pre_only and not hasattr(block.attn, "to_out")


def test_llama_has_grouped_query_attention():
    llama = models.tiny_llama()
    attention = by_class(llama, "LlamaAttention")
    assert len(attention) == 2
    for attn in attention.values():
        assert attn.q_proj.out_features == 64
        assert attn.k_proj.out_features == attn.v_proj.out_features == 32 < attn.q_proj.out_features
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()


def test_gpt2_has_fused_conv1d_attention():
    gpt2 = models.tiny_gpt2()
    attention = by_class(gpt2, "GPT2Attention")
    assert len(attention) == 2
    for attn in attention.values():
        assert type(attn.c_attn).__name__ == "Conv1D" and attn.c_attn.weight.shape == (64, 192)
        assert type(attn.c_proj).__name__ == "Conv1D"


def test_pipeline_parts_fit_together():
    pipe = models.tiny_sd_pipeline()
    unet = models.tiny_unet()
    assert pipe.unet.state_dict().keys() == unet.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(pipe.unet.state_dict().values(), unet.state_dict().values()))
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert pipe.unet.config.cross_attention_dim == pipe.text_encoder.config.hidden_size
    assert pipe.safety_checker is None and pipe.feature_extractor is None
    assert len(pipe.tokenizer) == pipe.text_encoder.config.vocab_size
    ids = pipe.tokenizer("a cat").input_ids
    assert ids == [
        pipe.tokenizer.bos_token_id,
        *pipe.tokenizer.convert_tokens_to_ids(["a</w>", "cat</w>"]),
        pipe.tokenizer.eos_token_id,
    ]


# --------------------------------------------------------------------------- --model SPEC


@pytest.mark.parametrize("name", ["llama", "sd3"])
def test_resolve_builtin(name):
    model = models.resolve_model(name)
    assert type(model) is type(models.BUILTIN[name]())
    assert torch.equal(models.run(model), models.run(models.BUILTIN[name]()))


@pytest.mark.parametrize("name", ["gpt2", "unet", "sd-pipeline"])
def test_resolve_save_pretrained_directory(tmp_path, name):
    model = models.BUILTIN[name]()
    model.save_pretrained(tmp_path / "saved", safe_serialization=True)
    loaded = models.resolve_model(str(tmp_path / "saved"))
    assert type(loaded) is type(model)
    assert all(not p.training for p in module_parts(loaded))
    assert torch.equal(models.run(loaded), models.run(model))


def test_resolve_module_factory(tmp_path, monkeypatch):
    gpt2 = models.resolve_model("transformdsl.models:tiny_gpt2")
    assert type(gpt2).__name__ == "GPT2LMHeadModel"
    assert torch.equal(models.run(gpt2), models.run(models.tiny_gpt2()))

    # A module in the current directory, a dotted attribute path, a model left in train mode.
    (tmp_path / "tdsl_factory_module.py").write_text(
        "import torch\n"
        "class Models:\n"
        "    @staticmethod\n"
        "    def mlp():\n"
        "        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # as the installed CLI
    monkeypatch.delitem(sys.modules, "tdsl_factory_module", raising=False)
    mlp = models.resolve_model("tdsl_factory_module:Models.mlp")
    assert isinstance(mlp, nn.Sequential) and not mlp.training
    assert str(tmp_path) not in sys.path
    sys.modules.pop("tdsl_factory_module", None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("unett", r"unknown built-in model 'unett' \(did you mean 'unet'\?\); built-ins: unet, sd3, flux, llama"),
        ("sd_pipeline", r"did you mean 'sd-pipeline'"),
        ("", "needs a built-in name"),
        ("./no-such-dir", "no such directory"),
        ("no_such_module_tdsl:build", "cannot import module 'no_such_module_tdsl'"),
        ("json:loadz", r"'json' has no attribute 'loadz' \(did you mean 'load"),
        ("math:pi", "is a float, not a callable factory"),
        ("os:getcwd", "the factory returned a str; expected a torch.nn.Module"),
    ],
)
def test_resolve_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        models.resolve_model(spec)


def test_resolve_directory_errors(tmp_path):
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        models.resolve_model(str(tmp_path / "file.txt"))
    with pytest.raises(ValueError, match="not a model directory"):
        models.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ValueError, match="names neither a diffusers class"):
        models.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "NoSuchModel"}))
    with pytest.raises(ValueError, match="diffusers has no class 'NoSuchModel'"):
        models.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(LoadError, match="cannot load transformers.GPT2LMHeadModel: no safetensors weights"):
        models.resolve_model(str(tmp_path))  # no weights


def test_importing_the_module_imports_neither_diffusers_nor_transformers():
    code = "import sys, transformdsl.models; print(sorted({'diffusers', 'transformers'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"
