"""What a new user meets in the first hour (round 3): the command line on real checkpoints.

Each test reproduces one thing a newcomer ran into (a bf16 checkpoint read in float32, a
library's log line about a package they do not need, a verify that silently compiles, ...)
and checks what the command says or does now.  Commands run in-process through
``transformdsl.cli.main``, except where the process itself is what is checked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from transformdsl.cli import main
from transformdsl.models import tiny_flux, tiny_llama, tiny_sd_pipeline

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse: usage errors
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory):
    """A bf16 Flux (diffusers), a bf16 Llama (transformers) and a pipeline whose UNet is bf16."""
    root = tmp_path_factory.mktemp("bf16")
    tiny_flux().to(torch.bfloat16).save_pretrained(root / "flux")
    tiny_llama().to(torch.bfloat16).save_pretrained(root / "llama")
    pipe = tiny_sd_pipeline()
    pipe.unet = pipe.unet.to(dtype=torch.bfloat16)
    pipe.save_pretrained(root / "pipe")
    return root


# --------------------------------------------------------------------------- the checkpoint's dtype


def test_explain_reads_a_bf16_diffusers_checkpoint_in_bf16_and_says_so(capsys, bf16_dirs):
    status, out, _ = cli(capsys, "explain", EXAMPLES / "demo.tfm", "--model", bf16_dirs / "flux")
    assert status == 0
    first = out.splitlines()[0]
    # 95.1 KiB in float32 (diffusers' default) before; the checkpoint's own dtype and size now
    assert first == "model: FluxTransformer2DModel: 87 modules, 47.5 KiB of parameters in bfloat16"


@pytest.mark.parametrize("name, dtype, size", [("float32", "float32", "95.1 KiB"), ("float16", "float16", "47.5 KiB")])
def test_dtype_flag_reads_the_model_in_that_dtype(capsys, bf16_dirs, name, dtype, size):
    status, out, _ = cli(capsys, "explain", EXAMPLES / "demo.tfm", "--model", bf16_dirs / "flux", "--dtype", name)
    assert status == 0
    assert out.splitlines()[0].endswith(f"{size} of parameters in {dtype}")


def test_dtype_flag_casts_a_builtin(capsys):
    status, out, _ = cli(capsys, "explain", EXAMPLES / "gpt2_int8.tfm", "--model", "gpt2", "--dtype", "bfloat16")
    assert status == 0
    assert out.splitlines()[0].endswith("of parameters in bfloat16")


def test_a_transformers_and_a_pipeline_checkpoint_keep_their_dtypes(capsys, bf16_dirs):
    status, out, _ = cli(capsys, "explain", EXAMPLES / "quantize_llm.tfm", "--model", bf16_dirs / "llama")
    assert status == 0 and out.splitlines()[0].endswith("in bfloat16")
    status, out, _ = cli(capsys, "explain", EXAMPLES / "sd_pipeline.tfm", "--model", bf16_dirs / "pipe")
    assert status == 0
    # the UNet was read in float32 before (diffusers' default), the text encoder in its own float32
    assert out.splitlines()[0].endswith("of parameters in float32 (unet: bfloat16)")


def test_apply_on_a_bf16_checkpoint_saves_a_smaller_model_than_its_input(capsys, bf16_dirs, tmp_path):
    status, out, _ = cli(capsys, "apply", EXAMPLES / "demo.tfm", "--model", bf16_dirs / "flux",
                         "--out", tmp_path / "out")
    assert status == 0, out
    source = sum(f.stat().st_size for f in (bf16_dirs / "flux").glob("*.safetensors"))
    saved = sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors"))
    assert saved < source  # before: 1.32x the input (74,496 B for 56,512: unquantized tensors in float32)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_slice("proj_out.weight").get_dtype() == "BF16"  # left unquantized: as it was read


def test_dtype_is_refused_for_a_transformdsl_save(capsys, tmp_path):
    assert cli(capsys, "apply", EXAMPLES / "gpt2_int8.tfm", "--model", "gpt2", "--out", tmp_path / "s", "-q")[0] == 0
    status, _, err = cli(capsys, "explain", EXAMPLES / "gpt2_int8.tfm", "--model", tmp_path / "s",
                         "--dtype", "float16")
    assert status == 1
    assert "read in the dtypes it was saved in; drop --dtype" in err


def test_the_plan_json_names_the_dtype(capsys, bf16_dirs):
    status, out, _ = cli(capsys, "explain", EXAMPLES / "demo.tfm", "--model", bf16_dirs / "flux", "--json")
    assert status == 0
    assert json.loads(out)["dtypes"] == {"": "bfloat16"}


# --------------------------------------------------------------------------- bitsandbytes' import line


def test_bitsandbytes_kernels_line_is_dropped_at_its_logger():
    """The filter sits on bitsandbytes' logger from ``import transformdsl`` on, before diffusers or
    transformers import bitsandbytes (on AVX512-BF16 CPUs without ``kernels`` it logs at import)."""
    import logging

    import transformdsl  # noqa: F401

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1,
                               "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make "
                               "sure you already `pip install kernels`", ("No module named 'kernels'",), None)
    assert not logger.filter(record)
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "something else", (), None)
    assert logger.filter(other)


@pytest.mark.parametrize("logger_name, message, args", [
    # measured with torchao 0.18 beside diffusers 0.38 on a CPU-only machine: five lines on every command
    ("torchao", "Failed to load /site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load this library", ()),
    ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
     "value type. Calling register_constant() on Enum subclasses is deprecated and will be an error in a future "
     "release.", ("<enum 'KernelPreference'>",)),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects. This may affect "
     "loading checkpoints serialized with `torchao`", ()),
])
def test_torchaos_import_lines_are_dropped_at_their_loggers(logger_name, message, args):
    """torchao is imported by diffusers where it is installed; its import lines say nothing a user of a
    CPU can act on (quiet.py says why each one goes).  torchao's is kept where a CUDA device is."""
    import logging

    import transformdsl  # noqa: F401

    logger = logging.getLogger(logger_name)
    record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, args, None)
    assert bool(logger.filter(record)) == (logger_name == "torchao" and torch.cuda.is_available())
    assert bool(logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "something else", (), None)))


