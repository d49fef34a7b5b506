"""Round 4 of hostile inputs (issue 36, items 5-18): code from the current directory, clear errors
instead of internal ones, silent acceptance, convert's checks and the first hour's conveniences."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _payload_dir(where: Path) -> Path:
    """A folder as a downloaded model repository might hold: a ``*.dist-info`` declaring a transform
    whose module (beside it) writes a sentinel when imported, and a ``lark.py`` shadowing the parser's
    library with the same sentinel."""
    sentinel = where / "RAN"
    code = f"open({str(sentinel)!r}, 'a').write(__name__ + '\\n')\n"
    dist = where / "evil-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[transformdsl.transforms]\nevil payload = evil_payload:Evil\n")
    (where / "evil_payload.py").write_text(code)
    (where / "lark.py").write_text(code)
    (where / "script.tfm").write_text("evil payload\n")
    return sentinel


def test_python_m_imports_nothing_from_the_current_directory(tmp_path):
    sentinel = _payload_dir(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "transformdsl", "check", "script.tfm"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert not sentinel.exists(), sentinel.read_text()
    assert done.returncode == 1, done.stderr
    assert "unknown" in done.stderr and "evil" in done.stderr, done.stderr


# --------------------------------------------------------------------------- LoRA files (items 6, 10)

import json  # noqa: E402
import struct  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import LoadError, TransformError, models  # noqa: E402

TO_Q = "transformer_blocks.0.attn.to_q"


@pytest.fixture(scope="module")
def flux():
    return models.tiny_flux()


def _pair(flux, rank=4, dtype=torch.float32):
    layer = flux.get_submodule(TO_Q)
    g = torch.Generator().manual_seed(0)
    return {f"transformer.{TO_Q}.lora_A.weight": (torch.randn(rank, layer.in_features, generator=g) / 8).to(dtype),
            f"transformer.{TO_Q}.lora_B.weight": (torch.randn(layer.out_features, rank, generator=g) / 8).to(dtype)}


def _raw_file(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _refusal(model, text: str) -> str:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TransformError) as caught:
        transformdsl.transform(model, text)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return str(caught.value)


def test_a_lora_header_nested_deep_is_a_clear_error(flux, tmp_path):
    path = _raw_file(tmp_path / "deep.safetensors", b"[" * 100_000 + b"]" * 100_000)
    assert "nests deeper than" in _refusal(flux, f'lora "{path}"')


def test_a_lora_shape_too_large_for_torch_is_a_clear_error(flux, tmp_path):
    header = {f"transformer.{TO_Q}.lora_A.weight": {"dtype": "F32", "shape": [2 ** 63, 0], "data_offsets": [0, 0]},
              f"transformer.{TO_Q}.lora_B.weight": {"dtype": "F32", "shape": [0, 2 ** 63], "data_offsets": [0, 0]}}
    path = _raw_file(tmp_path / "huge.safetensors", json.dumps(header).encode())
    assert "dimensions are at most" in _refusal(flux, f'lora "{path}"')


@pytest.mark.parametrize("shape", [(2,), (2, 2), (0,)], ids=["vector", "matrix", "empty"])
@pytest.mark.parametrize("merge", ["true", "false"])
def test_an_alpha_that_is_not_one_number_is_a_clear_error(flux, tmp_path, shape, merge):
    sd = {**_pair(flux), f"transformer.{TO_Q}.alpha": torch.ones(shape)}
    path = tmp_path / "alpha.safetensors"
    save_file(sd, str(path))
    assert f"has shape {shape}: a LoRA's alpha is one number" in _refusal(flux, f'lora "{path}" merge={merge}')


def test_a_lora_path_with_a_nul_byte_is_a_clear_error(flux):
    assert "cannot hold a NUL character" in _refusal(flux, 'lora "a\x00b.safetensors"')


@pytest.mark.parametrize("merge", ["true", "false"])
def test_a_lora_that_overflows_float32_or_bfloat16_is_refused(tmp_path, merge):
    flux = models.tiny_flux()
    sd = _pair(flux, dtype=torch.float64)
    sd[f"transformer.{TO_Q}.lora_B.weight"][0, 0] = 1e300  # finite in float64, inf in float32
    path = tmp_path / "big.safetensors"
    save_file(sd, str(path))
    assert "overflows float32" in _refusal(flux, f'lora "{path}" merge={merge}')
    sd = {**_pair(flux), f"transformer.{TO_Q}.alpha": torch.tensor(1e38)}  # alpha / rank * B @ A: inf
    save_file(sd, str(path))
    assert "alpha is at most 1e+06" in _refusal(flux, f'lora "{path}" merge={merge}')


def test_a_lora_key_with_terminal_escapes_is_shown_escaped(flux, tmp_path):
    sd = {**_pair(flux), "transformer.\x1b[31mred\x07.lora_A.weight": torch.ones(4, 8),
          "transformer.\x1b[31mred\x07.lora_B.weight": torch.ones(8, 4)}
    path = tmp_path / "esc.safetensors"
    save_file(sd, str(path))
    message = _refusal(flux, f'lora "{path}"')
    assert "\x1b" not in message and "\x07" not in message and "\\x1b[31mred\\x07" in message


@pytest.mark.parametrize("where", ["norm_out.norm", ""], ids=["a LayerNorm", "the root"])
def test_a_switchable_lora_recorded_onto_a_module_that_is_not_a_linear_layer_is_refused_on_load(tmp_path, where):
    from safetensors.torch import load_file
    from saved_files import read_meta, write_meta

    flux = models.tiny_flux()
    path = tmp_path / "style.safetensors"
    save_file(_pair(flux), str(path))
    transformdsl.transform(flux, f'lora "{path}" merge=false')
    out = transformdsl.save(flux, tmp_path / "saved")
    meta = read_meta(out)
    step = next(s for s in meta["steps"] if s["key"] == "lora")
    step["record"]["layers"] = {where: step["record"]["layers"][TO_Q]}
    write_meta(out, meta)
    for name in meta["tensors"]["files"]:  # the adapter's tensors moved with it
        tensors = load_file(str(out / name))
        prefix = f"{where}." if where else ""
        save_file({k.replace(f"{TO_Q}.lora_adapters", f"{prefix}lora_adapters"): v for k, v in tensors.items()},
                  str(out / name))
    with pytest.raises(LoadError, match="a switchable LoRA sits beside a linear layer only"):
        transformdsl.load(out)


def test_an_alpha_option_beyond_the_bound_is_a_script_error():
    from transformdsl import ScriptError
    from transformdsl.registry import declarations
    from transformdsl.validate import validate

    with pytest.raises(ScriptError, match="alpha"):
        validate(transformdsl.parse('lora "x.safetensors" alpha=1e7'), declarations())


# --------------------------------------------------------------------------- plugins (item 7)


def _plugin_folder(where: Path, key: str, module: str, code: str) -> Path:
    """A site folder holding one installed plugin: its ``*.dist-info`` (entry point) and module."""
    where.mkdir()
    dist = where / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[transformdsl.transforms]\n{key} = {module}:Plugin\n")
    (where / f"{module}.py").write_text(code)
    return where


_NOT_A_DATACLASS = '''
from transformdsl.extend import Transform


class Plain:
    factor: float = 1.0


class Plugin(Transform):
    verb = "odd"
    mode = "options"
    Options = Plain
'''


@pytest.mark.parametrize("key, code, expected", [
    ("exits now", "raise SystemExit(3)\n", "failed to import: SystemExit: 3"),
    ("odd options", _NOT_A_DATACLASS, "Plugin.Options is Plain, not a dataclass"),
], ids=["SystemExit at import", "Options not a dataclass"])
def test_a_broken_plugin_is_refused_by_name_and_the_rest_works(tmp_path, key, code, expected):
    site = _plugin_folder(tmp_path / "site", key, "transformdsl_odd", code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    (tmp_path / "uses.tfm").write_text(f"{key}\n")
    (tmp_path / "other.tfm").write_text("quantize int8 except norm\n")
    def check(name):
        return subprocess.run([sys.executable, "-m", "transformdsl", "check", name], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    done = check("uses.tfm")
    assert done.returncode == 1, done.stderr
    assert f"transform '{key}' (entry point of transformdsl_odd 1.0" in done.stderr, done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr
    done = check("other.tfm")  # the rest of the registry works
    assert done.returncode == 0 and done.stdout == "other.tfm: ok (1 statement(s))\n", done


# --------------------------------------------------------------------------- tampered records (items 8, 10, 17)


def _saved_tensors(directory: Path) -> tuple[str, dict, dict]:
    """(file name, tensors, header metadata) of a one-file save."""
    from safetensors import safe_open
    from saved_files import read_meta

    (name,) = read_meta(directory)["tensors"]["files"]
    with safe_open(str(directory / name), "pt") as f:
        return name, {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _int4_save(tmp_path: Path):
    def make():
        return torch.nn.Sequential(torch.nn.Linear(192, 32))

    model = make()
    transformdsl.transform(model, "quantize int4 group_size=64")
    return transformdsl.save(model, tmp_path / "int4"), make


def test_an_int4_scale_saved_in_float32_is_refused_on_load(tmp_path):
    out, make = _int4_save(tmp_path)
    name, tensors, metadata = _saved_tensors(out)
    tensors["0.weight_scale"] = tensors["0.weight_scale"].float()  # loaded, then the packed kernel failed
    save_file(tensors, str(out / name), metadata=metadata)
    with pytest.raises(LoadError, match="'0.weight_scale' is float32 in the file; int4 layers store"):
        transformdsl.load(out, model=make)


def test_an_int4_record_whose_group_does_not_divide_in_features_is_refused_on_load(tmp_path):
    from saved_files import edit_meta

    out, make = _int4_save(tmp_path)
    edit_meta(out, ("steps", 0, "options", "group_size"), 128)  # 192 % 128: a group straddles rows
    name, tensors, metadata = _saved_tensors(out)
    for key in ("0.weight_scale", "0.weight_zero"):
        tensors[key] = tensors[key][:, :1].contiguous()  # the shapes 192 // 128 gives
    save_file(tensors, str(out / name), metadata=metadata)
    with pytest.raises(LoadError, match="has in_features 192, which group_size=128 does not divide"):
        transformdsl.load(out, model=make)


def test_an_nf4_double_quantization_offset_that_is_nan_is_refused_on_load(tmp_path):
    from saved_files import read_meta, write_meta

    def make():
        return torch.nn.Sequential(torch.nn.Linear(64, 64))

    model = make()
    transformdsl.transform(model, "quantize nf4 double_quant=true")
    out = transformdsl.save(model, tmp_path / "nf4")
    meta = read_meta(out)
    (layer,) = meta["steps"][0]["record"]["layers"]
    assert isinstance(layer["offset"], float)
    layer["offset"] = float("nan")
    write_meta(out, meta)
    with pytest.raises(LoadError, match="double-quantization offset"):
        transformdsl.load(out, model=make)


# --------------------------------------------------------------------------- JSON depth (item 9)


def test_a_config_nested_900_deep_is_a_load_error_in_convert(tmp_path):
    source = tmp_path / "gpt2"
    models.tiny_gpt2().save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config)[:-1] + ', "task_specific_params": '
                                        + "[" * 900 + "]" * 900 + "}")
    with pytest.raises(LoadError, match="config.json: configuration nests deeper than 64 levels"):
        transformdsl.convert(source, "quantize int8 weight_only=true", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_pipeline_index_nested_1200_deep_is_a_clear_error_on_the_command_line(tmp_path, capsys):
    from transformdsl.cli import main

    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "model_index.json").write_text('{"_class_name": "FluxPipeline", "transformer": '
                                           + "[" * 1200 + "]" * 1200 + "}")
    (tmp_path / "s.tfm").write_text("quantize int8\n")
    assert main(["explain", "--model", str(pipe), str(tmp_path / "s.tfm")]) == 1  # a RecursionError before
    assert "pipeline index nests deeper than 64 levels" in capsys.readouterr().err


# --------------------------------------------------------------------------- convert (items 14, 15, 16)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    source = tmp_path_factory.mktemp("gpt2") / "gpt2"
    models.tiny_gpt2().save_pretrained(source)
    return source


def test_a_shard_rewritten_in_place_during_convert_is_refused(gpt2_dir, tmp_path):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(gpt2_dir, source)
    shard = source / "model.safetensors"
    original = shard.read_bytes()

    def rewrite(_plan_text):  # called with the plan, before any unit is read
        with open(shard, "r+b") as f:  # same size, other bytes at the end (tensor data), in place
            f.seek(len(original) - 4096)
            f.write(bytes(4096))
        os.utime(shard, ns=(os.stat(shard).st_atime_ns, os.stat(shard).st_mtime_ns + 10**9))

    with pytest.raises(LoadError, match="rewritten while convert read it"):
        transformdsl.convert(source, "quantize int8 weight_only=true", tmp_path / "out", log=rewrite)
    assert not (tmp_path / "out").exists()


def test_convert_refuses_an_extra_tensor_as_load_does(tmp_path):
    from safetensors.torch import load_file

    source = tmp_path / "gpt2"
    models.tiny_gpt2().save_pretrained(source)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({**tensors, "not_a_module.weight": torch.ones(3)}, str(source / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"unexpected 1 tensor\(s\): not_a_module.weight") as loading:
        transformdsl.load(source)
    with pytest.raises(LoadError, match=r"unexpected 1 tensor\(s\): not_a_module.weight") as converting:
        transformdsl.convert(source, "quantize int8 weight_only=true", tmp_path / "out")
    assert str(loading.value).partition(": ")[2] == str(converting.value).partition(": ")[2]
    assert not (tmp_path / "out").exists()


def test_convert_writes_the_same_bytes_in_two_processes(tmp_path):
    import inspect

    source = tmp_path / "flux"
    flux = models.tiny_flux()
    flux.save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    defaults = {name: p.default for name, p in inspect.signature(type(flux).__init__).parameters.items()}
    left = [key for key in config if key in defaults and json.loads(json.dumps(defaults[key])) == config[key]]
    assert len(left) >= 3, left
    for key in left:  # left to their defaults: diffusers lists them in _use_default_values, made from a set
        del config[key]
    (source / "config.json").write_text(json.dumps(config))
    code = ("import sys, transformdsl; transformdsl.convert(sys.argv[1], 'quantize int8 weight_only=true', "
            "sys.argv[2])")
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"out{seed}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", code, str(source), str(out)], env=env, check=True, timeout=300,
                       capture_output=True)
        meta = json.loads((out / "transformdsl.json").read_text())
        save_id = meta.pop("save_id")  # the one difference, in the metadata and the shards' headers
        shards = {p.name: p.read_bytes().replace(save_id.encode(), b"-" * len(save_id))
                  for p in out.glob("*.safetensors")}
        outputs.append((json.dumps(meta), shards))
    assert json.loads(outputs[0][0])["model"]["config"]["_use_default_values"]
    assert outputs[0] == outputs[1]


# --------------------------------------------------------------------------- the first hour (items 11, 17)


@pytest.mark.parametrize("argv, expected", [
    (["check", "-"], "<stdin>: ok (2 statement(s))\n"),
    (["fmt", "-"], "fuse qkv\nquantize int8 except norm\n"),
    (["explain", "-", "--model", "gpt2"], "quantize int8"),
])
def test_dash_reads_the_script_from_standard_input(argv, expected, monkeypatch, capsys):
    import io

    from transformdsl.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("fuse   qkv\nquantize int8 except norm\n"))
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out == expected if argv[0] != "explain" else expected in out, out


def test_parse_file_of_a_directory_names_the_path(tmp_path):
    from transformdsl import ScriptError
    from transformdsl.parser import parse_file

    with pytest.raises(ScriptError, match=f"a directory \\(a script is read from a file\\): '{tmp_path}'"):
        parse_file(tmp_path)


@pytest.mark.parametrize("place", ["cpu:7", "cpu7"])
def test_a_device_map_naming_a_cpu_that_is_not_there_is_refused(tmp_path, place):
    out = transformdsl.save(models.tiny_gpt2(), tmp_path / "gpt2")
    with pytest.raises(LoadError, match="device_map"):
        transformdsl.load(out, device_map={"": place})


def test_an_hqq_group_size_option_that_disagrees_with_the_record_is_refused_on_load(tmp_path):
    from saved_files import edit_meta, read_meta

    def make():
        return torch.nn.Sequential(torch.nn.Linear(64, 64))

    model = make()
    transformdsl.transform(model, "quantize hqq bits=4 group_size=32")
    out = transformdsl.save(model, tmp_path / "hqq")
    assert read_meta(out)["steps"][0]["record"]["layers"][0]["group_size"] == 32
    edit_meta(out, ("steps", 0, "options", "group_size"), 64)  # loaded with the record's 32 before, silently
    with pytest.raises(LoadError, match="has group size 32, the statement group_size=64"):
        transformdsl.load(out, model=make)


# 4b: a statement that silently skipped most of its default targets (quantize int4 at group 128 on
# SmolLM2's 576-wide layers changed 30 of 210 Linears, and said nothing).

def test_a_statement_that_leaves_most_of_its_targets_as_they_are_says_so_with_the_fix():
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from transformdsl.executor import MostlySkippedWarning

    model = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                         num_attention_heads=9, num_key_value_heads=3, vocab_size=100))
    expected = ("changes 2 of the 14 modules it selects: 12 are left as they are (12 because group_size=128 does "
                "not divide its in_features (576; group_size=64 does))")
    assert expected in str(transformdsl.plan(model, "quantize int4"))
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformdsl.transform(model, "quantize int4", log=lines.append)
    assert [str(w.message) for w in caught if w.category is MostlySkippedWarning] == [
        f"line 1: 'quantize int4' {expected}"]
    assert f"line 1: 'quantize int4' {expected}" in lines
    with warnings.catch_warnings():
        warnings.simplefilter("error", MostlySkippedWarning)  # the fix it names leaves nothing out
        transformdsl.transform(LlamaForCausalLM(model.config), "quantize int4 group_size=64")


def test_a_lora_tensor_larger_than_any_weight_of_the_model_is_refused_before_it_is_read(flux, tmp_path):
    """A sparse 2 GiB tensor no adapter uses cost 4 GB of memory (the file read whole, then parsed): now
    each tensor is read on its own, and one larger than the model's largest weight is refused unread."""
    import resource

    pair = _pair(flux)
    header, offset, blobs = {}, 0, []
    for name, tensor in pair.items():
        blob = tensor.numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    huge = 2 ** 28  # float64 values: 2 GiB
    header["text_encoder.unused.lora_A.weight"] = {"dtype": "F64", "shape": [huge], "data_offsets": [offset,
                                                                                                   offset + 8 * huge]}
    path = _raw_file(tmp_path / "sparse.safetensors", json.dumps(header).encode(), b"".join(blobs))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + 8 * huge)  # a hole: 2 GiB apparent, nothing on disk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    message = _refusal(flux, f'lora "{path}"')  # another component's key: ignored by the converter
    assert "holds 268435456 values, more than the model's largest weight" in message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: far below the 2 GiB


