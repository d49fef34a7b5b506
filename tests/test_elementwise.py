"""``fuse bias_act_dropout | bias_dropout_residual | bias_dropout_residual_layernorm``.

Every test but the last runs the fused functions uncompiled (``kernel=eager``): the same
formula as the inductor kernel, without paying for a compiler; the last one compiles.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transformdsl
from transformdsl import models
from transformdsl.transforms.elementwise import FUSED
from transformdsl.transforms.elementwise import patterns as elementwise
from transformdsl.transforms.elementwise.patterns import FusedModule, activation_kind

EAGER = " kernel=eager"


def fused_paths(model: nn.Module) -> list[str]:
    return [path for path, m in model.named_modules() if isinstance(m, FusedModule)]


def tiny_bert(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """A transformers ``BertModel``: its ``SelfOutput``/``Output`` end in dense → dropout →
    residual → LayerNorm at a module boundary (the built-in models have no such boundary).
    A large ``layer_norm_eps`` makes a norm that ignored it visibly wrong."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, layer_norm_eps=0.1,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BertModel(config).eval()


def run_bert(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).last_hidden_state


@pytest.fixture(autouse=True)
def _switch_default():
    FUSED.set(None)
    yield
    FUSED.set(None)


# --------------------------------------------------------------------------- matching and numerics

EXPECTED_MLP = {
    "unet": (4, "FusedFeedForward", "hidden * gelu(gate)"),  # GEGLU
    "sd3": (3, "FusedFeedForward", "gelu(tanh)"),
    "flux": (2, "FusedFeedForward", "gelu(tanh)"),
    "llama": (2, "FusedLlamaMLP", "silu(gate_proj) * (up_proj) (no bias"),
    "gpt2": (2, "FusedGPT2MLP", "c_fc → +bias → gelu(tanh); c_proj → +bias → dropout"),
}


@pytest.mark.parametrize("name", list(EXPECTED_MLP))
def test_bias_act_dropout_on_builtin_models(name):
    model = models.BUILTIN[name]()
    want = models.run(model)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    the_plan = transformdsl.plan(model, "fuse bias_act_dropout" + EAGER)
    count, cls_name, text = EXPECTED_MLP[name]
    assert len(the_plan.steps[0].targets) == count
    assert any(text in note for note in the_plan.steps[0].notes)

    transformdsl.transform(model, the_plan)
    paths = fused_paths(model)
    assert len(paths) == count and type(model.get_submodule(paths[0])).__name__ == cls_name
    assert {k: v.shape for k, v in model.state_dict().items()} == keys  # same keys, same order, same shapes
    torch.testing.assert_close(models.run(model), want, rtol=1e-5, atol=1e-5)
    with FUSED.turned(False):  # the runtime switch: the original forward, bit for bit
        assert torch.equal(models.run(model), want)


def test_checkpoints_load_both_ways():
    """A pretrained checkpoint of the original loads into the fused model, and back."""
    fused = transformdsl.transform(models.tiny_gpt2(seed=0), "fuse bias_act_dropout" + EAGER)
    pretrained = models.tiny_gpt2(seed=1)
    fused.load_state_dict(pretrained.state_dict(), strict=True)
    torch.testing.assert_close(models.run(fused), models.run(pretrained), rtol=1e-5, atol=1e-5)

    original = models.tiny_gpt2(seed=2)
    original.load_state_dict(fused.state_dict(), strict=True)
    assert torch.equal(models.run(original), models.run(pretrained))


def test_residual_layernorm_keeps_eps_and_keys():
    model = tiny_bert()
    want = run_bert(model)
    keys = list(model.state_dict())
    the_plan = transformdsl.plan(model, "fuse bias_dropout_residual_layernorm" + EAGER)
    step = the_plan.steps[0]
    assert step.targets == ["encoder.layer.0.attention.output", "encoder.layer.0.output",
                            "encoder.layer.1.attention.output", "encoder.layer.1.output"]
    # BertLayer is selected (*Layer) but has no chain at its own boundary; ViT-like
    # SelfAttention modules are not selected at all.
    reasons = dict(step.skipped)
    assert "encoder.layer.0" in reasons
    transformdsl.transform(model, the_plan)
    assert list(model.state_dict()) == keys
    assert type(model.encoder.layer[0].output).__name__ == "FusedBertOutput"
    torch.testing.assert_close(run_bert(model), want, rtol=1e-5, atol=1e-5)  # eps=0.1 kept


