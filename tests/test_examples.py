"""The example scripts and the scripts of spec.md are valid.

Every ``examples/*.tfm`` passes ``transformdsl check`` and plans against each built-in model its
header names (``# Try: transformdsl explain examples/X.tfm --model NAME``), every statement
selecting something.  Every ```` ```tfm ```` block of spec.md validates, and no untagged block is
a script (tag script blocks ```` ```tfm ```` so that this test sees them).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from golden import EXAMPLES, example_models

import transformdsl
from transformdsl.cli import main
from transformdsl.errors import ScriptError
from transformdsl.models import BUILTIN
from transformdsl.validate import check_text

SPEC = Path(__file__).resolve().parent.parent / "spec.md"
FILES = sorted(EXAMPLES.glob("*.tfm"))
PLANS = [(path, model) for path in FILES for model in example_models(path)]


@functools.cache
def tiny(name: str):
    return BUILTIN[name]()


def spec_blocks(info: str | None) -> list[tuple[int, str]]:
    """(line, text) of spec.md's fenced blocks whose info string is ``info`` (any when None)."""
    text = SPEC.read_text()
    blocks = []
    for match in re.finditer(r"^```([^\n]*)\n(.*?)^```$", text, flags=re.M | re.S):
        if info is None or match.group(1).strip() == info:
            blocks.append((text.count("\n", 0, match.start()) + 2, match.group(2)))
    return blocks


def test_there_are_examples():
    names = {p.stem for p in FILES}
    assert {"flux_int8", "sd_unet_nf4", "llama_hqq", "fp8_dit", "compile_regional"} <= names
    # one per family added in round 3 (issue 36), each named in the README's command-line section
    families = {"cache", "attention", "lora", "w8a8", "int4"}
    assert families <= names
    readme = (SPEC.parent / "README.md").read_text()
    section = readme[readme.index("## Command line"):]
    section = section[:section.index("\n## ", 1)]
    assert all(f"examples/{name}.tfm" in section for name in families), section


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_example_passes_check(path, capsys):
    assert main(["check", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: ok (")


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_example_has_a_comment_header(path):
    lines = path.read_text().splitlines()
    assert lines and lines[0].startswith("# "), f"{path.name}: start with a comment saying what the script is for"
    assert example_models(path), f"{path.name}: name a built-in in the header: '# Try: transformdsl explain " \
                                 f"examples/{path.name} --model NAME'"


@pytest.mark.parametrize("path, model", PLANS, ids=[f"{p.stem}-{m}" for p, m in PLANS])
def test_example_plans_against_its_models(path, model):
    plan = transformdsl.plan(tiny(model), path)
    assert len(plan.steps) == len(transformdsl.parse(path.read_text()))
    for step in plan.steps:
        assert step.targets, f"line {step.statement.line} of {path.name} selects nothing on {model}"


# --------------------------------------------------------------------------- spec.md


SPEC_SCRIPTS = spec_blocks("tfm")


def test_spec_has_script_blocks():
    assert len(SPEC_SCRIPTS) >= 2


def statement_lines(text: str) -> list[tuple[int, str]]:
    """(offset, line) of the lines of a block that hold a statement (not blank, not only a comment)."""
    return [(i, line) for i, line in enumerate(text.splitlines()) if line.split("#", 1)[0].strip()]


def validates_line_by_line(line: int, text: str) -> bool:
    lines = statement_lines(text)
    for offset, source in lines:
        check_text(source, filename=f"spec.md:{line + offset}")
    return bool(lines)


@pytest.mark.parametrize("line, text", SPEC_SCRIPTS, ids=[f"spec.md:{line}" for line, _ in SPEC_SCRIPTS])
def test_spec_script_validates(line, text):
    """A tfm block is a script, or a list of alternative statements, one per line (two `compile` lines
    are alternatives, not one script): it validates as a whole, or else every line does on its own."""
    try:
        assert check_text(text, filename=f"spec.md:{line}").steps
    except ScriptError:
        assert validates_line_by_line(line, text)


@pytest.mark.parametrize("line, text", spec_blocks(""), ids=[f"spec.md:{line}" for line, _ in spec_blocks("")])
def test_untagged_spec_blocks_are_not_scripts(line, text):
    try:
        script = validates_line_by_line(line, text)
    except ScriptError:
        script = False
    assert not script, f"spec.md line {line}: this block is a script; open it with ```tfm"


@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_spec_overview_script_plans_on_a_diffusion_transformer(model):
    _, text = SPEC_SCRIPTS[0]
    assert [s.transform.key() for s in transformdsl.plan(tiny(model), text).steps] == [
        "fuse qkv", "quantize int8", "fp8 native", "compile"]


@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_one_weight_format_per_module_names_both_lines_and_the_fix(model):
    text = "quantize int8 except norm\nfp8 native Linear in transformer_blocks.*"
    with pytest.raises(ScriptError) as error:
        transformdsl.plan(tiny(model), text)
    (problem,) = error.value.problems
    assert [s.line for s in problem.spans] == [1, 2]
    assert "except" in problem.hint
