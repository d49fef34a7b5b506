"""``convert``: a checkpoint streamed through a script, unit by unit, writes the save that
``load → transform → save`` writes, tensor for tensor and bit for bit; its memory is bounded by
a unit, not the model; an interrupted run leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import transformdsl
from transformdsl import LoadError, TransformError, models
from transformdsl.extend import Transform
from transformdsl.persist import write as persist_write
from transformdsl.streaming import split_units

ROOT = Path(__file__).resolve().parent.parent

#: One script per statement kind (and one of several statements).
SCRIPTS = [
    "fuse qkv",
    "quantize int8",
    "quantize int8 weight_only=true",
    "quantize w8a8",
    "quantize int4 group_size=32",
    "quantize q8_0",
    "quantize nf4",
    "quantize fp4",
    "quantize hqq",
    "fp8 storage",
    "fp8 native",
    "fuse bias_act_dropout",
    "compile",
    "fuse qkv; quantize nf4; compile",
]
MODULES = ["unet", "sd3", "flux", "llama", "gpt2"]


def saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    meta = json.loads((directory / "transformdsl.json").read_text())
    out = {}
    for name in meta["tensors"]["files"]:
        with safe_open(str(directory / name), "pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys() if not key.startswith("__pad__.")})
    return out


def assert_same_save(reference: Path, converted: Path, ignore_config: tuple[str, ...] = ()) -> None:
    """Same tensors (names, dtypes, shapes, bytes) and the same metadata but for the save id
    (and the configuration keys ``ignore_config``)."""
    expected, got = saved_tensors(reference), saved_tensors(converted)
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        other = got[key]
        assert (other.dtype, other.shape) == (tensor.dtype, tensor.shape), key
        assert torch.equal(other.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key
    meta = [json.loads((d / "transformdsl.json").read_text()) for d in (reference, converted)]
    for m in meta:
        m.pop("save_id")
        for key in ignore_config:
            m["model"]["config"].pop(key, None)
    assert meta[1] == meta[0]
    assert (converted / "script.tfm").read_text() == (reference / "script.tfm").read_text()


def reference_save(source: Path, script: str, out: Path) -> Path:
    model = transformdsl.load(source)
    transformdsl.transform(model, script)
    return transformdsl.save(model, out)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Each built-in model saved by its own library (diffusers / transformers ``save_pretrained``)."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for name in MODULES:
        out[name] = root / name
        models.BUILTIN[name]().save_pretrained(out[name], safe_serialization=True)
    return out


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("name", MODULES)
def test_convert_is_load_transform_save_bit_for_bit(sources, tmp_path, name, script):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", transformdsl.executor.NothingToDoWarning)
        reference = reference_save(sources[name], script, tmp_path / "reference")
        converted = transformdsl.convert(sources[name], script, tmp_path / "converted")
    assert_same_save(reference, converted)


def test_convert_with_a_lora_records_the_file_name_not_its_path(sources, tmp_path):
    """The history ``convert`` saves is built as ``transform``'s is: a ``lora`` statement keeps the file's
    name (spec.md, "lora"), and the save is ``load → transform → save``'s, bit for bit."""
    from safetensors.torch import save_file

    flux = models.tiny_flux()
    generator = torch.Generator().manual_seed(0)
    adapter = {}
    for name, module in flux.named_modules():
        if type(module) is torch.nn.Linear and name.startswith("transformer_blocks.0.attn.to_"):
            adapter[f"transformer.{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=generator)
            adapter[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=generator)
    folder = tmp_path / "adapters"
    folder.mkdir()
    save_file(adapter, str(folder / "style.safetensors"))
    script = f'lora "{folder / "style.safetensors"}" scale=0.5 in transformer_blocks.0\nquantize int8'
    reference = reference_save(sources["flux"], script, tmp_path / "reference")
    converted = transformdsl.convert(sources["flux"], script, tmp_path / "converted")
    assert (converted / "script.tfm").read_text() == 'lora "style.safetensors" scale=0.5 in transformer_blocks.0\n' \
                                                     "quantize int8\n"
    steps = json.loads((converted / "transformdsl.json").read_text())["steps"]
    assert steps[0]["statement"] == 'lora "style.safetensors" scale=0.5 in transformer_blocks.0'
    assert str(folder) not in (converted / "transformdsl.json").read_text()
    assert_same_save(reference, converted)


def test_converted_model_loads_alone_and_computes_as_transformed(sources, tmp_path):
    script = "fuse qkv; quantize nf4"
    transformed = transformdsl.transform(transformdsl.load(sources["flux"]), script)
    loaded = transformdsl.load(transformdsl.convert(sources["flux"], script, tmp_path / "out"))
    assert torch.equal(models.run(loaded), models.run(transformed))


def test_sharded_source_and_output(sources, tmp_path):
    """A source in shards with an index, written in shards: the same tensors."""
    source = tmp_path / "sharded"
    models.tiny_llama().save_pretrained(source, safe_serialization=True, max_shard_size="100KB")
    assert (source / "model.safetensors.index.json").is_file()
    reference = reference_save(source, "quantize int8", tmp_path / "reference")
    converted = transformdsl.convert(source, "quantize int8", tmp_path / "converted", max_shard_size=60_000)
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    expected = saved_tensors(reference)
    got = saved_tensors(converted)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
               for k, t in expected.items())
    assert torch.equal(models.run(transformdsl.load(converted)), models.run(transformdsl.load(reference)))


