"""What a new user meets in the first hour (issue 14): an instant command line, honest messages.

The command line is run in subprocesses where what is measured is the process itself (which
modules it imports, how it answers Ctrl-C), in-process otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from golden import EXAMPLES

import transformdsl
from transformdsl import registry
from transformdsl.cli import main
from transformdsl.errors import ScriptError
from transformdsl.parser import parse, parse_file
from transformdsl.validate import validate

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


# --------------------------------------------------------------------------- an instant command line

#: Runs the command line in a fresh interpreter, then reports which heavy libraries it imported.
_PROBE = """
import sys
from transformdsl.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit_:
    status = exit_.code
heavy = sorted(m for m in ("torch", "diffusers", "transformers", "bitsandbytes", "hqq", "numpy")
               if m in sys.modules)
print("IMPORTED", ",".join(heavy), file=sys.stderr)
sys.exit(status)
"""


@pytest.mark.parametrize("argv, status", [
    (["check", *sorted(str(p) for p in EXAMPLES.glob("*.tfm"))], 0),
    (["fmt", "--check", *sorted(str(p) for p in EXAMPLES.glob("*.tfm"))], 0),
    (["--help"], 0),
    (["--version"], 0),
    (["check", "--help"], 0),
    (["check", "TYPO"], 1),  # the error path too: near-miss suggestions come from the registry's keys
    (["fmt", "-"], 0),
], ids=["check", "fmt", "help", "version", "check-help", "check-typo", "fmt-stdin"])
def test_light_commands_import_no_model_library(argv, status, tmp_path):
    typo = tmp_path / "typo.tfm"
    typo.write_text("fuse qkv in *Attention\nquantise int8 except norm\n")
    argv = [str(typo) if a == "TYPO" else a for a in argv]
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=120, input="quantize   int8\n")
    assert done.returncode == status, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "IMPORTED", done.stderr
    if status:
        assert "did you mean 'quantize'" in done.stderr, done.stderr


#: Plans each script on a plain torch model in a fresh interpreter, then reports the backends imported.
_PLAN_PROBE = """
import sys, torch, transformdsl
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))
for text in sys.argv[2:]:
    str(transformdsl.plan(model, text))
for i, done in enumerate(("quantize int8 weight_only=true", "fp8 storage")):  # plain torch, saved and loaded
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))
    transformdsl.transform(fresh, done)
    transformdsl.save(fresh, f"{sys.argv[1]}-{i}")
    transformdsl.load(f"{sys.argv[1]}-{i}", model=torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                                                      torch.nn.Linear(16, 16)))