def test_make_demo_prints_no_kernels_line():
    """``make demo`` runs ``python -m transformdsl demo`` (Flux, LLM.int8): its whole output."""
    done = subprocess.run([sys.executable, "-m", "transformdsl", "demo"], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "-- save and reload" in output
    assert "gemm_4bit_forward" not in output and "pip install kernels" not in output


# --------------------------------------------------------------------------- inspect: what the stock loader needs


def test_inspect_says_a_quantized_diffusers_save_needs_a_gpu_for_the_stock_loader(capsys, tmp_path):
    script = tmp_path / "q.tfm"
    script.write_text("quantize int8 except norm, proj_out\n")
    assert cli(capsys, "apply", script, "--model", "flux", "--out", tmp_path / "d", "--format", "diffusers", "-q")[0] == 0
    status, out, _ = cli(capsys, "inspect", tmp_path / "d")
    assert status == 0
    # before: "saved in the diffusers layout: its stock from_pretrained loads it"
    assert ("saved in the diffusers layout: its stock from_pretrained loads it only with a GPU (CUDA, XPU or MPS): "
            "diffusers' bitsandbytes loader refuses without one") in out
    status, out, _ = cli(capsys, "inspect", tmp_path / "d", "--json")
    assert "GPU" in json.loads(out)["interop"]["stock_needs"]
    if not (torch.cuda.is_available() or torch.xpu.is_available() or torch.mps.is_available()):
        from diffusers import FluxTransformer2DModel

        with pytest.raises(RuntimeError, match="No GPU found"):  # what the line warns of, on this machine
            FluxTransformer2DModel.from_pretrained(str(tmp_path / "d"), local_files_only=True)


def test_inspect_of_a_quantized_transformers_save_needs_nothing_more(capsys, tmp_path):
    script = tmp_path / "q.tfm"
    script.write_text("quantize int8\n")
    assert cli(capsys, "apply", script, "--model", "llama", "--out", tmp_path / "t",
               "--format", "transformers", "-q")[0] == 0
    status, out, _ = cli(capsys, "inspect", tmp_path / "t")
    assert "saved in the transformers layout: its stock from_pretrained loads it\n" in out


# --------------------------------------------------------------------------- verify and compile


def test_apply_verify_checks_before_compiling_and_compiles_nothing(capsys, tmp_path):
    """Before: the verify samples ran through the compiled model (a full torch.compile of each, with
    no word); now the check runs on the transformed model just before ``compile`` and says so."""
    from torch._dynamo.utils import counters

    script = tmp_path / "c.tfm"
    script.write_text("fuse qkv in *Attention\ncompile fullgraph=false\n")
    frames = counters["frames"]["total"]
    status, out, _ = cli(capsys, "apply", script, "--model", "gpt2", "--verify")
    assert status == 0, out
    assert counters["frames"]["total"] == frames  # nothing was compiled during apply
    lines = [line for line in out.splitlines() if line.startswith(("line ", "verify:"))]
    assert lines[1].startswith("verify: kl ")  # GPT-2's logits: KL per token (spec.md "Numerical guard")
    assert lines[1].endswith("(checked before compile: it changes no weight, and would compile every sample)")
    assert lines[2].startswith("line 2: compile fullgraph=false")


def test_verify_before_compile_still_rolls_back(monkeypatch):
    from transformdsl import TransformError, transform
    from transformdsl.models import run, tiny_gpt2
    from transformdsl.transforms.quantize.quantization import Int8Quantization

    model = tiny_gpt2()
    before, output = {k: v.clone() for k, v in model.state_dict().items()}, run(model)
    monkeypatch.setattr(Int8Quantization, "error_bound", 1e-6)
    with pytest.raises(TransformError, match="more than the script's bound"):
        transform(model, "quantize int8\ncompile fullgraph=false\n", verify=True)
    assert getattr(model, "_compiled_call_impl", None) is None  # the compile statement never ran
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(run(model), output)


# --------------------------------------------------------------------------- the script caps count code, not comments


def test_a_well_commented_script_is_not_refused():
    from transformdsl.parser import parse

    lines = []
    for i in range(300):  # 300 comment lines (with commas and '=' in their prose) around 10 statements
        lines.append(f"# step {i}: keep norm, embed and the head in float; threshold=6 is the default")
        if i % 30 == 0:
            lines.append(f"quantize int8 in layers.{i // 30} except norm  # trailing, comment = fine")
    script = parse("\n".join(lines))  # before: "script has 310 statements or comments; the limit is 256"
    assert len(script.statements) == 10


def test_commas_inside_a_quoted_value_are_not_selectors():
    from transformdsl.parser import parse

    ratios = ",".join(["0.98"] * 400)  # a calibrated mag cache for 400 steps: one value, not 399 selectors
    script = parse(f'cache mag mag_ratios="{ratios}" num_inference_steps=400\n')
    assert script.statements[0].options[0].value == ratios


@pytest.mark.parametrize("text, message", [
    ("fuse qkv\n" * 257, "script has 257 statements; the limit is 256"),
    ("quantize int8 except " + ", ".join(f"a{i}" for i in range(258)) + "\n", "script has 257 commas (selectors)"),
    # '#' inside a quoted string is no comment: what follows it is counted
    ("".join(f'quantize int8 in re:"a#{i}" component=x\n' for i in range(257)), "script has 257 statements"),
])
def test_the_caps_still_count_statements_selectors_and_options(text, message):
    from transformdsl import ScriptError
    from transformdsl.parser import parse

    with pytest.raises(ScriptError, match=re.escape(message)):
        parse(text)


# --------------------------------------------------------------------------- --verify on every model kind


@pytest.mark.parametrize("model_id", [
    "transformers/ViT", "transformers/CLIP-vision", "transformers/SigLIP-vision", "transformers/Whisper",
    "diffusers/UNet2DModel[UNetLDMModel]", "diffusers/UNet2DModel[NCSNppModel]", "transformers/BERT",
])
def test_sample_inputs_cover_vision_speech_and_unet2d_models(model_id):
    """Before: 'not enough values to unpack' (input_ids given to ViT), Whisper's 'expects the mel input
    features to be of length 60', 'no sample inputs for a UNet2DModel'."""
    from tests.zoo import corpus
    from transformdsl.models import run, sample_inputs_problem

    model, _ = corpus.build(corpus.entry(model_id))
    assert sample_inputs_problem(model) is None
    assert torch.isfinite(run(model)).all()


def test_apply_verify_on_a_saved_vision_model(capsys, tmp_path):
    from tests.zoo import corpus

    model, _ = corpus.build(corpus.entry("transformers/ViT"))
    model.save_pretrained(tmp_path / "vit")
    script = tmp_path / "q.tfm"
    script.write_text("quantize int8\n")
    status, out, err = cli(capsys, "apply", script, "--model", tmp_path / "vit", "--verify")
    assert status == 0, err
    assert "verify: rms " in out and "within the bound" in out  # ViTModel's hidden states: relative RMS


def test_apply_verify_on_a_model_without_sample_inputs_says_why_before_anything_runs(capsys, tmp_path):
    from tests.zoo import corpus

    model, _ = corpus.build(corpus.entry("diffusers/WanTransformer3DModel"))
    model.save_pretrained(tmp_path / "wan")
    status, out, err = cli(capsys, "apply", EXAMPLES / "demo.tfm", "--model", tmp_path / "wan", "--verify",
                           "--out", tmp_path / "out")
    assert (status, out) == (1, "")  # no plan printed, nothing transformed
    assert not (tmp_path / "out").exists()
    # before: "verify: cannot run the model on its sample input before transforming: ValueError: no sample
    # inputs for a WanTransformer3DModel; supported: ..., PreTrainedModel, DiffusionPipeline and subclasses;
    # drop --verify: the command line can feed only the models it knows their sample input ..."
    assert err == ("error: --verify runs the model on a sample input, which the command line makes from the model's "
                   "config for UNet2DConditionModel, UNet2DModel, SD3Transformer2DModel, FluxTransformer2DModel, "
                   "transformers models whose main input is input_ids, pixel_values or input_features, and diffusers "
                   "pipelines (and subclasses): not for a WanTransformer3DModel; drop --verify, or verify from "
                   "Python, where transform() takes sample inputs of your own (nothing was changed)\n")


# --------------------------------------------------------------------------- convert speaks like apply


def test_convert_prints_the_plan_and_a_line_per_statement(capsys, bf16_dirs, tmp_path):
    status, out, err = cli(capsys, "convert", EXAMPLES / "demo.tfm", "--model", bf16_dirs / "flux",
                           "--out", tmp_path / "out")
    assert status == 0, err
    lines = out.splitlines()
    # before: only "saved to DIR"; the plan counted the meta skeleton in float32 (95.1 KiB)
    assert lines[0] == "model: FluxTransformer2DModel: 87 modules, 47.5 KiB of parameters in bfloat16"
    assert "1. line 4: fuse qkv in *Attention" in lines
    summary = [line for line in lines if line.startswith("line ")]
    assert [line.split(":")[0] for line in summary] == ["line 4", "line 5"]
    assert summary[1].startswith("line 5: quantize int8 except norm: 14 module(s), 25.1 KiB -> ")
    assert lines[-2].startswith("done in ") and lines[-1] == f"saved to {tmp_path / 'out'}"


def test_convert_quiet_prints_nothing(capsys, bf16_dirs, tmp_path):
    assert cli(capsys, "convert", EXAMPLES / "demo.tfm", "--model", bf16_dirs / "flux", "--out", tmp_path / "o",
               "-q")[:2] == (0, "")


def test_convert_of_a_pipeline_points_component_lines_at_component_flag(capsys, bf16_dirs, tmp_path):
    status, out, err = cli(capsys, "convert", EXAMPLES / "sd_pipeline.tfm", "--model", bf16_dirs / "pipe",
                           "--out", tmp_path / "out")
    assert (status, out) == (1, "")
    assert not (tmp_path / "out").exists()
    # before: "component= applies to pipelines; this model is a single module"
    assert ("component=text_encoder: convert streams one pipeline component per run, and this run converts "
            "'unet'") in err
    assert "hint: convert text_encoder in a run of its own: --component text_encoder" in err


def test_convert_accepts_component_lines_naming_the_converted_component(capsys, bf16_dirs, tmp_path):
    script = tmp_path / "te.tfm"
    script.write_text("quantize int8 except norm component=text_encoder\n")
    status, out, err = cli(capsys, "convert", script, "--model", bf16_dirs / "pipe", "--component", "text_encoder",
                           "--out", tmp_path / "out")
    assert status == 0, err
    assert "line 1: quantize int8 except norm component=text_encoder: 12 module(s)" in out
    from transformdsl import load

    pipe = load(tmp_path / "out")
    assert any(p.dtype == torch.int8 for p in pipe.text_encoder.parameters())
    assert not any(p.dtype == torch.int8 for p in pipe.unet.parameters())


# --------------------------------------------------------------------------- plan() on a meta-device model


def _meta_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from transformdsl.models import LLAMA_CONFIG

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))


