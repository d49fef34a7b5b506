"""Golden files: expected output kept in ``tests/golden/``, compared exactly.

``assert_golden("explain/flux__flux_int8.txt", text)`` fails with a unified diff when ``text``
differs from the file.  With ``UPDATE_GOLDEN=1`` in the environment it (re)writes the file
instead; review the change with ``git diff tests/golden`` before committing it.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"


def updating() -> bool:
    return os.environ.get("UPDATE_GOLDEN") == "1"


#: A plan's ``device:`` line depends on the machine (CPU flags, GPU) and quotes benchmark figures:
#: golden files keep it masked, and comparisons leave it out (tests/test_capabilities.py checks it
#: against this machine's detected capabilities).
_DEVICE_LINE = re.compile(r"^(\s*)device: .*$", re.M)
DEVICE_MASK = r"\1device: <this machine's note: see transformdsl/capabilities.py>"


def _without_device_lines(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not _DEVICE_LINE.match(line))


def assert_golden(name: str, actual: str) -> None:
    path = GOLDEN / name
    text = _DEVICE_LINE.sub(DEVICE_MASK, actual.rstrip("\n") + "\n")
    if updating():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        return
    if not path.is_file():
        pytest.fail(f"golden file {path} is missing; run with UPDATE_GOLDEN=1 to write it")
    expected = path.read_text()
    if _without_device_lines(expected) != _without_device_lines(text):
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), text.splitlines(keepends=True),
                                            f"golden/{name}", "actual"))
        pytest.fail(f"output differs from golden/{name} (UPDATE_GOLDEN=1 rewrites it):\n{diff}", pytrace=False)


# --------------------------------------------------------------------------- examples

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_MODEL_LINE = "--model "


def example_models(path: Path) -> list[str]:
    """The built-in models an example names in its comment header (``... --model flux``)."""
    models = []
    for line in path.read_text().splitlines():
        if not line.lstrip().startswith("#"):
            break
        if _MODEL_LINE in line:
            models.append(line.split(_MODEL_LINE, 1)[1].split()[0])
    return models


def explain_cases() -> list[tuple[str, str]]:
    """``(model, example stem)`` for every model every example names: one golden file each."""
    return [(model, path.stem) for path in sorted(EXAMPLES.glob("*.tfm")) for model in example_models(path)]


def explain_golden(model: str, stem: str) -> str:
    return f"explain/{model}__{stem}.txt"