def test_a_transformdsl_save_converts_further(sources, tmp_path):
    """The script's steps follow the saved ones, as ``load → transform → save`` does."""
    first = reference_save(sources["sd3"], "fuse qkv", tmp_path / "first")
    reference = reference_save(first, "quantize int8 weight_only=true", tmp_path / "reference")
    converted = transformdsl.convert(first, "quantize int8 weight_only=true", tmp_path / "converted")
    assert_same_save(reference, converted)
    assert [s["statement"] for s in json.loads((converted / "transformdsl.json").read_text())["steps"]] == [
        "fuse qkv", "quantize int8 weight_only=true"]


@pytest.mark.parametrize("script", ["quantize int8", "fuse qkv; fp8 storage"])
def test_pipeline_directory(tmp_path, script):
    """A diffusers pipeline directory: the denoiser converted, the rest copied; the output is the
    pipeline save of ``from_pretrained → transform → save``."""
    from diffusers import DiffusionPipeline

    source = tmp_path / "pipe"
    models.tiny_sd_pipeline().save_pretrained(source, safe_serialization=True)
    pipe = DiffusionPipeline.from_pretrained(source, local_files_only=True)
    transformdsl.transform(pipe, script)
    reference = transformdsl.save(pipe, tmp_path / "reference")
    converted = transformdsl.convert(source, script, tmp_path / "converted")
    # diffusers' from_pretrained records where it read the component from; nothing else differs.
    assert_same_save(reference / "unet", converted / "unet", ignore_config=("_name_or_path",))
    meta = [json.loads((d / "transformdsl.json").read_text()) for d in (reference, converted)]
    assert meta[1]["components"] == meta[0]["components"]
    assert meta[1]["pipeline_class"] == meta[0]["pipeline_class"]
    got, expected = transformdsl.load(converted), transformdsl.load(reference)
    assert torch.equal(models.run(got), models.run(expected))


def test_pipeline_component_by_name(tmp_path):
    source = tmp_path / "pipe"
    models.tiny_sd_pipeline().save_pretrained(source, safe_serialization=True)
    converted = transformdsl.convert(source, "quantize int8", tmp_path / "out", component="text_encoder")
    meta = json.loads((converted / "transformdsl.json").read_text())
    assert meta["components"]["text_encoder"] == "transformdsl" and meta["components"]["unet"] == "library"
    pipe = transformdsl.load(converted)
    assert "Int8Linear" in {type(m).__name__ for m in pipe.text_encoder.modules()}
    with pytest.raises(LoadError, match="no component 'vea'.*text_encoder"):
        transformdsl.convert(source, "quantize int8", tmp_path / "bad", component="vea")


def test_units_are_blocks():
    units = split_units(models.tiny_flux())
    parts = [p for unit in units for p in unit.parts]
    assert ("transformer_blocks.0", True) in parts and ("single_transformer_blocks.1", True) in parts
    assert ("proj_out", True) in parts


def test_tied_weights_are_one_unit(sources, tmp_path):
    """GPT-2 ties lm_head to the token embedding: read and written together, saved once."""
    reference = reference_save(sources["gpt2"], "quantize int8", tmp_path / "reference")
    converted = transformdsl.convert(sources["gpt2"], "quantize int8", tmp_path / "converted")
    assert_same_save(reference, converted)
    aliases = json.loads((converted / "transformdsl.json").read_text())["tensors"]["aliases"]
    assert aliases == {"lm_head.weight": "transformer.wte.weight"}


