"""Interchange with diffusers/transformers (spec.md "Interchange"): saves the stock libraries load,
and stock quantized checkpoints transformdsl loads.

transformdsl -> stock: each model is transformed, saved with ``format=``, then loaded by the stock
``from_pretrained`` in a fresh process that never imports transformdsl (tests/stock_loader.py
blocks the import and asserts it), and its outputs are compared with ours: bit-identical where
the library runs the same bitsandbytes kernels.  Stock -> transformdsl: transformers quantizes with
bitsandbytes on CPU and saves; transformdsl loads that directory, gives the same outputs, takes a
further ``compile`` and saves again.  diffusers' bitsandbytes loader needs a GPU (measured:
"No GPU found. A GPU is needed for quantization"): that direction is checked on CPU up to the
stock loader, and by benchmarks/gpu_interop_check.py on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import stock_runs_portable_4bit
from safetensors import safe_open
from safetensors.torch import save_file

import transformdsl
from transformdsl.errors import TransformError
from transformdsl.history import history_of
from transformdsl.models import BUILTIN, run, sample_inputs

ROOT = Path(__file__).resolve().parent.parent

#: (case id, built-in model, script, tolerance against our output: 0 = bit-identical).
EXPORTS = [
    ("llama-int8", "llama", "quantize int8", 0.0),
    ("llama-nf4", "llama", "quantize nf4", 0.0),
    ("llama-fp4", "llama", "quantize fp4 compute=float32 double_quant=true", 0.0),
    ("gpt2-int8", "gpt2", "quantize int8 threshold=6", 0.0),
    ("gpt2-nf4", "gpt2", "quantize nf4 in transformer.h.0", 0.0),
    # q, k and v written back unfused: three int8 matmuls instead of one, the same numbers up to rounding.
    ("llama-qkv-int8", "llama", "fuse qkv; quantize int8", 1e-5),
    ("llama-fp8", "llama", "fp8 storage compute=float32 except embed_tokens", 1e-6),
    ("llama-fp8-native", "llama", "fp8 native scaling=row compute=bfloat16 in *mlp*", 1e-2),
    ("llama-compile", "llama", "fuse qkv; compile", 1e-5),
    ("unet-compile", "unet", "compile", 0.0),
]


def _save_inputs(model, path: Path) -> None:
    args, kwargs = sample_inputs(model)
    tensors = {f"arg{i}": a for i, a in enumerate(args)}
    tensors.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def stock_run(jobs: list[dict], tmp: Path, path: str | None = None) -> dict[str, dict]:
    """Run tests/stock_loader.py on ``jobs`` in a clean process; its report by directory.
    ``path``: a directory put on PYTHONPATH (an optional package installed apart)."""
    jobs_file = tmp / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path:
        env["PYTHONPATH"] = path
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "stock_loader.py"), str(jobs_file)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("STOCK ")][-1]
    return {entry["dir"]: entry for entry in json.loads(line[len("STOCK "):])}


def _output(path: Path) -> torch.Tensor:
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("out")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every EXPORTS case transformed, saved with format=, and run by the stock loader."""
    tmp = tmp_path_factory.mktemp("interop")
    cases, jobs = {}, []
    for case, name, script, tol in EXPORTS:
        model = BUILTIN[name]()
        transformdsl.transform(model, script)
        library = "diffusers" if name in ("unet", "sd3", "flux") else "transformers"
        directory = tmp / case
        transformdsl.save(model, directory, format=library)
        _save_inputs(model, tmp / f"{case}.in.safetensors")
        with torch.compiler.set_stance("force_eager"):  # compiled code is not saved: compare the eager model
            out = run(model)
        cases[case] = {"model": model, "dir": directory, "out": out, "tol": tol}
        jobs.append({"dir": str(directory), "library": library, "class": type(model).__name__,
                     "inputs": str(tmp / f"{case}.in.safetensors"), "out": str(tmp / f"{case}.out.safetensors")})
    report = stock_run(jobs, tmp)
    for case, entry in cases.items():
        entry["stock"] = report[str(entry["dir"])]
        entry["stock_out"] = _output(tmp / f"{case}.out.safetensors")
    return cases


@pytest.mark.parametrize("case", [c[0] for c in EXPORTS])
def test_stock_library_loads_the_save_with_our_outputs(exported, case):
    entry = exported[case]
    ours, stock = entry["out"], entry["stock_out"]
    assert stock.shape == ours.shape
    if entry["tol"] == 0.0:
        assert torch.equal(stock.to(ours.dtype), ours)
    else:
        error = (stock.float() - ours.float()).abs().max() / ours.float().abs().max()
        assert error <= entry["tol"], error
    layers = entry["stock"]["layers"]
    if "int8" in case:
        assert "Linear8bitLt" in layers
    if "nf4" in case or "fp4" in case:
        assert "Linear4bit" in layers