def test_residual_without_norm_and_wrong_mode():
    model = tiny_bert()
    want = run_bert(model)
    transformdsl.transform(model, "fuse bias_dropout_residual in encoder.layer.0" + EAGER)
    assert fused_paths(model) == ["encoder.layer.0.attention.output", "encoder.layer.0.output"]
    torch.testing.assert_close(run_bert(model), want, rtol=1e-5, atol=1e-5)
    # A second statement over the same modules: already fused, a near miss.
    again = transformdsl.plan(model, "fuse bias_dropout_residual_layernorm in encoder.layer.0.output")
    assert again.steps[0].skipped == [("encoder.layer.0.output", "already fused by an earlier statement")]


def test_near_misses_name_the_reason():
    gpt2 = models.tiny_gpt2()
    step = transformdsl.plan(gpt2, "fuse bias_dropout_residual").steps[0]
    assert step.targets == []
    reason = dict(step.skipped)["transformer.h.0"]
    assert "GPT2Block.forward()" in reason and "residual" in reason and "not at a module boundary" in reason

    flux = models.tiny_flux()
    notes = transformdsl.plan(flux, "fuse bias_act_dropout").steps[0].notes
    assert any(n.startswith("near miss (not selected): FluxSingleTransformerBlock: proj_mlp") for n in notes)

    unet = models.tiny_unet()
    step = transformdsl.plan(unet, "fuse bias_dropout_residual_layernorm").steps[0]
    reasons = {reason for _, reason in step.skipped}
    assert any("BasicTransformerBlock.forward()" in r for r in reasons)