def test_a_failing_statement_writes_nothing(sources, tmp_path, monkeypatch):
    """A statement failing in the third unit (after two were written): no output at all."""
    from transformdsl.transforms.quantize.quantization import Int8Quantization

    real, calls = Int8Quantization.apply, []

    def fails_on_third_unit(self, ctx, targets):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return real(self, ctx, targets)

    monkeypatch.setattr(Int8Quantization, "apply", fails_on_third_unit)
    out = tmp_path / "out"
    with pytest.raises(TransformError, match="line 1: 'quantize int8' failed: RuntimeError: disk on fire; "
                                             "nothing was written"):
        transformdsl.convert(sources["flux"], "quantize int8", out)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_interrupted_convert_keeps_the_previous_save(sources, tmp_path, monkeypatch):
    out = transformdsl.convert(sources["flux"], "quantize int8", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []
    real = persist_write.ShardWriter.add

    def interrupted(self, tensors):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(self, tensors)

    monkeypatch.setattr(persist_write.ShardWriter, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        transformdsl.convert(sources["flux"], "quantize nf4", out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_killed_convert_leaves_no_output_and_is_cleaned_up(sources, tmp_path):
    """SIGKILL in the middle: nothing at the target; the next run removes the temporary directory."""
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import time, transformdsl
        from transformdsl.persist import write
        real = write.ShardWriter.add
        def slow(self, tensors):
            real(self, tensors)
            print("unit", flush=True)
            time.sleep(60)
        write.ShardWriter.add = slow
        transformdsl.convert({str(sources["llama"])!r}, "quantize int8", {str(out)!r})
    """)
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().strip() == b"unit"
        assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not out.exists()
    transformdsl.convert(sources["llama"], "quantize int8", out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_what_it_cannot_stream(sources, tmp_path):
    with pytest.raises(LoadError, match="not a pipeline; drop component="):
        transformdsl.convert(sources["flux"], "quantize int8", tmp_path / "out", component="unet")
    with pytest.raises(LoadError, match="no such directory"):
        transformdsl.convert(tmp_path / "missing", "quantize int8", tmp_path / "out")


# --------------------------------------------------------------------------- memory

_MEMORY_PROBE = textwrap.dedent("""
    import json, sys
    import transformdsl

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024

    # Everything convert imports, imported and warmed up on a tiny model first: the fixed overhead.
    transformdsl.convert(sys.argv[3], "quantize int8", sys.argv[4])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    base = status("VmRSS")
    transformdsl.convert(sys.argv[1], "quantize int8", sys.argv[2])
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
""")


def _llama_checkpoint(directory: Path, layers: int) -> int:
    """A float32 Llama with ``layers`` blocks of 4 MiB each, saved by transformers; its bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_peak_memory_is_a_unit_not_the_model(tmp_path):
    """Peak RSS above the fixed overhead stays within a few units' bytes while the model is 48
    units: measured in a fresh process (/proc: the peak RSS since a reset, after a warm-up run on a
    tiny model)."""
    layers = 48
    size = _llama_checkpoint(tmp_path / "big", layers)
    unit = size / layers
    _llama_checkpoint(tmp_path / "tiny", 1)
    result = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(tmp_path / "big"), str(tmp_path / "out"),
                             str(tmp_path / "tiny"), str(tmp_path / "tiny-out")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    extra = (measured["peak"] - measured["base"]) * 2**20
    # A unit read (4 MiB) + its int8 output (1 MiB) + quantization scratch: far below the model (256 MiB).
    assert extra < 6 * unit + 16 * 2**20, (extra / 2**20, unit / 2**20, size / 2**20)
    assert extra < size / 8, (extra / 2**20, size / 2**20)


def test_command_line(sources, tmp_path):
    script = tmp_path / "small.tfm"
    script.write_text("quantize int8\n")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "transformdsl", "convert", str(script), "--model",
                             str(sources["llama"]), "--out", str(out), "--max-shard-size", "100KB"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"saved to {out}")
    assert (out / "model.safetensors.index.json").is_file()
    reference = reference_save(sources["llama"], "quantize int8", tmp_path / "reference")
    assert torch.equal(models.run(transformdsl.load(out)), models.run(transformdsl.load(reference)))
    bad = subprocess.run([sys.executable, "-m", "transformdsl", "convert", str(script), "--model",
                          str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"), "-q"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "no such directory" in bad.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("factory, script, message", [
    ("tiny_flux", "cache first_block", "'cache first_block' cannot be applied block by block"),
    ("tiny_llama", "attention eager\nquantize nf4", "'attention eager' changes the model as a whole, so convert "
                                                    "would read the whole checkpoint at once"),
])
def test_convert_refuses_what_it_cannot_stream_naming_the_statement(tmp_path, factory, script, message):
    """convert reads one block at a time; a statement that needs the live model, or the whole model at
    once, is refused before anything is written (not run on the whole checkpoint, not failed deep inside)."""
    import transformdsl
    from transformdsl import models

    getattr(models, factory)().save_pretrained(tmp_path / "source")
    with pytest.raises(transformdsl.TransformError, match=message):
        transformdsl.convert(tmp_path / "source", script, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- convert --workers N


def assert_same_bytes(one: Path, other: Path) -> None:
    """Every file of two saves, byte for byte, but for their save ids."""
    ids = [json.loads((d / "transformdsl.json").read_text())["save_id"].encode() for d in (one, other)]
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(other) for p in other.rglob("*") if p.is_file())
    for rel in files:
        assert (one / rel).read_bytes().replace(ids[0], b"ID") == (other / rel).read_bytes().replace(ids[1], b"ID"), rel


@pytest.mark.parametrize("name, script, shard", [
    ("llama", "fuse qkv; quantize int8 weight_only=true except lm_head", "5GiB"),
    ("llama", "quantize int4 group_size=32; compile", "100KB"),  # shard boundaries as one process draws them
    ("flux", "fp8 storage", "5GiB"),
    ("gpt2", "quantize w8a8", "5GiB"),  # tied embeddings: one unit, converted by the parent
    ("sd3", "quantize nf4", "5GiB"),
])
def test_workers_write_the_one_process_save_byte_for_byte(sources, tmp_path, name, script, shard):
    """``convert --workers 2`` (the command line, two spawned processes) writes every file of the
    one-process save, byte for byte (save id aside)."""
    from transformdsl.cli import main

    (tmp_path / "script.tfm").write_text(script.replace("; ", "\n") + "\n")
    one = transformdsl.convert(sources[name], transformdsl.parser.parse_file(tmp_path / "script.tfm"), tmp_path / "one",
                               max_shard_size=persist_write_size(shard))
    assert main(["convert", str(tmp_path / "script.tfm"), "--model", str(sources[name]), "--out",
                 str(tmp_path / "two"), "--workers", "2", "--max-shard-size", shard, "-q"]) == 0
    assert_same_bytes(one, tmp_path / "two")
    assert not [p for p in tmp_path.rglob(".workers")]


def persist_write_size(text: str) -> int:
    from transformdsl.cli import _byte_count

    return _byte_count(text)


def test_workers_convert_a_pipeline_and_a_lora(tmp_path):
    """A pipeline's denoiser and a LoRA file: the workers read the file the parent planned with, and the
    save is the one-process save."""
    from safetensors.torch import save_file

    source = tmp_path / "pipe"
    models.tiny_sd_pipeline().save_pretrained(source, safe_serialization=True)
    unet = models.tiny_sd_pipeline().unet
    generator = torch.Generator().manual_seed(0)
    adapter = {}
    for path, module in unet.named_modules():
        if type(module) is torch.nn.Linear and path.endswith("attn1.to_q") and path.startswith("up_blocks."):
            adapter[f"unet.{path}.lora_A.weight"] = torch.randn(4, module.in_features, generator=generator)
            adapter[f"unet.{path}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=generator)
    (tmp_path / "scripts").mkdir()
    save_file(adapter, str(tmp_path / "scripts" / "style.safetensors"))
    script = tmp_path / "scripts" / "style.tfm"
    script.write_text(f'lora "{tmp_path / "scripts" / "style.safetensors"}" scale=0.5 in up_blocks.*\nquantize int8 weight_only=true\n')
    parsed = transformdsl.parse(script.read_text(), filename=str(script))
    one = transformdsl.convert(source, parsed, tmp_path / "one")
    two = transformdsl.convert(source, parsed, tmp_path / "two", workers=2)
    assert_same_bytes(one, two)
    assert json.loads((two / "unet" / "transformdsl.json").read_text())["steps"][0]["record"]


class ExplodesOnASecondBlock(Transform):
    """Test-only, registered at run time: fails on the Linears of any list's second block."""

    verb = "explodetest"
    summary = "test-only: fails on the second block of a list"
    default_target = ("Linear",)

    def apply(self, ctx, targets):
        broken = [path for path in targets if ".1." in path]
        if broken:
            raise RuntimeError(f"disk on fire under {broken[0]}")
        return {"targets": list(targets)}


@pytest.fixture
def explodes():
    from transformdsl import registry

    registry.register(ExplodesOnASecondBlock)
    yield
    registry._TRANSFORMS.pop(ExplodesOnASecondBlock.key(), None)


def test_a_statement_failing_in_a_worker_is_the_one_process_error_and_writes_nothing(sources, tmp_path, explodes):
    """A transform registered at run time reaches the workers; failing in one, it ends the run with the
    message one process gives, and nothing is left at the output or beside it."""
    errors = []
    for workers in (1, 2):
        with pytest.raises(TransformError) as caught:
            transformdsl.convert(sources["flux"], "explodetest", tmp_path / "out", workers=workers)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert errors[0].startswith("line 1: 'explodetest' failed: RuntimeError: disk on fire under ")
    assert errors[0].endswith("nothing was written")
    assert [p.name for p in tmp_path.iterdir()] == []


def _token_samples(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 100, (1, 16), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("name, script, workers, samples", [
    ("llama", "quantize int4 group_size=32 method=gptq except lm_head", 2, 8),
    ("llama", "fuse qkv\nquantize int8 weight_only=true method=gptq except lm_head", 4, 8),
    ("gpt2", "quantize int8 weight_only=true method=gptq except lm_head", 3, 5),  # shares of 1 and 2 slices
])
def test_workers_share_the_calibration_samples_and_write_the_one_process_save(sources, tmp_path, name, script,
                                                                              workers, samples):
    """A GPTQ statement with ``workers=N``: each process runs the blocks on its share of the samples and
    the Hessians are summed in one order whatever the split, so the save is the one-process save, byte
    for byte (save id aside)."""
    from transformdsl.streaming import ContendedWarning

    data = _token_samples(samples)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # few samples: said by a warning
        one = transformdsl.convert(sources[name], script, tmp_path / "one", calibration=data)
        many = transformdsl.convert(sources[name], script, tmp_path / "many", calibration=data, workers=workers)
    assert_same_bytes(one, many)
    # the processes' threads (each this process's count) outnumber the cores: said, with what would not
    contended = [w for w in caught if w.category is ContendedWarning]
    processes = min(workers, samples)
    assert bool(contended) == (processes * torch.get_num_threads() > len(os.sched_getaffinity(0)))
    if contended:
        assert "thread(s) per process" in str(contended[0].message)


def test_a_helper_failing_on_its_share_of_the_samples_is_the_one_process_error(sources, tmp_path):
    """A sample that overflows, held by the second process: the run ends with the message one process
    gives (naming that sample), and nothing is written."""
    data = [models.sample_inputs("flux", seed=seed) for seed in range(6)]
    data[4][0][0][0, 0, 0] = float("inf")  # its hidden_states
    errors = []
    for workers in (1, 2):
        with warnings.catch_warnings(), pytest.raises(TransformError) as caught:
            warnings.simplefilter("ignore")
            transformdsl.convert(sources["flux"], "quantize int8 weight_only=true method=gptq in "
                                 "single_transformer_blocks.*", tmp_path / "out", calibration=data, workers=workers)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert "single_transformer_blocks.0 computes NaN or infinity on sample 4" in errors[0]
    assert [p.name for p in tmp_path.iterdir()] == []


def test_workers_refuse_calibrated_statements_and_bad_counts(sources, tmp_path):
    data = [models.sample_inputs("llama", seed=seed) for seed in range(2)]
    with pytest.raises(TransformError, match=r"line 1: 'quantize int4 group_size=32 method=awq except lm_head' "
                                             r"learns from calibration data in a way that processes holding "
                                             r"different samples cannot sum back exactly.*without workers=2"):
        transformdsl.convert(sources["llama"], "quantize int4 group_size=32 method=awq except lm_head",
                             tmp_path / "out", workers=2, calibration=data)
    with pytest.raises(TransformError, match=r"'quantize w8a8 smooth=0.5 method=gptq except lm_head' learns"):
        transformdsl.convert(sources["llama"], "quantize w8a8 smooth=0.5 method=gptq except lm_head",
                             tmp_path / "out", workers=2, calibration=data)
    with pytest.raises(TransformError, match="workers=0: the number of processes"):
        transformdsl.convert(sources["llama"], "quantize int8", tmp_path / "out", workers=0)
    assert not (tmp_path / "out").exists()
