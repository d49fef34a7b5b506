"""Saving and loading untransformed models (spec.md "Save format"); the basics, not hostile files.

Round trips are compared bit for bit: the same class, the same state_dict keys in the same order,
every tensor equal with the same dtype, non-persistent buffers too, tied weights tied again, and
the same output on the same inputs.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import transformdsl
from transformdsl.errors import LoadError
from transformdsl.models import BUILTIN, run
from transformdsl.persist import inspect

MODULES = ["unet", "sd3", "flux", "llama", "gpt2"]


def all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict plus non-persistent buffers (what a save holds)."""
    tensors = dict(model.state_dict())
    for name, buffer in model.named_buffers(remove_duplicate=False):
        tensors.setdefault(name, buffer)
    return tensors


def assert_same_model(loaded: torch.nn.Module, original: torch.nn.Module) -> None:
    assert type(loaded) is type(original)
    assert list(loaded.state_dict()) == list(original.state_dict())
    want, got = all_tensors(original), all_tensors(loaded)
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert not any(t.is_meta for t in got.values())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (original model, directory it was saved to), each built and saved once."""
    root = tmp_path_factory.mktemp("saved")
    cache = {}

    def get(name: str):
        if name not in cache:
            model = BUILTIN[name]()
            cache[name] = (model, transformdsl.save(model, root / name))
        return cache[name]

    return get


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", MODULES)
def test_round_trip_is_bit_equal(saved, name):
    model, directory = saved(name)
    loaded = transformdsl.load(directory)
    assert loaded is not model
    assert_same_model(loaded, model)
    assert not loaded.training
    assert torch.equal(run(loaded), run(model))


def test_save_directory_layout(saved):
    model, directory = saved("llama")
    assert sorted(os.listdir(directory)) == ["model.safetensors", "script.tfm", "transformdsl.json"]
    meta = json.loads((directory / "transformdsl.json").read_text())
    assert (meta["format"], meta["format_version"], meta["kind"]) == ("transformdsl", 1, "module")
    assert meta["model"]["library"] == "transformers" and meta["model"]["class"] == "LlamaForCausalLM"
    assert (meta["scripts"], meta["steps"]) == ([], [])
    assert meta["tensors"]["files"] == ["model.safetensors"]


def test_nonpersistent_buffers_are_saved_and_restored(saved):
    model, directory = saved("llama")
    nonpersistent = sorted(set(dict(model.named_buffers())) - set(model.state_dict()))
    assert "model.rotary_emb.inv_freq" in nonpersistent
    meta = json.loads((directory / "transformdsl.json").read_text())
    assert meta["tensors"]["nonpersistent"] == nonpersistent
    loaded = transformdsl.load(directory)
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert "model.rotary_emb.inv_freq" not in loaded.state_dict()  # still non-persistent


def test_tied_weights_are_saved_once_and_tied_again(saved):
    model, directory = saved("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    meta = json.loads((directory / "transformdsl.json").read_text())
    assert meta["tensors"]["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    loaded = transformdsl.load(directory)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


# --------------------------------------------------------------------------- model=


def test_load_into_a_template_leaves_it_untouched(saved):
    model, directory = saved("flux")
    template = BUILTIN["flux"](seed=1)
    before = {k: v.clone() for k, v in all_tensors(template).items()}
    loaded = transformdsl.load(directory, model=template)
    assert loaded is not template
    assert_same_model(loaded, model)
    after = all_tensors(template)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not any(t.is_meta for t in after.values())


@pytest.mark.parametrize("factory", [BUILTIN["flux"], lambda: BUILTIN["flux"](seed=3)], ids=["builtin", "lambda"])
def test_load_with_a_factory(saved, factory):
    model, directory = saved("flux")
    loaded = transformdsl.load(directory, model=factory)
    assert_same_model(loaded, model)


def test_load_with_a_factory_ties_weights(saved):
    model, directory = saved("gpt2")
    calls = []

    def factory():
        calls.append(1)
        return BUILTIN["gpt2"](seed=3)

    loaded = transformdsl.load(directory, model=factory)
    assert calls == [1]
    assert_same_model(loaded, model)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


# --------------------------------------------------------------------------- shards


def test_sharded_save_writes_shards_and_an_index(tmp_path):
    model = BUILTIN["flux"]()
    directory = transformdsl.save(model, tmp_path / "flux", max_shard_size=20_000)
    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    count = len(shards)
    assert count > 2
    assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert not (directory / "model.safetensors").exists()
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    meta = json.loads((directory / "transformdsl.json").read_text())
    assert meta["tensors"]["files"] == shards
    assert_same_model(transformdsl.load(directory), model)


# --------------------------------------------------------------------------- pipelines


def test_pipeline_saves_and_reloads_as_a_pipeline(tmp_path):
    pipe = BUILTIN["sd-pipeline"]()
    directory = transformdsl.save(pipe, tmp_path / "pipe")
    assert {"model_index.json", "transformdsl.json", "unet", "vae", "text_encoder", "tokenizer",
            "scheduler"} <= set(os.listdir(directory))
    meta = json.loads((directory / "transformdsl.json").read_text())
    assert (meta["kind"], meta["pipeline_class"]) == ("pipeline", "StableDiffusionPipeline")
    loaded = transformdsl.load(directory)
    assert type(loaded) is type(pipe)
    for name in ("unet", "vae", "text_encoder"):
        assert_same_model(loaded.components[name], pipe.components[name])
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(run(loaded), run(pipe))


def test_a_saved_pipeline_takes_no_model_argument(tmp_path):
    directory = transformdsl.save(BUILTIN["sd-pipeline"](), tmp_path / "pipe")
    with pytest.raises(LoadError, match="a saved pipeline is loaded from its files alone; drop model="):
        transformdsl.load(directory, model=BUILTIN["unet"]())


# --------------------------------------------------------------------------- saving over a save


def test_saving_over_an_existing_save_replaces_it(tmp_path):
    directory = tmp_path / "model"
    transformdsl.save(BUILTIN["flux"](), directory, max_shard_size=20_000)
    gpt2 = BUILTIN["gpt2"]()
    transformdsl.save(gpt2, directory)
    assert sorted(os.listdir(directory)) == ["model.safetensors", "script.tfm", "transformdsl.json"]
    assert_same_model(transformdsl.load(directory), gpt2)
    assert os.listdir(tmp_path) == ["model"]  # no temporary or old copy left beside it


def test_saving_over_a_loaded_model_keeps_it_usable(tmp_path):
    # load() maps the files; save() writes a new directory and swaps it in, never rewriting them.
    directory = tmp_path / "model"
    transformdsl.save(BUILTIN["llama"](), directory)
    loaded = transformdsl.load(directory)
    expected = run(loaded)
    transformdsl.save(BUILTIN["llama"](seed=5), directory)
    assert torch.equal(run(loaded), expected)


# --------------------------------------------------------------------------- inspect


def test_inspect_reports_dtypes_and_bytes(tmp_path):
    model = BUILTIN["llama"]()
    model.lm_head.to(torch.bfloat16)
    model.model.embed_tokens.to(torch.float16)
    directory = transformdsl.save(model, tmp_path / "llama")
    expected: dict[str, dict[str, int]] = {}
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    for tensor in all_tensors(model).values():
        entry = expected.setdefault(names[tensor.dtype], {"tensors": 0, "elements": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["elements"] += tensor.numel()
        entry["bytes"] += tensor.numel() * tensor.element_size()
    info = inspect(directory)
    assert info["tensors"] == expected
    assert (info["kind"], info["model"], info["library"], info["files"]) == (
        "module", "LlamaForCausalLM", "transformers", ["model.safetensors"])


def test_round_trip_of_a_bfloat16_model(tmp_path):
    model = BUILTIN["llama"]().to(torch.bfloat16)
    directory = transformdsl.save(model, tmp_path / "llama")
    assert_same_model(transformdsl.load(directory), model)


# --------------------------------------------------------------------------- what is wrong


def copy_of(saved, name, tmp_path):
    _, directory = saved(name)
    return shutil.copytree(directory, tmp_path / name)


@pytest.mark.parametrize("keep", [0.5, 0.99, 4 / 1e9])
def test_truncated_safetensors_file(saved, tmp_path, keep):
    directory = copy_of(saved, "flux", tmp_path)
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: max(4, int(len(data) * keep))])
    with pytest.raises(LoadError) as info:
        transformdsl.load(directory)
    assert str(info.value).startswith(f"{path}: corrupt or truncated safetensors file: ")


def test_missing_tensor_file(saved, tmp_path):
    directory = copy_of(saved, "flux", tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="^" + str(directory / "model.safetensors") + ": missing tensor file"):
        transformdsl.load(directory)


def test_missing_shard(tmp_path):
    directory = transformdsl.save(BUILTIN["flux"](), tmp_path / "flux", max_shard_size=20_000)
    second = sorted(directory.glob("model-*.safetensors"))[1]
    second.unlink()
    with pytest.raises(LoadError, match="^" + str(second) + ": missing tensor file"):
        transformdsl.load(directory)


def test_tensors_of_another_architecture(saved, tmp_path):
    directory = copy_of(saved, "flux", tmp_path)
    _, sd3 = saved("sd3")
    shutil.copy(sd3 / "model.safetensors", directory / "model.safetensors")
    with pytest.raises(LoadError) as info:
        transformdsl.load(directory)
    message = str(info.value)
    assert message.startswith(f"{directory}: the saved tensors do not match the architecture (missing ")
    assert "; unexpected " in message and "pos_embed.proj.weight" in message
    assert message.endswith("was it saved from another model?")


def test_loading_into_another_architecture(saved):
    _, directory = saved("flux")
    with pytest.raises(LoadError, match="the saved tensors do not match the architecture .*was it saved from "
                                        "another model\\?$"):
        transformdsl.load(directory, model=BUILTIN["sd3"]())


def test_tensor_of_another_shape(saved, tmp_path):
    _, directory = saved("llama")
    bigger = BUILTIN["llama"]()
    bigger.lm_head = torch.nn.Linear(64, 300, bias=False)
    other = transformdsl.save(bigger, tmp_path / "bigger")
    shutil.copy(other / "model.safetensors", tmp_path / "x.safetensors")
    target = shutil.copytree(directory, tmp_path / "llama")
    shutil.copy(tmp_path / "x.safetensors", target / "model.safetensors")
    with pytest.raises(LoadError, match=r"tensor 'lm_head.weight' is float32\[300, 64\] in the file but the model "
                                        r"expects float32\[256, 64\]; was it saved from another model\?"):
        transformdsl.load(target)


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "nope", "no such directory"),
    (lambda d: d, "not a transformdsl save (transformdsl.json is missing)"),
])
def test_not_a_save(tmp_path, make, message):
    directory = make(tmp_path)
    with pytest.raises(LoadError, match="^" + str(directory) + ": " + message.replace("(", r"\(").replace(")", r"\)")):
        transformdsl.load(directory)