backends = ("bitsandbytes", "hqq", "torch._dynamo", "torch._inductor", "diffusers", "transformers", "torchao")
print("IMPORTED", ",".join(m for m in backends if m in sys.modules))
"""


def test_planning_imports_no_backend(tmp_path):
    """``explain`` (planning) imports a backend only where the model's own library does: planning
    every transform on a plain torch model imports no quantization library, no dynamo, no inductor;
    nor do applying, saving and loading a transform that needs none."""
    scripts = ["fuse qkv", "quantize int8 threshold=6", "quantize nf4 double_quant=true", "quantize hqq bits=4",
               "quantize int8 weight_only=true", "fp8 storage", "fp8 native", "compile fullgraph=true",
               "compile regional in Linear", "fuse bias_dropout_residual"]
    done = subprocess.run([sys.executable, "-c", _PLAN_PROBE, str(tmp_path / "saved"), *scripts], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "IMPORTED", done.stdout


def test_fp8_marks_its_capability_check_constant_as_torch_does():
    """fp8.py marks ``_cuda_has_fp8_matmul`` for dynamo without importing it; the marker must stay
    the one ``torch.compiler.assume_constant_result`` sets, or compile would trace the check."""
    import torch

    from transformdsl.transforms.fp8 import cuda as fp8_cuda

    marked = torch.compiler.assume_constant_result(lambda: None)
    attributes = {name for name in vars(marked) if name.startswith("_dynamo")}
    assert attributes == {"_dynamo_marked_constant"}
    assert fp8_cuda._cuda_has_fp8_matmul._dynamo_marked_constant is True


def test_import_transformdsl_imports_no_torch():
    code = "import sys, transformdsl; transformdsl.parse('quantize int8'); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, timeout=60).returncode == 0


def test_public_functions_show_their_real_signatures_and_docs():
    from transformdsl import executor, persist, planner

    assert transformdsl.transform is executor.transform
    assert transformdsl.save is persist.save and transformdsl.load is persist.load
    assert transformdsl.plan is planner.plan and transformdsl.Plan is planner.Plan
    parameters = inspect.signature(transformdsl.transform).parameters
    assert {"model", "script", "progress", "log", "verify", "verify_inputs"} <= set(parameters)
    assert "max_shard_size" in inspect.signature(transformdsl.save).parameters
    assert {"device", "mmap", "model"} <= set(inspect.signature(transformdsl.load).parameters)
    for name in ("parse", "plan", "transform", "save", "load"):
        function = getattr(transformdsl, name)
        assert "kwargs" not in str(inspect.signature(function)), name
        assert len(inspect.getdoc(function)) > 80, name
    assert set(transformdsl.__all__) <= set(dir(transformdsl))


def test_spec_names_every_command():
    """spec.md's command list (issue 14: it left out ``fmt``) is the command line's own list."""
    import argparse
    import re

    from transformdsl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = re.search(r"Command line: `transformdsl ([a-z|]+)` and `--version`", (ROOT / "spec.md").read_text())
    assert listed and listed.group(1).split("|") == list(sub.choices)


def test_version(capsys):
    status, out, _ = cli(capsys, "--version")
    assert (status, out) == (0, f"transformdsl {transformdsl.__version__}\n")


# --------------------------------------------------------------------------- the declarations `check` uses

#: What a declaration states (what `check` validates with), which its implementation must not restate.
DECLARED = ("verb", "mode", "summary", "Options", "default_target", "default_except", "honoured_declarations",
            "runs_after", "runs_before", "exclusive", "overrides", "changes_weights", "requires_scope",
            "record_version", "switches", "quant_methods", "streams", "incompatible", "error_bound")


@pytest.mark.parametrize("key", registry.keys())
def test_implementations_add_nothing_to_their_declarations(key):
    declared, implemented = registry.declaration(key), registry.get(key)
    assert issubclass(implemented, declared)
    assert declared.__module__.startswith("transformdsl.transforms.")
    restated = [name for name in DECLARED if getattr(implemented, name) is not getattr(declared, name)]
    assert restated == [], f"{implemented.__module__}.{implemented.__qualname__} restates {restated}"


_SCRIPTS = [
    "fp8 native scaling=row compute=float16",
    "quantize hqq group_size=12 bits=5\nquantize hqq group_size=64 compute=bf16",
    "compile\ncompile regional in x",
    "quantize int9\nfuse qkvv\nfrobnicate",
    "quantize int8 threshold=-1 has_fp16_weights=maybe",
    "fp8 storage dtype=e4m3 compute=half\nfp8 native\ncompile fullgraph=true mode=max-autotune",
    "fuse qkv\nquantize nf4 compute=bfloat16 double_quant=true component=unet default_except=false",
    "compile regional",
    "fuse bias_act_dropout backend=triton",
]


@pytest.mark.parametrize("text", _SCRIPTS + [p.read_text() for p in sorted(EXAMPLES.glob("*.tfm"))])
def test_declarations_validate_exactly_as_the_implementations(text):
    def outcome(transforms):
        try:
            validated = validate(parse(text), transforms)
        except ScriptError as exc:
            return str(exc)
        return [(t.key(), dataclasses.asdict(t.options), t.common, t.statement) for t in validated.steps]

    declared = outcome(registry.declarations())
    assert declared == outcome(None)


# --------------------------------------------------------------------------- input and exits


def test_a_byte_order_mark_is_accepted(tmp_path, capsys):
    path = tmp_path / "bom.tfm"
    path.write_bytes("\ufefffuse qkv in *Attention\nquantize int8\n".encode())
    assert [s.key for s in parse_file(path).statements] == ["fuse qkv", "quantize int8"]
    assert cli(capsys, "check", path)[0] == 0
    bad = tmp_path / "bad.tfm"
    bad.write_bytes("\ufeffquantize int9\n".encode())
    status, _, err = cli(capsys, "check", bad)
    assert status == 1 and err.startswith(f"{bad}:1:10: unknown mode 'int9'")


def test_every_example_is_in_canonical_form(capsys):
    status, out, _ = cli(capsys, "fmt", "--check", *sorted(EXAMPLES.glob("*.tfm")))
    assert (status, out) == (0, "")


def _wait_for_library(pid: int, name: str, timeout: float = 120.0) -> None:
    """Wait until the process has mapped a shared library (it is then running transformdsl's code)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if name in Path(f"/proc/{pid}/maps").read_text():
                return
        except OSError:
            return
        time.sleep(0.01)


# From transformdsl's first line on: the interpreter's own start-up, before any of it runs, is Python's.
# The signal lands while torch and then the model library are being imported (the "first seconds").
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the command's progress")
@pytest.mark.parametrize("delay", [0.0, 1.0, 2.0])
def test_ctrl_c_at_any_moment_exits_130_with_one_line(delay):
    process = subprocess.Popen([sys.executable, "-m", "transformdsl", "explain", str(EXAMPLES / "demo.tfm"),
                                "--model", "gpt2"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _wait_for_library(process.pid, "libtorch")
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    if process.returncode == 0:  # finished before the signal: nothing to check
        pytest.skip("the command finished first")
    if process.returncode == -signal.SIGINT:
        # The signal landed while the interpreter was shutting down (Python has put the default
        # handler back by then): the process ends by the signal itself, which a shell reports as
        # 130 too, and still prints no traceback.
        assert err in ("", "interrupted\n"), err
        return
    assert (process.returncode, err) == (130, "interrupted\n")


def test_quiet_silences_the_model_libraries(tmp_path):
    # Building the tiny pipeline makes transformers warn (torchvision) and reloading it makes
    # diffusers draw a progress bar: -q shows neither.
    out = tmp_path / "sd"
    for argv in (["apply", "-q", EXAMPLES / "sd_pipeline.tfm", "--model", "sd-pipeline", "--out", out],
                 ["explain", "-q", EXAMPLES / "sd_pipeline.tfm", "--model", out]):
        done = subprocess.run([sys.executable, "-m", "transformdsl", *map(str, argv)], capture_output=True,
                              text=True, env=ENV, cwd=ROOT, timeout=300)
        assert (done.returncode, done.stderr) == (0, ""), argv


def test_apply_without_out_says_the_result_is_discarded(capsys):
    status, out, err = cli(capsys, "apply", EXAMPLES / "gpt2_int8.tfm", "--model", "gpt2")
    assert status == 0 and "line 6: quantize int8 threshold=6.0" in out
    assert err == "note: no --out DIR given: the transformed model was checked and discarded, not saved\n"


def test_model_may_be_a_transformdsl_save(capsys, tmp_path):
    saved = tmp_path / "gpt2-int8"
    assert cli(capsys, "apply", "-q", EXAMPLES / "gpt2_int8.tfm", "--model", "gpt2", "--out", saved)[0] == 0
    status, out, err = cli(capsys, "explain", "--json", EXAMPLES / "gpt2_int8.tfm", "--model", saved)
    # The save is loaded with its transforms: its layers are int8 already, so nothing is left to do.
    assert (status, err) == (0, "")
    step = json.loads(out)["steps"][0]
    assert step["targets"] == [] and len(step["skipped"]) == 8


# --------------------------------------------------------------------------- hints that work


def apply_hint(text: str, hint: str) -> str:
    """The script with a checked hint's edits made ("add 'except X' to line 1 and 'in X' to line 2")."""
    import re

    lines = text.splitlines()
    for clause, selectors, line in re.findall(r"'(except|in) ([^']+)' to line (\d+)", hint):
        lines[int(line) - 1] += f" {clause} {selectors}"
    return "\n".join(lines)


@functools.cache
def tiny(name: str):
    from transformdsl.models import BUILTIN

    return BUILTIN[name]()


@pytest.mark.parametrize("model, text", [
    ("flux", "quantize int8\nquantize nf4"),
    ("flux", "quantize int8 except norm\nfp8 native Linear in transformer_blocks.*"),
    ("llama", "quantize int8\nquantize nf4 in model.layers.1"),
    ("flux", "fp8 storage in transformer_blocks\nquantize nf4"),
    ("llama", "quantize hqq\nquantize int8 in *Attention"),
])
def test_a_conflict_gets_one_hint_and_it_works(model, text):
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(tiny(model), text)
    (problem,) = info.value.problems
    assert problem.hint.endswith("(checked: the script then plans)"), problem.hint
    fixed = transformdsl.plan(tiny(model), apply_hint(text, problem.hint))
    assert all(step.targets for step in fixed.steps)


def test_int8_and_nf4_on_flux_split_the_model_in_one_round():
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(tiny("flux"), "quantize int8\nquantize nf4")
    assert info.value.problems[0].hint == (
        "split the model between them: add 'except transformer_blocks.*' to line 1 and 'in transformer_blocks.*' "
        "to line 2 (checked: the script then plans)")


def test_the_documented_conflict_fix_is_the_one_suggested():
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(tiny("flux"), "quantize int8 except norm\nfp8 native Linear in transformer_blocks.*")
    assert info.value.problems[0].hint.startswith("add 'except transformer_blocks.*' to line 1")


@pytest.mark.parametrize("model, text, first", [
    ("llama", "compile regional in *TransformerBlock", "*DecoderLayer"),
    ("gpt2", "compile regional in *TransformerBlock", "GPT2Block"),
    ("flux", "quantize int8 in nothing_here", "transformer_blocks.*"),
    ("llama", "quantize int8 in nothing_here", "layers"),
    ("flux", "quantize int8 except nrm", "norm"),
])
def test_selector_suggestions_cover_class_globs_and_scopes_and_all_work(model, text, first):
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(tiny(model), text)
    (problem,) = info.value.problems
    names = problem.hint.removeprefix("nearest names: ").split(", ")
    assert names[0] == first
    wrong = problem.message.split("'")[1]
    for name in names:
        assert transformdsl.plan(tiny(model), text.replace(wrong, name)).steps[0].targets, name


def test_no_except_is_offered_when_none_works():
    # On a CPU no layer can multiply in fp8 and strict=true refuses the fallback: every `except`
    # that removes the unsuitable layers leaves nothing, so the hint says to change the options.
    text = "fp8 native strict=true"
    with pytest.raises(ScriptError) as info:
        transformdsl.plan(tiny("flux"), text)
    assert info.value.problems[0].hint == "change the options (no 'except' leaves this statement something to do)"


# --------------------------------------------------------------------------- statements that change nothing

NOOP = "fuse qkv in *Attention\nquantize int8 except norm, transformer_blocks"


def test_a_statement_that_changes_nothing_warns_and_strict_refuses():
    from transformdsl.executor import NothingToDoWarning
    from transformdsl.models import BUILTIN

    model = BUILTIN["flux"]()
    with pytest.warns(NothingToDoWarning, match=r"line 2: 'quantize int8 except norm, transformer_blocks' "
                                                r"changes nothing on this model"):
        transformdsl.transform(model, NOOP)
    untouched = BUILTIN["flux"]()
    before = {k: v.clone() for k, v in untouched.state_dict().items()}
    with pytest.raises(transformdsl.TransformError, match="strict: nothing was changed"):
        transformdsl.transform(untouched, NOOP, strict=True)
    assert all(v.equal(before[k]) for k, v in untouched.state_dict().items())
    assert not hasattr(untouched.transformer_blocks[0].attn, "to_qkv")


def test_apply_warns_on_stderr_and_strict_fails(capsys, tmp_path):
    path = tmp_path / "noop.tfm"
    path.write_text(NOOP + "\n")
    status, _, err = cli(capsys, "apply", "-q", path, "--model", "flux")
    assert status == 0
    assert err.splitlines()[0] == (
        "warning: line 2: 'quantize int8 except norm, transformer_blocks' changes nothing on this model: its "
        "exclusions remove every module it selects (default: embed, default: embedder, except norm, except "
        "transformer_blocks, default: re:^proj_out$) (--strict makes this an error)")
    status, _, err = cli(capsys, "apply", "-q", "--strict", path, "--model", "flux")
    assert status == 1 and err.startswith("error: line 2: ")


# --------------------------------------------------------------------------- spec.md's scripts do something


def _spec_statements() -> list[tuple[int, str]]:
    import re

    text = (ROOT / "spec.md").read_text()
    out = []
    for match in re.finditer(r"^```tfm\n(.*?)^```$", text, flags=re.M | re.S):
        first = text.count("\n", 0, match.start()) + 2
        block = match.group(1)
        if not out:  # the overview: one script
            out.append((first, block))
        # Every line on its own too (most blocks list alternatives, one per line).
        out.extend((first + i, line) for i, line in enumerate(block.splitlines()) if line.split("#")[0].strip())
    return out


#: Statements of spec.md written for an architecture no built-in model has (with the reason).
_ELSEWHERE = {
    "fuse bias_dropout_residual_layernorm in encoder.layer.*": "a BERT-style encoder",
    "fp8 native scaling=row strict=true": "a GPU with fp8 matmul (strict=true refuses the CPU fallback)",
    'lora "loras/style.safetensors" scale=0.8': "a LoRA file (tests/test_lora.py writes them)",
    'lora "loras/detail.safetensors" merge=false': "a LoRA file (tests/test_lora.py writes them)",
    'lora "loras/style.safetensors" component=text_encoder': "a LoRA file (tests/test_lora.py writes them)",
    "lora style.safetensors": "a LoRA file (tests/test_lora.py writes them)",
    "attention flash in transformer_blocks.*": "a CUDA machine with flash-attn",
    "fp8 dynamic": "a GPU with fp8 matmul (fp8 dynamic has no CPU fallback; tests/test_fp8_dynamic.py runs it "
                   "with the CPU reference switched on)",
    "fp8 dynamic scaling=row": "a GPU with fp8 matmul (as above)",
}


@pytest.mark.parametrize("line, text", _spec_statements(), ids=lambda v: f"spec.md:{v}" if isinstance(v, int) else "")
def test_every_spec_script_changes_something_on_a_builtin_model(line, text):
    """Each script of spec.md (or each line of a block of alternatives) plans on at least one built-in
    model with every statement changing something: none can silently do nothing."""
    if text.split("#")[0].strip() in _ELSEWHERE:
        pytest.skip(_ELSEWHERE[text.split("#")[0].strip()])
    tried = []
    for model in ("flux", "sd3", "unet", "llama", "gpt2", "sd-pipeline"):
        try:
            # calibration=True: data is given (a method that learns from data plans; it is run in
            # tests/test_calibration.py)
            the_plan = transformdsl.plan(tiny(model), text, calibration=True)
        except ScriptError as error:
            tried.append(f"{model}: {error.problems[0].message}")
            continue
        idle = [s.statement.line for s in the_plan.steps if not s.targets]
        if not idle:
            return
        tried.append(f"{model}: line(s) {idle} change nothing")
    pytest.fail(f"spec.md:{line}: {text!r} does something on no built-in model: " + "; ".join(tried))


# --------------------------------------------------------------------------- the transcript and the examples' figures


def test_first_hour_transcript_is_what_the_commands_print():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import first_hour
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert first_hour.transcript() == first_hour.OUTPUT.read_text(), (
        "docs/FIRST-HOUR.md is out of date: run `.venv/bin/python docs/first_hour.py` and review the diff")


def test_quantize_denoiser_figures_are_the_plans():
    import re

    from torch import nn

    header = " ".join(line.lstrip("# ") for line in (EXAMPLES / "quantize_denoiser.tfm").read_text().splitlines())
    claims = dict((name, float(r)) for r, name in re.findall(r"(\d\.\d\d)x (?:for |on )?(?:the tiny )?(\w+)",
                                                               header))
    script = EXAMPLES / "quantize_denoiser.tfm"

    def ratio(model, text) -> float:
        notes = [n for s in transformdsl.plan(model, text).steps for n in s.notes if "weights of the" in n]
        return float(re.search(r"\((\d\.\d\d)x\)", notes[-1]).group(1))

    assert ratio(tiny("unet"), script) == claims["UNet"]
    assert ratio(tiny("flux"), script) == claims["Flux"]
    wide = nn.Sequential(nn.Linear(3072, 3072))  # a float32 layer of FLUX.1's width
    quantize = [line for line in script.read_text().splitlines() if line.startswith("quantize")][0]
    assert ratio(wide, quantize) == claims["float32"]


def test_demo_leaves_no_temporary_folder_and_states_compile_cold_start_apart(tmp_path, monkeypatch, capsys):
    import tempfile

    from transformdsl.demo import run_demo

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    script = tmp_path / "compiled.tfm"
    script.write_text("quantize int8\ncompile backend=eager\n")
    assert run_demo(model_name="gpt2", script_path=str(script)) == 0
    out = capsys.readouterr().out
    assert list(scratch.iterdir()) == []
    latency = next(line for line in out.splitlines() if line.strip().startswith("latency:"))
    assert "steady state: median of 9 calls after 2 warm-up calls" in latency
    assert any(line.strip().startswith("first call:") and "compiling (not counted in the latency above)" in line
               for line in out.splitlines())


@pytest.mark.parametrize("text, reason", [
    ("quantize int8", "LLM.int8 layers"),
    ("quantize int8 weight_only=true", "turn their weights back into floats on every call"),
    ("quantize nf4", "turn their weights back into floats on every call"),
    ("fp8 storage", "turn their weights back into floats on every call"),
    ("compile", "compile speeds up the arithmetic"),
])
def test_demo_says_why_the_script_it_ran_is_slower_on_a_cpu(text, reason):
    """LLM.int8's reason follows how bitsandbytes multiplies on this CPU, as detected: in int8
    (torch._int_mm) with AVX-512, slow without VNNI/AMX; in float32 after converting, below AVX-512;
    with VNNI/AMX the int8 matmul is fast and the cost is quantizing the activations."""
    from torch import nn

    from transformdsl.capabilities import cpu_int8_matmul
    from transformdsl.demo import _slower_because

    because = _slower_because(transformdsl.plan(nn.Sequential(nn.Linear(16, 16)), text), "CPU")
    assert reason in because
    how = cpu_int8_matmul() if text == "quantize int8" else None
    assert ("torch._int_mm" in because) == (how == "int_mm without int8 dot product")
    assert ("quantize their activations on every call" in because) == (how == "int8 dot product")
    assert ("convert activations and weights to float32" in because) == (
        text == "quantize int8" and cpu_int8_matmul() == "float32")


def test_cli_errors_speak_cli(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodel.py").write_text("import torch\n\ndef build():\n"
                                         "    return torch.nn.Sequential(torch.nn.Linear(64, 64))\n")
    (tmp_path / "s.tfm").write_text("quantize int8\n")
    monkeypatch.chdir(tmp_path)
    status, _, err = cli(capsys, "apply", "--verify", "s.tfm", "--model", "mymodel:build")
    assert status == 1
    assert "verify_inputs" not in err and "drop --verify" in err, err