@pytest.mark.parametrize("case", [c[0] for c in EXPORTS])
def test_transformdsl_restores_its_format_save_exactly(exported, case):
    entry = exported[case]
    loaded = transformdsl.load(entry["dir"])
    assert [s.key for s in history_of(loaded).steps] == [s.key for s in history_of(entry["model"]).steps]
    assert type(loaded) is type(entry["model"])
    assert list(loaded.state_dict()) == list(entry["model"].state_dict())
    for key, tensor in entry["model"].state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    if "compile" not in case:
        assert torch.equal(run(loaded), entry["out"])


def test_save_lists_only_unquantized_layers_as_skipped(exported):
    config = json.loads((exported["gpt2-nf4"]["dir"] / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "bitsandbytes" and quant["load_in_4bit"]
    # Only block h.0 was quantized: the other block and the head are skipped, by their topmost names.
    assert sorted(quant["llm_int8_skip_modules"]) == ["lm_head", "transformer.h.1"]
    meta = json.loads((exported["llama-compile"]["dir"] / "transformdsl.json").read_text())
    notes = " ".join(meta["interop"]["notes"])
    assert "written unfused" in notes and "torch.compile after from_pretrained" in notes


def test_diffusers_save_carries_bitsandbytes_for_a_gpu_loader(tmp_path):
    """diffusers' bitsandbytes loader refuses on CPU; the files are checked here, the load on a GPU
    (benchmarks/gpu_interop_check.py).  transformdsl itself reloads the save exactly."""
    model = BUILTIN["flux"]()
    # diffusers skips every layer whose own name is in the skip list: with the top-level proj_out
    # unquantized (a default exclusion), the single blocks' proj_out must stay unquantized too.
    transformdsl.transform(model, "quantize nf4 compute=bfloat16 except proj_out")
    transformdsl.save(model, tmp_path / "flux", format="diffusers")
    config = json.loads((tmp_path / "flux" / "config.json").read_text())
    assert config["_class_name"] == "FluxTransformer2DModel"
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["bnb_4bit_quant_type"], quant["bnb_4bit_compute_dtype"]) == \
        ("bitsandbytes", "nf4", "bfloat16")
    with safe_open(str(tmp_path / "flux" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == set(model.state_dict())
    loaded = transformdsl.load(tmp_path / "flux")
    assert torch.equal(run(loaded), run(model))
    if not torch.cuda.is_available():
        import diffusers

        with pytest.raises(RuntimeError, match="GPU"):
            diffusers.FluxTransformer2DModel.from_pretrained(str(tmp_path / "flux"))


# --------------------------------------------------------------------------- stock -> transformdsl


@pytest.fixture(scope="module")
def stock_saves(tmp_path_factory):
    """transformers quantizes tiny llama/gpt2 with bitsandbytes on CPU and saves them."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tmp = tmp_path_factory.mktemp("stock")
    configs = {"int8": BitsAndBytesConfig(load_in_8bit=True),
               "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
               "fp4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True,
                                         bnb_4bit_compute_dtype=torch.bfloat16)}
    saves = {}
    for name in ("llama", "gpt2"):
        BUILTIN[name]().save_pretrained(tmp / name)
        for mode, config in configs.items():
            model = stock_runs_portable_4bit(
                AutoModelForCausalLM.from_pretrained(tmp / name, quantization_config=config, device_map="cpu"))
            model.save_pretrained(tmp / f"{name}-{mode}")
            saves[f"{name}-{mode}"] = (tmp / f"{name}-{mode}", model)
    return saves


@pytest.mark.parametrize("case", ["llama-int8", "llama-nf4", "llama-fp4", "gpt2-int8", "gpt2-nf4", "gpt2-fp4"])
def test_stock_bitsandbytes_save_loads_with_the_same_outputs(stock_saves, case):
    directory, stock = stock_saves[case]
    ours = transformdsl.load(directory)
    assert torch.equal(run(ours), run(stock))
    steps = history_of(ours).steps
    assert [s.key for s in steps] == [f"quantize {case.split('-')[1]}"]
    # Already quantized: planning the same statement again finds nothing to do, and says why.
    plan = transformdsl.plan(ours, f"quantize {case.split('-')[1]}")
    assert not plan.steps[0].targets
    assert any("already quantized" in reason for _, reason in plan.steps[0].skipped)


def test_stock_save_takes_compile_and_saves_again(stock_saves, tmp_path):
    directory, stock = stock_saves["llama-nf4"]
    model = transformdsl.load(directory)
    expected = run(model)
    transformdsl.transform(model, "compile")
    transformdsl.save(model, tmp_path / "again")
    again = transformdsl.load(tmp_path / "again")
    assert [s.key for s in history_of(again).steps] == ["quantize nf4", "compile"]
    torch.testing.assert_close(run(again), expected, rtol=1e-4, atol=1e-4)
    # ... and once more in transformers' layout, which the stock loader reads.
    transformdsl.save(again, tmp_path / "stock", format="transformers")
    config = json.loads((tmp_path / "stock" / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_quant_type"] == "nf4"


def test_diffusers_directory_with_bitsandbytes_loads(tmp_path):
    """A diffusers-layout directory (config.json with _class_name and a bitsandbytes
    quantization_config), as diffusers writes it on a GPU machine: ours, minus our metadata."""
    model = BUILTIN["flux"]()
    transformdsl.transform(model, "quantize int8 except proj_out")
    transformdsl.save(model, tmp_path / "flux", format="diffusers")
    for extra in ("transformdsl.json", "script.tfm"):
        (tmp_path / "flux" / extra).unlink()
    loaded = transformdsl.load(tmp_path / "flux")
    assert type(loaded).__name__ == "FluxTransformer2DModel"
    assert [s.key for s in history_of(loaded).steps] == ["quantize int8"]
    assert torch.equal(run(loaded), run(model))


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("name", "script", "fmt", "message"), [
    ("llama", "quantize hqq", "transformers", "cannot carry line 1: 'quantize hqq'.*NotImplementedError"),
    ("llama", "quantize int8 weight_only=true", "transformers", "has no weight-only int8"),
    ("flux", "fp8 storage", "diffusers", "diffusers has no loader for pre-quantized fp8"),
    ("llama", "fp8 storage dtype=e5m2", "transformers", "float8_e4m3fn; use dtype=e4m3"),
    ("llama", "quantize int8 in *mlp*; quantize nf4 in *self_attn*", "transformers", "one quantization_config"),
    ("llama", "fuse qkv; quantize nf4", "transformers", "does not split by output rows"),
    ("llama", "quantize int8", "diffusers", "this is a transformers model; use format='transformers'"),
    ("flux", "quantize int8", "diffusers", "skips every layer named 'proj_out'.*'except proj_out'"),
    ("llama", "quantize int8", "onnx", "unknown save format 'onnx'"),
])
def test_formats_refuse_what_they_cannot_carry(tmp_path, name, script, fmt, message):
    model = BUILTIN[name]()
    transformdsl.transform(model, script)
    with pytest.raises(TransformError, match=message):
        transformdsl.save(model, tmp_path / "out", format=fmt)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


# --------------------------------------------------------------------------- CLI, pipelines, tampering


def test_cli_apply_format_and_inspect_a_checkpoint(stock_saves, tmp_path, capsys):
    from transformdsl.cli import main

    script = tmp_path / "q.tfm"
    script.write_text("quantize int8\n")
    assert main(["apply", str(script), "--model", "gpt2", "--out", str(tmp_path / "out"), "--format",
                 "transformers", "-q"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["load_in_8bit"] and config["architectures"] == ["GPT2LMHeadModel"]
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out")]) == 0
    assert "saved in the transformers layout" in capsys.readouterr().out
    directory, _ = stock_saves["llama-nf4"]
    assert main(["inspect", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "a transformers checkpoint" in out and "quantize nf4" in out
    # --model DIR on a quantized checkpoint gives our layers: explain sees them as already quantized.
    assert main(["explain", str(script), "--model", str(directory)]) == 0
    assert "already quantized (FourBitLinear)" in capsys.readouterr().out


def test_pipeline_saved_for_diffusers_loads_with_stock_diffusers(tmp_path):
    import diffusers

    from transformdsl.models import tiny_sd_pipeline

    pipe = tiny_sd_pipeline()
    transformdsl.transform(pipe, "fuse qkv; compile")
    with torch.compiler.set_stance("force_eager"):
        expected = run(pipe)
    transformdsl.save(pipe, tmp_path / "pipe", format="diffusers")
    stock = diffusers.StableDiffusionPipeline.from_pretrained(str(tmp_path / "pipe"), local_files_only=True)
    torch.testing.assert_close(run(stock), expected, rtol=0, atol=1e-4)
    ours = transformdsl.load(tmp_path / "pipe")
    assert [s.key for s in history_of(ours.unet).steps] == ["fuse qkv", "compile"]
    with torch.compiler.set_stance("force_eager"):
        assert torch.equal(run(ours), expected)


def test_tampered_layout_is_a_clear_load_error(exported, tmp_path):
    import shutil

    from transformdsl.errors import LoadError

    directory = tmp_path / "tampered"
    shutil.copytree(exported["llama-qkv-int8"]["dir"], directory)
    meta = json.loads((directory / "transformdsl.json").read_text())
    meta["tensors"]["layout"][0]["from"][0] = "model.layers.0.self_attn.nothing.weight"
    (directory / "transformdsl.json").write_text(json.dumps(meta))
    with pytest.raises(LoadError, match="nothing.weight' .*is missing"):
        transformdsl.load(directory)
    meta["tensors"]["layout"][0]["op"] = "exec"
    (directory / "transformdsl.json").write_text(json.dumps(meta))
    with pytest.raises(LoadError, match="malformed 'tensors.layout' entry"):
        transformdsl.load(directory)


def test_sharded_saves_both_ways(stock_saves, tmp_path):
    """Above max_shard_size: the library's shard names and index, read by both loaders."""
    from transformers import AutoModelForCausalLM

    model = BUILTIN["llama"]()
    transformdsl.transform(model, "quantize nf4")
    transformdsl.save(model, tmp_path / "ours", format="transformers", max_shard_size=40_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    stock = stock_runs_portable_4bit(
        AutoModelForCausalLM.from_pretrained(tmp_path / "ours", device_map="cpu", local_files_only=True))
    assert torch.equal(run(stock), run(model))
    # (transformers 5.24 cannot save a model it loaded 4-bit pre-quantized: Bnb4bitDeserialize has no
    # reverse; so the stock sharded save is quantized from float weights.)
    _, quantized = stock_saves["llama-nf4"]
    quantized.save_pretrained(tmp_path / "stock", max_shard_size="40KB")
    assert (tmp_path / "stock" / "model.safetensors.index.json").is_file()
    assert torch.equal(run(transformdsl.load(tmp_path / "stock")), run(quantized))


def test_compressed_tensors_fp8_loads_bit_identically(tmp_path):
    """Optional: compressed-tensors is not a dependency; where it is installed, transformers reads our
    per-channel fp8 layers as its float-quantized format and computes the same numbers."""
    ct = pytest.importorskip("compressed_tensors")
    model = BUILTIN["llama"]()
    transformdsl.transform(model, "fp8 storage compute=float32 except embed_tokens")
    transformdsl.save(model, tmp_path / "ct", format="compressed-tensors")
    quant = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["ignore"] == []
    _save_inputs(model, tmp_path / "in.safetensors")
    jobs = [{"dir": str(tmp_path / "ct"), "library": "transformers", "class": "LlamaForCausalLM",
             "inputs": str(tmp_path / "in.safetensors"), "out": str(tmp_path / "out.safetensors")}]
    stock_run(jobs, tmp_path, path=str(Path(ct.__file__).resolve().parent.parent))
    assert torch.equal(_output(tmp_path / "out.safetensors"), run(model))
    loaded = transformdsl.load(tmp_path / "ct")
    assert torch.equal(run(loaded), run(model))
    other = BUILTIN["llama"]()
    transformdsl.transform(other, "quantize int8")
    with pytest.raises(TransformError, match="format='compressed-tensors' carries fp8 layers"):
        transformdsl.save(other, tmp_path / "bad", format="compressed-tensors")


def test_transformers_format_refuses_quantized_linear_subclasses(tmp_path):
    """transformers' bitsandbytes loader converts `type(module) is nn.Linear` (and Conv1D) only: Falcon's
    FalconLinear layers, quantized, would load as float layers holding int8 bytes (the zoo's format column
    found it: "expected m1 and m2 to have the same dtype")."""
    from tests.zoo import corpus

    model, _ = corpus.build(corpus.entry("transformers/Falcon"))
    transformdsl.transform(model, "quantize int8")
    with pytest.raises(TransformError, match=r"format='transformers' cannot carry line 1: 'quantize int8': "
                                             r"transformers' bitsandbytes loader quantizes nn.Linear and Conv1D "
                                             r"layers only, not FalconLinear \(.*\); exclude them \('except "
                                             r"FalconLinear'\)"):
        transformdsl.save(model, tmp_path / "stock", format="transformers")
    assert not (tmp_path / "stock").exists()


def test_a_refusal_names_the_format_asked_for():
    model = BUILTIN["llama"]()
    transformdsl.transform(model, "quantize hqq group_size=auto")
    with pytest.raises(TransformError, match=r"^format='compressed-tensors' cannot carry line 1: 'quantize hqq"):
        transformdsl.save(model, Path("/nonexistent/never-written"), format="compressed-tensors")