def test_plan_on_a_meta_model_counts_original_and_fused_layers_alike():
    """Before: the fused qkv layers counted (2) and every original Linear was skipped as 'on the meta
    device' (8); a 96-layer Llama showed 96 quantized layers instead of 480."""
    from transformdsl import plan
    from transformdsl.models import tiny_llama

    meta = plan(_meta_llama(), "fuse qkv in *Attention\nquantize int8")
    real = plan(tiny_llama(), "fuse qkv in *Attention\nquantize int8")
    assert meta.steps[1].targets == real.steps[1].targets and len(meta.steps[1].targets) == 10
    assert not meta.steps[1].skipped
    assert meta.skeletons == [""] and real.skeletons == []
    assert str(meta).splitlines()[1] == ("weights: on the meta device, none loaded: planned as they will be once "
                                         "loaded (transform needs them loaded)")


def test_transform_refuses_a_model_with_no_weight_loaded():
    from transformdsl import TransformError, transform

    model = _meta_llama()
    with pytest.raises(TransformError, match="weights are all on the meta device .none loaded.: load them before "
                                             "transforming"):
        transform(model, "quantize int8")
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_a_partly_loaded_model_skips_its_meta_layers_fused_or_not():
    from transformdsl import plan
    from transformdsl.models import tiny_llama

    model = tiny_llama()
    model.model.layers[1].to_empty(device="meta")  # as an offloaded block: no data here
    the_plan = plan(model, "fuse qkv in *Attention\nquantize int8")
    skipped = {path: reason for path, reason in the_plan.steps[1].skipped}
    meta = "its weight is on the meta device (not loaded)"
    assert skipped["model.layers.1.self_attn.qkv_proj"] == meta  # before: the fused one was quantized
    assert skipped["model.layers.1.mlp.up_proj"] == meta
    assert "model.layers.0.self_attn.qkv_proj" in the_plan.steps[1].targets


