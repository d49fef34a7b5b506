"""The transforms' declarations without their code: what ``transformdsl check`` validates against.

Validating a script needs each transform's verb, mode, options (names, types, defaults, choices,
ranges, rules across fields), ordering rules and incompatibilities, but none of its code, which
imports torch (seconds).  ``catalog.json``, beside this module, holds those declarations as data,
generated from the registry::

    python -m transformdsl.catalog --write      # after adding or changing a transform

and :func:`transforms` rebuilds from it, torch-free, classes that :func:`transformdsl.validate.validate`
binds exactly as it binds the real ones.  What a caller may rely on: validating with the catalog
gives the same result and the same messages as validating with the registry (the test suite checks
that the file matches the registry and that both validate the shipped scripts identically).

Two parts of a declaration are code, and are recorded as follows:

* ``incompatible(other)``: its answer for every ordered pair of transforms with default options (a
  rule that depends on option values cannot be recorded, so ``check`` would miss it; keep rules to
  the pair of transforms, as every rule does today);
* an ``Options`` class with a ``__post_init__`` (rules across fields) is referenced by name and used
  as is; it must live in the torch-free ``passes/option_rules.py``, which :func:`generate` checks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

from .ir import Span, Statement
from .options import describe_fields, option
from .passes import option_rules
from .passes.base import Transform

PATH = Path(__file__).with_name("catalog.json")
_ATTRIBUTES = ("summary", "requires_scope", "runs_after", "runs_before", "exclusive", "overrides",
               "default_target", "default_except", "changes_weights")


def _statement(key: str) -> Statement:
    verb, _, mode = key.partition(" ")
    return Statement(verb, mode or None, (), (), (), (), Span(None, 1, 1, 1, 1 + len(key)))


def describe(cls: type[Transform], others: dict[str, type[Transform]]) -> dict[str, Any]:
    """The declaration of one registered transform, as JSON-ready data."""
    entry: dict[str, Any] = {"verb": cls.verb, "mode": cls.mode}
    for name in _ATTRIBUTES:
        value = getattr(cls, name)
        entry[name] = list(value) if isinstance(value, tuple) else value
    options_cls = cls.Options
    if "__post_init__" in vars(options_cls):
        if options_cls.__module__ != option_rules.__name__ or getattr(option_rules, options_cls.__name__,
                                                                       None) is not options_cls:
            raise RuntimeError(f"{cls.key()}: {options_cls.__name__} checks its fields in __post_init__ but lives "
                               f"in {options_cls.__module__}, which imports torch; move it to the torch-free "
                               "transformdsl/passes/option_rules.py so that `check` can run its rules")
        entry["options_class"] = options_cls.__name__
    entry["options"] = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in row.items()}
                        for row in describe_fields(options_cls)]
    me = cls(_statement(cls.key()), options_cls())
    entry["incompatible"] = {}
    for key, other_cls in others.items():
        reason = me.incompatible(other_cls(_statement(key), other_cls.Options()))
        if reason:
            entry["incompatible"][key] = reason
    return entry


def generate() -> dict[str, Any]:
    """The catalog of the transforms registered now (imports every pass, so torch)."""
    from . import registry

    registered = registry.transforms()
    return {"transforms": {key: describe(cls, registered) for key, cls in sorted(registered.items())}}


@functools.cache
def transforms() -> dict[str, type[Transform]]:
    """Registry key → a torch-free class declaring that transform, rebuilt from ``catalog.json``."""
    data = json.loads(PATH.read_text(encoding="utf-8"))
    return {key: _declared(key, entry) for key, entry in data["transforms"].items()}


def _declared(key: str, entry: dict[str, Any]) -> type[Transform]:
    attributes: dict[str, Any] = {}
    for name in _ATTRIBUTES:
        value = entry[name]
        attributes[name] = tuple(value) if isinstance(value, list) else value
    incompatible_with = dict(entry["incompatible"])

    def incompatible(self, other: Transform) -> str | None:
        return incompatible_with.get(other.key())

    return type(f"Declared[{key}]", (Transform,), {
        "verb": entry["verb"], "mode": entry["mode"], "Options": _options_class(key, entry),
        "incompatible": incompatible, "__module__": __name__, **attributes})


def _options_class(key: str, entry: dict[str, Any]) -> type:
    if "options_class" in entry:  # a class of passes/option_rules.py (torch-free), used as it is
        return getattr(option_rules, entry["options_class"])
    fields = []
    for row in entry["options"]:
        kind = row["type"]
        choices = tuple(row["choices"]) if row["choices"] is not None else None
        declared = option(row["default"], row["doc"], choices=choices, min=row["min"], max=row["max"],
                          kind=kind)  # the declared kind, or the type's name: coerce() reads either
        fields.append((row["name"], kind, declared))  # coerce() reads the type's name
    return dataclasses.make_dataclass(f"Options[{key}]", fields, frozen=True,
                                      namespace={"__module__": __name__})


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m transformdsl.catalog", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {PATH.name} from the registry")
    args = parser.parse_args(argv)
    text = json.dumps(generate(), indent=1, sort_keys=True) + "\n"
    if args.write:
        PATH.write_text(text, encoding="utf-8")
        print(f"wrote {PATH}")
        return 0
    current = PATH.read_text(encoding="utf-8") if PATH.exists() else ""
    if current != text:
        print(f"{PATH} is out of date: run python -m transformdsl.catalog --write", file=sys.stderr)
        return 1
    print(f"{PATH} is up to date")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
