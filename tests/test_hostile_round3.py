"""Hostile inputs, round 3: what a party sharing a model directory could still do to convert,
imports of stock checkpoints, placement, saves and the command line's ``--model DIR``.

Each test is one attack, with its exact input: it gets a clear ``LoadError``/``TransformError``
or bounded work, runs no code from the directory, opens no socket, writes nothing outside the
output and loses none of the user's files.  Real diffusers/transformers classes built from
small configurations; a sentinel module records any execution; a socket guard any connection.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformdsl
from transformdsl import LoadError, models
from transformdsl.persist import inspect

ROOT = Path(__file__).resolve().parent.parent
SENTINEL_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection attempt is recorded and refused."""
    attempts: list = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError("network use during a hostile-input test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the library must force it itself
    yield attempts


def files_under(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- convert of our own saves


def test_convert_of_a_save_of_an_untied_lm_matches_load_transform_save(tmp_path):
    """A transformdsl save of an LM with untied embeddings (lm_head after the rotary table) converts:
    before, 'saved buffer model.rotary_emb.inv_freq does not exist in this architecture'."""
    model = models.tiny_llama()
    assert not model.config.tie_word_embeddings
    transformdsl.save(model, tmp_path / "save")
    converted = transformdsl.convert(tmp_path / "save", "quantize int8", tmp_path / "converted")
    reference = transformdsl.transform(transformdsl.load(tmp_path / "save"), "quantize int8")
    assert torch.equal(models.run(transformdsl.load(converted)), models.run(reference))


def test_convert_refuses_a_save_in_a_librarys_layout(tmp_path):
    """``save(format="transformers")`` holds the library's key layout (here an empty mapping: int8
    keeps bitsandbytes' names): documented as refused, it was converted silently."""
    model = transformdsl.transform(models.tiny_llama(), "quantize int8")
    transformdsl.save(model, tmp_path / "exported", format="transformers")
    with pytest.raises(LoadError, match="in a library's layout cannot be converted; load and save it"):
        transformdsl.convert(tmp_path / "exported", "fp8 storage", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- offload folders


@pytest.fixture(scope="module")
def small_save(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("small") / "save"
    transformdsl.save(models.tiny_llama(), directory)
    return directory


DISK_MAP = {"": "cpu", "model.layers.1": "disk"}


def test_offload_folder_that_is_the_save_itself_is_refused_and_the_save_kept(small_save, copy_of):
    """``load(save, device_map=..., offload_folder=save)`` overwrote the save's model.safetensors."""
    save = copy_of(small_save)
    before = files_under(save)
    with pytest.raises(LoadError, match="inside the directory being loaded"):
        transformdsl.load(save, device_map=DISK_MAP, offload_folder=save)
    assert files_under(save) == before
    transformdsl.load(save)


def test_offload_folder_that_is_another_save_is_refused_and_that_save_kept(small_save, tmp_path):
    """The offload folder being another model of the user's: it was overwritten."""
    other = tmp_path / "other"
    transformdsl.save(models.tiny_llama(seed=1), other)
    library = tmp_path / "library"
    models.tiny_gpt2().save_pretrained(library, safe_serialization=True)
    for victim in (other, library, other / "sub"):
        before = files_under(victim.parent if victim.name == "sub" else victim)
        with pytest.raises(LoadError, match="is a saved model, and offloading there would write into it"):
            transformdsl.load(small_save, device_map=DISK_MAP, offload_folder=victim)
        assert files_under(victim.parent if victim.name == "sub" else victim) == before
    assert not (other / "sub").exists()


def test_offload_files_go_to_a_fresh_subfolder_and_replace_nothing(small_save, tmp_path):
    """A folder holding the user's files, named as an offload file would be: untouched."""
    folder = tmp_path / "offload"
    folder.mkdir()
    (folder / "model.layers.1.safetensors").write_bytes(b"the user's file")
    reference = transformdsl.load(small_save)
    placed = transformdsl.load(small_save, device_map=DISK_MAP, offload_folder=folder)
    assert (folder / "model.layers.1.safetensors").read_bytes() == b"the user's file"
    [fresh] = [p for p in folder.iterdir() if p.is_dir()]
    assert fresh.name.startswith("transformdsl-offload-") and (fresh / "model.layers.1.safetensors").is_file()
    assert torch.equal(models.run(placed), models.run(reference))


def test_offload_folder_that_is_a_file_or_under_one_is_a_load_error(small_save, tmp_path):
    """Raw FileExistsError / NotADirectoryError before."""
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(LoadError, match="exists and is not a directory"):
        transformdsl.load(small_save, device_map=DISK_MAP, offload_folder=tmp_path / "a_file")
    with pytest.raises(LoadError, match="a part of the path is a file"):
        transformdsl.load(small_save, device_map=DISK_MAP, offload_folder=tmp_path / "a_file" / "sub")
    assert (tmp_path / "a_file").read_text() == "x"


# --------------------------------------------------------------------------- save's siblings


def test_save_leaves_sibling_directories_that_only_look_like_its_temporaries(tmp_path):
    """``save(model, "t")`` deleted ``.t.old-2024``, ``.t.tmp-123.zzzzzz.notes`` and
    ``.t.tmp-999999.<this boot>.x``: the user's, with no marker inside."""
    from transformdsl.persist.atomic import _boot_tag

    names = [".t.old-2024", ".t.tmp-123.zzzzzz.notes", f".t.tmp-999999.{_boot_tag()}.x",
             f".t.tmp-999999.{_boot_tag()}.abcdefgh", ".t.old-999999"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
    transformdsl.save(torch.nn.Linear(2, 2), tmp_path / "t")
    transformdsl.save(torch.nn.Linear(2, 2), tmp_path / "t")  # replacing a save cleans up too
    for name in names:
        assert (tmp_path / name / "notes.txt").read_text() == "mine", name


def test_save_removes_what_its_killed_runs_left(tmp_path):
    """What a killed save leaves (a temporary with the marker, an empty temporary killed before
    the marker, a previous copy being removed with its marker) is still removed."""
    from transformdsl.persist.atomic import TMP_MARKER, _boot_id, _boot_tag

    dead = 999999  # no such process
    marked = tmp_path / f".t.tmp-{dead}.{_boot_tag()}.k2j4h5g6"
    marked.mkdir()
    (marked / "model.safetensors").write_bytes(b"partial")
    (marked / TMP_MARKER).write_text(f"{dead} {_boot_id()}\n")
    empty = tmp_path / f".t.tmp-{dead}.{_boot_tag()}.a1b2c3d4"
    empty.mkdir()
    old = tmp_path / f".t.old-{dead}"
    old.mkdir()
    (old / TMP_MARKER).write_text(f"{dead} {_boot_id()}\n")
    transformdsl.save(torch.nn.Linear(2, 2), tmp_path / "t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]
    assert not (tmp_path / "t" / TMP_MARKER).exists()


# --------------------------------------------------------------------------- --model DIR


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("stock") / "gpt2"
    models.tiny_gpt2().save_pretrained(directory, safe_serialization=True)
    return directory


def custom_code_dir(source: Path, target: Path, marker: Path) -> Path:
    """A checkpoint whose config.json sends transformers to ``target/evil.py`` (``auto_map``), the way
    a shared directory would: transformers asks "Do you wish to run the custom code? [y/N]"."""
    shutil.copytree(source, target)

    def change(config):
        config.update({"architectures": ["AutoModelForCausalLM"], "model_type": "evil",
                       "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}})

    _edit_json(target / "config.json", change)
    (target / "evil.py").write_text(SENTINEL_CODE.format(marker=str(marker)) + (
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "class EvilConfig(GPT2Config):\n    model_type = 'evil'\n"
        "class EvilModel(GPT2LMHeadModel):\n    config_class = EvilConfig\n"))
    return target


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(transformdsl.__file__).resolve().parent.parent)}
    return subprocess.run([sys.executable, "-m", "transformdsl", *args], input=stdin, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_model_dir_never_runs_custom_code_even_when_the_user_answers_yes(gpt2_dir, tmp_path):
    """``explain``/``apply --model DIR`` asked "Do you wish to run the custom code? [y/N]" and ran
    ``DIR/evil.py`` on a "y"."""
    marker = tmp_path / "ran"
    evil = custom_code_dir(gpt2_dir, tmp_path / "evil", marker)
    (tmp_path / "s.tfm").write_text("quantize int8\n")
    for command in (["explain", "--model", str(evil), str(tmp_path / "s.tfm")],
                    ["apply", "--model", str(evil), str(tmp_path / "s.tfm"), "--out", str(tmp_path / "out")]):
        result = run_cli(*command, stdin="y\ny\n")
        assert result.returncode == 1, result.stdout + result.stderr
        assert "an Auto class" in result.stderr and "custom code" not in result.stdout
        assert "Do you wish" not in result.stdout + result.stderr
        assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_model_dir_with_code_fields_is_refused_from_python_without_a_prompt(gpt2_dir, tmp_path, monkeypatch,
                                                                            no_network):
    marker = tmp_path / "ran"
    evil = custom_code_dir(gpt2_dir, tmp_path / "evil", marker)

    def no_prompt(*args, **kwargs):
        raise AssertionError("asked a question")

    monkeypatch.setattr("builtins.input", no_prompt)
    with pytest.raises(LoadError, match="an Auto class"):
        models.resolve_model(str(evil))
    with pytest.raises(LoadError, match="not a transformers model class"):
        transformdsl.convert(evil, "quantize int8", tmp_path / "out")
    # a model class of transformers' own, with the auto_map still there: the code fields are refused
    _edit_json(evil / "config.json", lambda c: c.update({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(LoadError, match="names code to run"):
        models.resolve_model(str(evil))
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert no_network == []


@pytest.fixture(scope="module")
def upernet_dir(tmp_path_factory) -> Path:
    from transformers import ConvNextConfig, UperNetConfig, UperNetForSemanticSegmentation

    directory = tmp_path_factory.mktemp("upernet") / "upernet"
    backbone = ConvNextConfig(depths=[1, 1, 1, 1], hidden_sizes=[8, 8, 8, 8],
                              out_features=["stage1", "stage2", "stage3", "stage4"])
    config = UperNetConfig(backbone_config=backbone, hidden_size=8, auxiliary_in_channels=8, auxiliary_channels=8,
                           pool_scales=[1, 2], num_labels=2)
    UperNetForSemanticSegmentation(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.mark.parametrize("backbone", ["some-org/some-backbone", "some-backbone"])
def test_model_dir_naming_a_hub_backbone_is_refused_without_network(upernet_dir, tmp_path, backbone, no_network):
    """A UperNet ``config.json`` naming its backbone made HfApi calls and an HTTP request (it failed
    only because the hub was offline), and resolve_model raised a raw ValueError."""
    directory = Path(shutil.copytree(upernet_dir, tmp_path / "upernet"))
    assert isinstance(models.resolve_model(str(directory)), torch.nn.Module)  # the pristine one loads

    def change(config):
        config.pop("backbone_config", None)
        config.update({"backbone": backbone, "use_pretrained_backbone": False})

    _edit_json(directory / "config.json", change)
    with pytest.raises(LoadError, match="backbone"):
        models.resolve_model(str(directory))
    with pytest.raises(LoadError, match="backbone"):
        transformdsl.load(directory)
    assert no_network == []


def test_model_dir_refuses_weights_linked_from_outside(gpt2_dir, tmp_path):
    """``model.safetensors`` a symbolic link to another model's file: it was read (and apply wrote
    that model to --out)."""
    outside = tmp_path / "outside"
    models.tiny_gpt2(seed=1).save_pretrained(outside, safe_serialization=True)
    linked = Path(shutil.copytree(gpt2_dir, tmp_path / "linked"))
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(LoadError, match="symbolic link.*cp -rL"):
        models.resolve_model(str(linked))
    (tmp_path / "s.tfm").write_text("quantize int8\n")
    result = run_cli("apply", "--model", str(linked), str(tmp_path / "s.tfm"), "--out", str(tmp_path / "out"))
    assert result.returncode == 1 and "symbolic link" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["GPT2Config", "pipeline", "AutoModel", "PreTrainedModel"])
def test_model_dir_naming_a_class_that_is_not_a_model_is_a_clear_error(gpt2_dir, tmp_path, name):
    """``architectures: ["GPT2Config"]`` gave "'GPT2Config' object has no attribute 'components'";
    ``["pipeline"]`` "'function' object has no attribute 'from_pretrained'"."""
    directory = Path(shutil.copytree(gpt2_dir, tmp_path / "dir"))
    _edit_json(directory / "config.json", lambda c: c.update({"architectures": [name]}))
    with pytest.raises(LoadError, match=f"names '{name}', .*--model DIR loads a diffusers model class"):
        models.resolve_model(str(directory))


def test_model_dir_still_loads_stock_models_and_pipelines_with_the_same_outputs(gpt2_dir, tmp_path):
    loaded = models.resolve_model(str(gpt2_dir))
    assert torch.equal(models.run(loaded), models.run(models.tiny_gpt2()))
    pipe = models.tiny_sd_pipeline()
    pipe.save_pretrained(tmp_path / "pipe", safe_serialization=True)
    assert torch.equal(models.run(models.resolve_model(str(tmp_path / "pipe"))), models.run(pipe))


# --------------------------------------------------------------------------- sizes checked before allocating


def _peak_growth_mb(action) -> tuple[float, BaseException | None]:
    """How much the process's peak memory grew (MiB) while ``action`` ran, and what it raised."""
    def status(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise AssertionError(field)

    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    base = status("VmRSS")
    error = None
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - returned to the test
        error = exc
    return status("VmHWM") - base, error


@pytest.fixture(scope="module")
def inflated(tmp_path_factory) -> dict[str, Path]:
    """A BERT with ``max_position_embeddings: 1e8`` and an SD3 with ``pos_embed_max_size: 2048`` in
    their config.json, next to the weights of the small models they were."""
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("inflated")
    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32)).save_pretrained(root / "bert")
    _edit_json(root / "bert" / "config.json", lambda c: c.update({"max_position_embeddings": 100_000_000}))
    models.tiny_sd3().save_pretrained(root / "sd3")
    _edit_json(root / "sd3" / "config.json", lambda c: c.update({"pos_embed_max_size": 2048}))
    return {"bert": root / "bert", "sd3": root / "sd3"}


@pytest.mark.parametrize("how", ["load", "resolve_model", "convert"])
@pytest.mark.parametrize("name", ["bert", "sd3"])
def test_a_configuration_inflated_past_its_weights_is_refused_before_allocating(inflated, tmp_path, name, how):
    """Before: 2.3 GB (BERT, load and convert), 13.7 GB (BERT, --model DIR), 2.1 GB (SD3) of peak
    memory for an error that came after."""
    actions = {"load": lambda: transformdsl.load(inflated[name]),
               "resolve_model": lambda: models.resolve_model(str(inflated[name])),
               "convert": lambda: transformdsl.convert(inflated[name], "quantize int8", tmp_path / "out")}
    growth, error = _peak_growth_mb(actions[how])
    assert growth < 200, growth
    assert isinstance(error, LoadError) and "in the file but the model expects" in str(error), error
    assert not (tmp_path / "out").exists()


def test_a_layout_entry_with_a_huge_run_of_zeros_is_refused_before_allocating(tmp_path):
    """``{"op": "cat", "zeros": [[1, 134217728]]}`` allocated 512 MiB before the shape was refused."""
    model = transformdsl.transform(models.tiny_flux(), "fuse qkv")
    transformdsl.save(model, tmp_path / "save", format="diffusers")

    def change(meta):
        entry = next(e for e in meta["tensors"]["layout"] if e["key"].endswith("to_qkv.bias"))
        entry["zeros"] = [[1, 134_217_728]]

    _edit_json(tmp_path / "save" / "transformdsl.json", change)
    growth, error = _peak_growth_mb(lambda: transformdsl.load(tmp_path / "save"))
    assert growth < 100, growth
    assert isinstance(error, LoadError) and "refusing to allocate it" in str(error), error


# --------------------------------------------------------------------------- bounded work


def test_zero_size_tensors_do_not_enlarge_the_budget_of_a_library_directory(gpt2_dir, tmp_path):
    """100,000 zero-size tensors beside ``n_layer: 100000`` let convert build 40,000 blocks (400,000
    tensors: past 120 s); the budget counts tensors that hold something."""
    from safetensors import safe_open

    from transformdsl.persist.safetensors_io import save_aligned

    directory = Path(shutil.copytree(gpt2_dir, tmp_path / "gpt2"))
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    real = len(tensors)
    tensors.update({f"junk.{i}": torch.empty(0) for i in range(100_000)})
    save_aligned(tensors, directory / "new.safetensors", metadata={"format": "pt"})
    os.replace(directory / "new.safetensors", directory / "model.safetensors")  # the old one is mapped
    _edit_json(directory / "config.json", lambda c: c.update({"n_layer": 100_000}))
    for action in (lambda: transformdsl.convert(directory, "quantize int8", tmp_path / "out"),
                   lambda: transformdsl.load(directory)):
        with pytest.raises(LoadError, match="far more modules") as caught:
            action()
        limit = int(str(caught.value).split("(over ")[1].split(")")[0])
        assert limit <= 4 * real + 256
    assert not (tmp_path / "out").exists()


def test_regex_budget_covers_the_plans_its_hints_make():
    """40 conflicting statements with a slow pattern: each hint planned the script again with a fresh
    0.5 s of matching (42 s on the UNet); the whole plan now has one budget."""
    from transformdsl import regexes
    from transformdsl.errors import ScriptError

    spent = [0.0]
    original = regexes.search

    def timed(compiled, path):
        import time

        started = time.monotonic()
        try:
            return original(compiled, path)
        finally:
            spent[0] += time.monotonic() - started

    script = "\n".join([r"fp8 storage re:^(\w|\w\w|\w\w\w)+$"] * 40) + "\n"
    model = models.tiny_unet()
    import transformdsl.selectors as selectors

    saved = selectors.search
    selectors.search = timed
    try:
        with pytest.raises(ScriptError):
            transformdsl.plan(model, script)
    finally:
        selectors.search = saved
    assert spent[0] < regexes.REGEX_BUDGET_S + 1.0, spent[0]


@pytest.fixture(scope="module")
def stock_quantized(tmp_path_factory) -> dict[str, Path]:
    """transformers quantizes a Llama of 12 layers (84 Linear layers) with bitsandbytes and saves it."""
    from stock_kernels import stock_runs_portable_4bit
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("stockq")
    config = LlamaConfig(**{**models.LLAMA_CONFIG, "num_hidden_layers": 12})
    LlamaForCausalLM(config).save_pretrained(root / "plain")
    out = {}
    for mode, quant in {"int8": BitsAndBytesConfig(load_in_8bit=True),
                        "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")}.items():
        model = stock_runs_portable_4bit(
            AutoModelForCausalLM.from_pretrained(root / "plain", quantization_config=quant, device_map="cpu"))
        model.save_pretrained(root / mode)
        out[mode] = root / mode
    return out


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_a_stock_quantized_directory_has_its_header_parsed_once(stock_quantized, monkeypatch, mode):
    """Each layer opened the file and parsed its whole header again: 1,500 layers took 17 s, 3,000
    layers 77 s.  Counted here: safetensors files opened to read the headers (84 layers)."""
    import safetensors

    opened = []
    original = safetensors.safe_open

    def counting(path, *args, **kwargs):
        opened.append(path)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    summary = inspect(stock_quantized[mode])
    assert summary["steps"][0]["key"] == f"quantize {mode}"
    assert len(opened) <= 3, len(opened)


def test_a_deeply_nested_quant_state_is_a_load_error(stock_quantized, tmp_path):
    """A 30,000-deep JSON array as an nf4 quant state gave RecursionError."""
    from safetensors import safe_open

    from transformdsl.persist.safetensors_io import save_aligned

    directory = Path(shutil.copytree(stock_quantized["nf4"], tmp_path / "nf4"))
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    key = next(k for k in sorted(tensors) if k.endswith("quant_state.bitsandbytes__nf4"))
    tensors[key] = torch.frombuffer(bytearray(b"[" * 30_000), dtype=torch.uint8)
    save_aligned(tensors, directory / "new.safetensors", metadata={"format": "pt"})
    os.replace(directory / "new.safetensors", directory / "model.safetensors")  # the old one is mapped
    for action in (transformdsl.load, inspect):
        with pytest.raises(LoadError, match="nested too deeply"):
            action(directory)


def test_inspect_of_pipelines_nested_a_thousand_deep_is_a_load_error(tmp_path):
    """A pipeline whose component is a pipeline, 1,200 deep: RecursionError."""
    from transformdsl.persist import META_FILE

    folder = tmp_path / "deep"
    node = folder
    for _ in range(1200):
        node.mkdir()
        (node / META_FILE).write_text(json.dumps({
            "format": "transformdsl", "format_version": 1, "kind": "pipeline",
            "pipeline_class": "StableDiffusionPipeline", "components": {"u": "transformdsl"}}))
        node = node / "u"
    try:
        with pytest.raises(LoadError, match="itself a pipeline"):
            inspect(folder)
    finally:  # removed here, bottom up: pytest's own clean-up (recursive rmtree) would hit the recursion limit
        chain = [folder]
        while (chain[-1] / "u").is_dir():
            chain.append(chain[-1] / "u")
        for directory in reversed(chain):
            (directory / META_FILE).unlink()
            directory.rmdir()


# --------------------------------------------------------------------------- sparse files


def test_convert_copies_a_sparse_component_file_sparsely(tmp_path):
    """A 1 GiB sparse file in a pipeline component (4 KiB on disk) became 1 GiB of writes."""
    pipe = models.tiny_sd_pipeline()
    pipe.save_pretrained(tmp_path / "pipe", safe_serialization=True)
    sparse = tmp_path / "pipe" / "tokenizer" / "huge.bin"
    with open(sparse, "wb") as f:
        f.seek(2**30 - 5)
        f.write(b"tail!")
        f.seek(12345)
        f.write(b"data")
    if sparse.stat().st_blocks * 512 > 2**20:
        pytest.skip("this file system does not keep holes")
    transformdsl.convert(tmp_path / "pipe", "quantize int8", tmp_path / "out")
    copied = tmp_path / "out" / "tokenizer" / "huge.bin"
    assert copied.stat().st_size == 2**30
    assert copied.stat().st_blocks * 512 <= 2**20  # its data, not its size
    with open(copied, "rb") as f:
        f.seek(12345)
        assert f.read(4) == b"data"
        f.seek(2**30 - 5)
        assert f.read() == b"tail!"
        f.seek(0)
        assert f.read(12345) == bytes(12345)