# --------------------------------------------------------------------------- small things


def test_a_shape_mismatch_in_a_bf16_save_is_said_in_bf16(tmp_path):
    from safetensors.torch import load_file, save_file

    from transformdsl import LoadError, load

    tiny_llama().to(torch.bfloat16).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :32].contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(LoadError) as caught:
        load(tmp_path / "m")
    # before: "... but the model expects float32[256, 64]" (the skeleton's precision, not the file's)
    assert ("tensor 'lm_head.weight' is bfloat16[256, 32] in the file but the model expects bfloat16[256, 64]"
            in str(caught.value))


def test_pyproject_license_is_an_spdx_string_with_a_setuptools_that_reads_it():
    """setuptools warned that ``license = {text = ...}`` stops building after 2027-02-18; the SPDX
    string form needs setuptools 77 (checked: ``pip wheel --no-deps .`` builds with no license warning)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in data["project"].get("classifiers", []))
    (requirement,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert requirement.replace(" ", "") == "setuptools>=77"


@pytest.mark.parametrize("fmt, model, text", [
    ("transformers", "llama", "quantize int8 weight_only=true"),
    ("diffusers", "flux", "quantize int8 weight_only=true except norm, proj_out"),
    ("compressed-tensors", "llama", "quantize int8 weight_only=true")])
def test_the_interchange_matrix_has_the_weight_only_int8_row_and_it_holds(fmt, model, text, tmp_path):
    """spec.md 'Interchange': the row says each format refuses weight-only int8; so does save."""
    from transformdsl import TransformError, save, transform
    from transformdsl.models import resolve_model

    spec = (ROOT / "spec.md").read_text()
    table = spec[spec.index("What each transform becomes"):spec.index("One `quantization_config` per checkpoint")]
    (row,) = [line for line in table.splitlines() if line.startswith("| `quantize int8 weight_only=true` |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert all(cell.startswith("refused") for cell in cells[1:]), row
    quantized = transform(resolve_model(model), text)
    with pytest.raises(TransformError, match="weight-only int8|carries fp8 layers|cannot carry"):
        save(quantized, tmp_path / "out", format=fmt)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- int8's default threshold


@pytest.mark.parametrize("text, noted", [
    ("quantize int8", True), ("quantize int8 threshold=0", False), ("quantize int8 threshold=6", False),
    ("quantize int8 weight_only=true", False)])
def test_the_plan_says_where_int8_default_differs_from_transformers(text, noted):
    from transformdsl import plan
    from transformdsl.transforms.quantize.quantization import THRESHOLD_NOTE

    assert (THRESHOLD_NOTE in plan(tiny_llama(), text).steps[0].notes) is noted
    assert "BitsAndBytesConfig(load_in_8bit=True) use 6" in THRESHOLD_NOTE


def _llama_with_outlier_channels(scale: float):
    """The built-in Llama with two hidden channels scaled up in every norm: the large activations of a
    few fixed dimensions that real LLMs have (LLM.int8's outlier features); random weights have none."""
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17]] *= scale
    return model


