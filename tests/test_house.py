"""The house rules that keep the package easy to change (CONTRIBUTING.md, "Layout")."""

from __future__ import annotations

from pathlib import Path

from tools import imports

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_circle_and_no_private_name_imported_across_modules(capsys):
    status = imports.main([str(ROOT / "transformdsl"), str(ROOT / "benchmarks")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "no import circle" in out and "no upward import between its" in out


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


def test_the_checker_counts_a_package_init_and_annotation_only_imports(tmp_path, capsys):
    """Importing ``pkg.sub.leaf`` runs ``pkg/sub/__init__.py`` first, and an import under ``TYPE_CHECKING``
    is a dependency too: both close circles; an import inside the ``__init__``'s functions runs later, if
    ever, and does not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import top\n")
    (package / "sub" / "leaf.py").write_text("X = 1\n")
    (package / "sub" / "top.py").write_text("from .. import user\n")
    (package / "user.py").write_text("from .sub.leaf import X\n")
    (package / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import hinted\n")
    (package / "hinted.py").write_text("from . import typed\n")
    assert imports.main([str(package)]) == 1
    out = capsys.readouterr().out
    assert "circle of 2 in pkg: pkg.sub.top, pkg.user" in out
    assert "circle of 2 in pkg: pkg.hinted, pkg.typed" in out
    (package / "sub" / "__init__.py").write_text("def __getattr__(name):\n    from . import top\n    return top\n")
    (package / "hinted.py").write_text("")
    assert imports.main([str(package)]) == 0, capsys.readouterr().out


def test_the_checker_finds_an_import_up_the_floors(tmp_path, capsys, monkeypatch):
    """A module may import its own floor and those below it (tools/imports.py ``LAYERS``, CONTRIBUTING.md's
    table); a deferred import up counts, and so does one that only a package ``__init__`` runs on the way."""
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("from .. import top\n")  # runs whenever pkg.low.x is imported
    (package / "low" / "base.py").write_text("X = 1\n")
    (package / "mid.py").write_text("def f():\n    from .low.base import X\n    return X\n")
    (package / "top.py").write_text("")
    monkeypatch.setitem(imports.LAYERS, "pkg", [("low", ("low",)), ("middle", ("mid",)), ("top", ("", "top"))])
    assert imports.main([str(package)]) == 1
    out = capsys.readouterr().out
    assert "pkg.low (low) imports pkg.top (top): upward" in out
    assert "pkg.mid (middle) imports pkg.top (top): upward" in out  # through pkg/low/__init__.py
    (package / "low" / "__init__.py").write_text("")
    assert imports.main([str(package)]) == 0, capsys.readouterr().out
    (package / "stray.py").write_text("")
    assert imports.main([str(package)]) == 1
    assert "pkg.stray: on no floor" in capsys.readouterr().out


def test_every_floor_of_the_house_is_in_contributing():
    """CONTRIBUTING.md's table names each floor tools/imports.py enforces, in the same order."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    positions = [text.find(f"| {name} |") for name, _ in imports.LAYERS["transformdsl"]]
    assert -1 not in positions, [name for (name, _), at in zip(imports.LAYERS["transformdsl"], positions) if at < 0]
    assert positions == sorted(positions)


def test_package_data_copies_match_their_sources():
    """An installed package reads its own copies: they must be the files the repository documents."""
    pairs = [("grammar/transformdsl.lark", "transformdsl/transformdsl.lark"), ("examples/demo.tfm", "transformdsl/demo.tfm")]
    for source, copy in pairs:
        assert (ROOT / source).read_bytes() == (ROOT / copy).read_bytes(), f"{copy} differs from {source}"
    declared = (ROOT / "pyproject.toml").read_text()
    for name in ("transformdsl.lark", "demo.tfm", "measured.json"):
        assert f'"{name}"' in declared, f"{name} is not package data"


# --------------------------------------------------------------------------- record versions, checked on load


def _tampered(tmp_path, script: str, change) -> Path:
    import json

    import transformdsl
    from transformdsl import models

    model = transformdsl.transform(models.tiny_llama(), script)
    directory = tmp_path / "saved"
    transformdsl.save(model, directory)
    meta_path = directory / "transformdsl.json"
    meta = json.loads(meta_path.read_text())
    change(meta["steps"][0])
    meta_path.write_text(json.dumps(meta))
    return directory


def test_a_record_newer_than_this_transformdsl_reads_is_refused_naming_the_versions(tmp_path):
    import pytest

    import transformdsl

    directory = _tampered(tmp_path, "fp8 storage", lambda step: step.update(record_version=7))
    with pytest.raises(transformdsl.LoadError, match=r"step 'fp8 storage' was saved with record version 7, and "
                                                     r"this transformdsl reads 'fp8 storage' records up to version 1"):
        transformdsl.load(directory)


def test_a_save_without_record_versions_loads_as_version_1(tmp_path):
    import torch

    import transformdsl
    from transformdsl import models

    directory = _tampered(tmp_path, "quantize int8 weight_only=true", lambda step: step.pop("record_version"))
    reference = models.run(transformdsl.transform(models.tiny_llama(), "quantize int8 weight_only=true"))
    assert torch.equal(models.run(transformdsl.load(directory)), reference)


def test_an_unknown_fp8_layer_kind_is_a_load_error_not_a_guess(tmp_path):
    import pytest

    import transformdsl

    def change(step):
        path = next(iter(step["record"]["layers"]))
        step["record"]["layers"][path]["kind"] = "lstm"

    with pytest.raises(transformdsl.LoadError, match="unknown layer kind 'lstm' in the record"):
        transformdsl.load(_tampered(tmp_path, "fp8 storage", change))


def test_a_library_checkpoint_is_read_by_the_transform_that_declares_its_quant_method(tmp_path):
    """``load(dir)`` of a quantized library checkpoint asks the registry which transform declares the
    config's ``quant_method`` (``quant_methods``); an undeclared one is refused naming those that are."""
    import json

    import pytest

    import transformdsl
    from transformdsl import models, registry

    claimed = {key: registry.declaration(key).quant_methods for key in registry.keys()}
    assert {key for key, methods in claimed.items() if "bitsandbytes" in methods} == {
        "quantize int8", "quantize nf4", "quantize fp4"}
    directory = tmp_path / "llama"
    models.tiny_llama().save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(transformdsl.LoadError, match=r"quantization method 'gptq' is not one transformdsl "
                                                     r"rebuilds \(it rebuilds bitsandbytes\)"):
        transformdsl.load(directory)
