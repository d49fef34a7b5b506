"""The ``transformdsl`` command (spec.md "Errors": ``FILE:LINE:COL: message`` on stderr, exit 1).

Commands run in-process through ``transformdsl.cli.main`` with pytest's ``capsys``; one test runs
``python -m transformdsl`` in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from golden import EXAMPLES, assert_golden, explain_cases, explain_golden

import transformdsl
from transformdsl.cli import main
from transformdsl.models import BUILTIN

ROOT = Path(__file__).resolve().parent.parent


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the command line in-process: (exit status, stdout, stderr)."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse: --help, usage errors
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def script(tmp_path):
    def write(text: str, name: str = "s.tfm") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


# --------------------------------------------------------------------------- check


def test_check_ok(capsys, script):
    path = script("fuse qkv in *Attention\nquantize int8 except norm\ncompile fullgraph=false\n")
    assert cli(capsys, "check", path) == (0, f"{path}: ok (3 statement(s))\n", "")


def test_check_quiet(capsys, script):
    assert cli(capsys, "check", "-q", script("fuse qkv")) == (0, "", "")


def test_check_errors_go_to_stderr_as_file_line_col(capsys, script):
    path = script("quantise int8\ncompile fullgraph=maybe\n")
    status, out, err = cli(capsys, "check", path)
    assert (status, out) == (1, "")
    assert err.splitlines() == [
        f"{path}:1:1: unknown verb 'quantise' (did you mean 'quantize'?)",
        "   1 | quantise int8",
        "       ^^^^^^^^",
        "  hint: verbs: attention, cache, calibrate, compile, fp8, fuse, lora, quantize",
        f"{path}:2:19: option 'fullgraph': expected true or false, got 'maybe'",
        "   2 | compile fullgraph=maybe",
        "                         ^^^^^",
    ]


def test_check_syntax_error(capsys, script):
    path = script("fuse qkv in\n")
    status, _, err = cli(capsys, "check", path)
    assert status == 1
    assert err.splitlines()[0] == f"{path}:1:12: expected a selector after 'in', found end of statement"


def test_check_several_files_reports_each(capsys, script):
    good, bad = script("fuse qkv", "good.tfm"), script("fuse qkv\nquantize int9", "bad.tfm")
    status, out, err = cli(capsys, "check", good, bad, good)
    assert status == 1
    assert out == f"{good}: ok (1 statement(s))\n" * 2
    assert err.startswith(f"{bad}:2:10: unknown mode 'int9' for 'quantize' (did you mean 'int8'?)\n")


def test_check_missing_file(capsys, tmp_path):
    status, out, err = cli(capsys, "check", tmp_path / "nope.tfm")
    assert (status, out) == (1, "")
    assert err.startswith(f"{tmp_path / 'nope.tfm'}:1:1: cannot read script: ")


# --------------------------------------------------------------------------- explain


@pytest.mark.parametrize("model, example", [
    ("flux", "flux_int8"), ("gpt2", "gpt2_int8"), ("sd-pipeline", "sd_pipeline")])
def test_explain_prints_the_golden_plan(capsys, model, example):
    assert (model, example) in explain_cases()
    status, out, _ = cli(capsys, "explain", EXAMPLES / f"{example}.tfm", "--model", model)
    assert status == 0  # stderr may hold the libraries' import warnings
    assert_golden(explain_golden(model, example), out)


def test_explain_json(capsys):
    path = EXAMPLES / "llama_hqq.tfm"
    status, out, _ = cli(capsys, "explain", path, "--model", "llama", "--json")
    assert status == 0
    assert json.loads(out) == transformdsl.plan(BUILTIN["llama"](), path).to_json()


def test_explain_planning_error(capsys, script):
    path = script("fuse qkv\nquantize int8 except nrm\n")
    status, out, err = cli(capsys, "explain", path, "--model", "flux")
    assert (status, out) == (1, "")
    assert err.splitlines()[0] == f"{path}:2:22: selector 'nrm' matches no module"
    assert err.splitlines()[-1].startswith("  hint: nearest names: ")


@pytest.mark.parametrize("spec, message", [
    ("fluxx", "error: --model fluxx: unknown built-in model 'fluxx' (did you mean 'flux'?); "
              "built-ins: unet, sd3, flux, llama, gpt2, sd-pipeline"),
    ("./no/such/dir", "error: --model ./no/such/dir: no such directory: no/such/dir"),
    ("os:getcwd", "error: --model os:getcwd: the factory returned a str; expected a torch.nn.Module or a diffusers "
                  "pipeline"),
])
def test_bad_model_spec(capsys, spec, message):
    status, out, err = cli(capsys, "explain", EXAMPLES / "demo.tfm", "--model", spec)
    assert (status, out) == (1, "")
    assert err.splitlines()[0].startswith(message)


# --------------------------------------------------------------------------- inspect


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli") / "gpt2"
    transformdsl.save(BUILTIN["gpt2"](), directory)
    return directory


def test_inspect(capsys, saved_gpt2):
    status, out, err = cli(capsys, "inspect", saved_gpt2)
    assert (status, err) == (0, "")
    assert out.splitlines() == [
        "model: GPT2LMHeadModel (transformers), format version 1",
        "applied: nothing",
        "tensors: 471.0 KiB in 1 file(s)",
        "  F32          28 tensors    471.0 KiB",
    ]


def test_inspect_json(capsys, saved_gpt2):
    status, out, _ = cli(capsys, "inspect", saved_gpt2, "--json")
    assert status == 0
    info = json.loads(out)
    assert (info["kind"], info["model"], info["library"], info["steps"]) == (
        "module", "GPT2LMHeadModel", "transformers", [])
    assert info["tensors"] == {"F32": {"tensors": 28, "elements": 120576, "bytes": 482304}}


def test_inspect_not_a_save(capsys, tmp_path):
    status, out, err = cli(capsys, "inspect", tmp_path)
    assert (status, out) == (1, "")
    assert err == f"error: {tmp_path}: not a transformdsl save (transformdsl.json is missing)\n"


# --------------------------------------------------------------------------- usage


def test_help(capsys):
    status, out, _ = cli(capsys, "--help")
    assert status == 0
    assert out.startswith("usage: transformdsl [-h] [--version] COMMAND ...")
    for command in ("check", "explain", "apply", "inspect", "demo"):
        assert command in out


def test_explain_options_lists_each_statements_options_with_defaults_without_a_model(capsys, tmp_path):
    path = tmp_path / "s.tfm"
    path.write_text("compile mode=max-autotune\nfuse qkv\n")
    status, out, _ = cli(capsys, "explain", path, "--options")
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "line 1: compile: torch.compile the denoiser (or the model)"
    assert "  mode=max-autotune: torch.compile mode (str; default: default; one of default, reduce-overhead, " \
           "max-autotune, max-autotune-no-cudagraphs)" in lines
    assert "  fullgraph=false: fail on graph breaks instead of falling back to Python (bool; default: false)" in lines
    assert any(line.startswith("line 2: fuse qkv") for line in lines)
    assert "  cross=kv: cross-attention: fuse k/v only ('kv') or leave it alone ('skip') (str; default: kv; " \
           "one of kv, skip)" in lines
    assert sum("component=\"\" (common option)" in line for line in lines) == 2


def test_usage_error_exits_2(capsys):
    status, _, err = cli(capsys, "explain", EXAMPLES / "demo.tfm")
    assert status == 2
    assert "the following arguments are required: --model" in err


def test_python_m_transformdsl_check(tmp_path):
    good, bad = tmp_path / "good.tfm", tmp_path / "bad.tfm"
    good.write_text("fuse qkv in *Attention\n")
    bad.write_text("fuse qkv\ncompile regional\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "transformdsl", "check", str(good), str(bad)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 1
    assert result.stdout == f"{good}: ok (1 statement(s))\n"
    assert result.stderr.splitlines()[0] == (
        f"{bad}:2:1: 'compile regional' needs an 'in' clause naming the blocks to work on")