@pytest.fixture(scope="module")
def sd_pipeline_save(tmp_path_factory):
    pipe = models.tiny_sd_pipeline()
    transformdsl.transform(pipe, "quantize int8 weight_only=true")  # the unet is then saved in our format
    return transformdsl.save(pipe, tmp_path_factory.mktemp("pipe") / "sd")


def _copy(tree: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(tree, tmp_path / "copy"))


def test_a_component_whose_metadata_is_a_pipelines_is_a_load_error(sd_pipeline_save, tmp_path):
    """It gave KeyError: 'tensors' (issue 36 item 17)."""
    out = _copy(sd_pipeline_save, tmp_path)
    (out / "unet" / "transformdsl.json").write_text((out / "transformdsl.json").read_text())
    with pytest.raises(LoadError, match="component 'unet' is saved as a pipeline; a pipeline's components are saved "
                                        "modules"):
        transformdsl.load(out)


def test_a_pipeline_index_naming_another_class_for_a_component_is_refused(sd_pipeline_save, tmp_path):
    """The index's entry was ignored: it said one class and the load built another (issue 36 item 17)."""
    out = _copy(sd_pipeline_save, tmp_path)
    index = json.loads((out / "model_index.json").read_text())
    index["unet"] = ["diffusers", "AutoencoderKL"]
    (out / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="component 'unet' is a saved 'UNet2DConditionModel', and model_index.json "
                                        "names 'AutoencoderKL'"):
        transformdsl.load(out)
