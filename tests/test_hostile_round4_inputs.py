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