def test_threshold_6_keeps_more_quality_with_outlier_activations_and_changes_nothing_without():
    """What the note says, measured (seeds 0-2): the built-in Llama as it is, the same error either way (no
    activation reaches 6); with two channels x20, 0.093/0.083/0.036 at threshold 0, 0.030/0.041/0.021 at 6."""
    from transformdsl import transform
    from transformdsl.executor import relative_error
    from transformdsl.models import run

    def errors(make, threshold):
        reference = [run(make(), seed=s) for s in range(3)]
        quantized = transform(make(), f"quantize int8 threshold={threshold}")
        return [relative_error(r, run(quantized, seed=s)) for s, r in enumerate(reference)]

    assert errors(tiny_llama, 0) == errors(tiny_llama, 6)
    outliers = lambda: _llama_with_outlier_channels(20.0)  # noqa: E731
    at_0, at_6 = errors(outliers, 0), errors(outliers, 6)
    assert all(b < a for a, b in zip(at_0, at_6)), (at_0, at_6)
    # threshold 0 moves the output past LLM.int8's declared bound (0.05); 6 stays within it
    assert max(at_6) < 0.05 < max(at_0), (at_0, at_6)


# --------------------------------------------------------------------------- how to run the command


def test_readme_and_first_hour_say_how_to_reach_the_command():
    """``make demo`` installs ``transformdsl`` into .venv/bin, which is not on PATH: the first command a
    newcomer typed failed ('transformdsl: command not found') and neither page said why."""
    makefile = (ROOT / "Makefile").read_text()
    assert "VENV := .venv" in makefile and "-e '.[test,bench]'" in makefile  # the script lands in .venv/bin
    assert 'transformdsl = "transformdsl.cli:main"' in (ROOT / "pyproject.toml").read_text()
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):readme.index("## Command line")]
    assert ". .venv/bin/activate" in setup and ".venv/bin/transformdsl" in setup
    first_hour = (ROOT / "docs" / "FIRST-HOUR.md").read_text()
    activate, first_command = first_hour.index("$ . .venv/bin/activate"), first_hour.index("$ transformdsl ")
    assert activate < first_command