class LooksLikeResidual(nn.Module):
    """The shape of BERT's SelfOutput, but no residual add (like ViT's SelfOutput)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.0)
        self.LayerNorm = nn.LayerNorm(8)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)))


def test_probe_rejects_a_forward_that_computes_something_else():
    model = nn.Sequential(LooksLikeResidual())
    step = transformdsl.plan(model, "fuse bias_dropout_residual_layernorm 0").steps[0]
    assert step.targets == []
    assert "computes something else" in step.skipped[0][1]
    # verify=false trusts the structure (and would be wrong here): the option is an escape hatch.
    assert transformdsl.plan(model, "fuse bias_dropout_residual_layernorm 0 verify=false").steps[0].targets == ["0"]


@pytest.mark.parametrize(("activation", "kind"), [("gelu", "gelu"), ("gelu-approximate", "gelu_tanh"),
                                                  ("geglu", "gelu"), ("swiglu", "silu"),
                                                  ("geglu-approximate", "quick_gelu")])
def test_feedforward_keeps_the_activation(activation, kind):
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    model = nn.Sequential(FeedForward(16, activation_fn=activation, final_dropout=True)).eval()
    x = torch.randn(2, 5, 16)
    want = model(x)
    transformdsl.transform(model, "fuse bias_act_dropout" + EAGER)
    assert model[0]._tdsl_act == kind
    torch.testing.assert_close(model(x), want, rtol=1e-6, atol=1e-6)  # gelu vs gelu(tanh) differ ~1e-3


def test_transformers_activations():
    from transformers.activations import ACT2FN

    expected = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "quick_gelu": "quick_gelu", "silu": "silu", "relu": "relu", "mish": None}
    assert {name: activation_kind(ACT2FN[name]) for name in expected} == expected
    assert activation_kind(nn.GELU(approximate="tanh")) == "gelu_tanh"


def test_train_mode_keeps_dropout():
    """Same seed, same draws: the fused path consumes the RNG exactly as the original."""
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    model = nn.Sequential(FeedForward(16, dropout=0.5, activation_fn="gelu", final_dropout=True)).train()
    x = torch.randn(4, 8, 16)
    torch.manual_seed(1)
    want = model(x)
    transformdsl.transform(model, "fuse bias_act_dropout" + EAGER)
    torch.manual_seed(1)
    got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model(x), got)  # still random in train mode
    model.eval()
    assert torch.allclose(model(x), model(x))


def test_switch_environment_and_function(monkeypatch):
    model = transformdsl.transform(models.tiny_llama(), "fuse bias_act_dropout" + EAGER)
    calls = []
    original = elementwise.GatedMLPChain._fused_forward
    monkeypatch.setattr(elementwise.GatedMLPChain, "_fused_forward",
                        lambda self, x: calls.append(1) or original(self, x))
    models.run(model)
    assert len(calls) == 2
    monkeypatch.setenv(FUSED.environment, "1")
    FUSED.set(None)  # re-read the environment
    assert not FUSED.enabled
    models.run(model)
    assert len(calls) == 2  # no fused call: the unfused path
    FUSED.set(True)
    models.run(model)
    assert len(calls) == 4


def test_rollback_restores_the_original_modules(monkeypatch):
    model = models.tiny_gpt2()
    before = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    want = models.run(model)

    def boom(self, ctx, targets):
        raise RuntimeError("injected")

    from transformdsl import registry

    monkeypatch.setattr(registry.get("compile"), "apply", boom)  # the statement after the fusion fails
    script = "fuse bias_act_dropout" + EAGER + "; compile"
    with pytest.raises(transformdsl.TransformError, match="injected"):
        transformdsl.transform(model, script)
    assert fused_paths(model) == []
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert torch.equal(models.run(model), want)


def test_save_and_load_rebuild_the_fused_modules(tmp_path):
    model = transformdsl.transform(models.tiny_gpt2(), "fuse bias_act_dropout" + EAGER)
    want = models.run(model)
    transformdsl.save(model, tmp_path / "fused")
    loaded = transformdsl.load(tmp_path / "fused")
    assert fused_paths(loaded) == fused_paths(model)
    assert list(loaded.state_dict()) == list(model.state_dict())
    torch.testing.assert_close(models.run(loaded), want, rtol=0, atol=0)


def test_pickle_and_deepcopy():
    """torch.save(model) works: the pickle names the pattern and the original class."""
    import copy
    import io
    import pickle

    model = transformdsl.transform(models.tiny_gpt2(), "fuse bias_act_dropout")  # inductor kernels: unpicklable
    mlp = model.transformer.h[0].mlp
    state = mlp.__reduce_ex__(2)
    assert "_tdsl_fn" not in state[2] and state[1][1].__name__ == "GPT2MLP"
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(twin.transformer.h[0].mlp) is type(mlp) and twin.transformer.h[0].mlp._tdsl_fn is mlp._tdsl_fn
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with FUSED.turned(False):  # no compiling here; the fused path is checked elsewhere
        assert torch.equal(models.run(loaded), models.run(model))


def test_fused_then_quantized_saves_and_reloads(tmp_path):
    """quantize runs after the fusion and swaps the projections inside fused modules: they run whole."""
    from transformdsl.extend import Transform

    if transformdsl.registry.get("quantize int8").apply is Transform.apply:
        pytest.skip("the quantize pass has not landed yet")
    quantized = transformdsl.transform(models.tiny_gpt2(), "quantize int8")
    both = transformdsl.transform(models.tiny_gpt2(), "fuse bias_act_dropout" + EAGER + "; quantize int8")
    assert len(fused_paths(both)) == 2 and type(both.transformer.h[0].mlp.c_fc) is type(quantized.transformer.h[0].mlp.c_fc)
    want = models.run(quantized)
    torch.testing.assert_close(models.run(both), want, rtol=1e-5, atol=1e-5)
    transformdsl.save(both, tmp_path / "q")
    loaded = transformdsl.load(tmp_path / "q")
    assert fused_paths(loaded) == fused_paths(both)
    torch.testing.assert_close(models.run(loaded), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_inductor_kernels_and_whole_model_compile():
    """The compiled kernels agree with eager, and fused modules trace whole (fullgraph)."""
    model = models.tiny_gpt2()
    want = models.run(model)
    transformdsl.transform(model, "fuse bias_act_dropout")
    torch.testing.assert_close(models.run(model), want, rtol=1e-5, atol=1e-5)
    transformdsl.transform(model, "compile fullgraph=true backend=aot_eager")
    torch.testing.assert_close(models.run(model), want, rtol=1e-5, atol=1e-5)
    with FUSED.turned(False):  # the switch is a guard: flipping it retraces, it does not go stale
        torch.testing.assert_close(models.run(model), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["bias_dropout_residual", "bias_dropout_residual_layernorm"])
def test_bert_residual_chains_reload_with_load_alone(tmp_path, mode):
    """The record check on load sees the chain as the mode applied it (with or without the norm)."""
    model = tiny_bert()
    transformdsl.transform(model, f"fuse {mode} kernel=eager")
    expected = run_bert(model)
    transformdsl.save(model, tmp_path / "bert")
    reloaded = transformdsl.load(tmp_path / "bert")
    assert torch.equal(run_bert(reloaded), expected)
