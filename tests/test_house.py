"""The house rules that keep the package easy to change (CONTRIBUTING.md, "Layout")."""

from __future__ import annotations

from pathlib import Path

from tools import imports

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_circle_and_no_private_name_imported_across_modules(capsys):
    status = imports.main([str(ROOT / "transformdsl"), str(ROOT / "benchmarks")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "no import circle" in out


def test_the_checker_finds_a_circle_and_a_private_import(tmp_path, capsys):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .b import _g  # deferred: still a circle\n")
    (package / "b.py").write_text("from . import a\n\ndef _g():\n    pass\n")
    assert imports.main([str(package)]) == 1
    out = capsys.readouterr().out
    assert "circle of 2 in pkg: pkg.a, pkg.b" in out
    assert "imports _g from pkg.b" in out


def test_package_data_copies_match_their_sources():
    """An installed package reads its own copies: they must be the files the repository documents."""
    pairs = [("grammar/transformdsl.lark", "transformdsl/transformdsl.lark"), ("examples/demo.tfm", "transformdsl/demo.tfm")]
    for source, copy in pairs:
        assert (ROOT / source).read_bytes() == (ROOT / copy).read_bytes(), f"{copy} differs from {source}"
    declared = (ROOT / "pyproject.toml").read_text()
    for name in ("transformdsl.lark", "demo.tfm", "measured.json"):
        assert f'"{name}"' in declared, f"{name} is not package data"
