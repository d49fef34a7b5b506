"""Typed option declarations for transforms.

A transform's options are a frozen dataclass whose fields are declared with
:func:`option`.  :func:`build_options` turns the ``name=value`` pairs of a statement
into an instance, collecting every problem (unknown name with "did you mean", wrong
type, out of range, not one of the choices) with the span of the offending text.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import MISSING, dataclass, field
from typing import Any

from .errors import Problem, did_you_mean
from .ir import Statement

#: Spellings accepted for dtype options, and the canonical name each one means.  Torch-free, so
#: that validating a script (``transformdsl check``) never imports torch.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def __getattr__(name: str):
    # ``DTYPES`` (spelling -> torch dtype) imports torch on first use only.
    if name == "DTYPES":
        import torch

        table = {spelling: getattr(torch, canonical) for spelling, canonical in DTYPE_NAMES.items()}
        globals()["DTYPES"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def option(default: Any, doc: str, *, choices: tuple | None = None, min: float | None = None,
           max: float | None = None, kind: str | None = None):
    """Declare one option field.

    ``kind`` is ``"dtype"`` for dtype names (normalised to their canonical spelling);
    otherwise the type is taken from the field annotation (bool, int, float, str).
    """
    meta = {"doc": doc, "choices": choices, "min": min, "max": max, "kind": kind}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class CommonOptions:
    """Options every statement takes (documented in spec.md "Common options")."""

    component: str = option("", "pipeline component the statement targets (default: the denoiser)")
    default_except: bool = option(True, "apply the transform's default exclusions")


COMMON_FIELDS = {f.name for f in dataclasses.fields(CommonOptions)}


@dataclass(frozen=True)
class NoOptions:
    """A transform without options of its own."""


def describe_fields(options_cls: type) -> list[dict]:
    """Name, type, default, choices/range and doc of each option (``transformdsl explain --options``)."""
    rows = []
    for f in dataclasses.fields(options_cls):
        meta = f.metadata
        rows.append({
            "name": f.name,
            "type": meta.get("kind") or _type_name(f.type),
            "default": f.default if f.default is not MISSING else None,
            "choices": meta.get("choices"),
            "min": meta.get("min"),
            "max": meta.get("max"),
            "doc": meta.get("doc", ""),
        })
    return rows


def _type_name(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def build_options(statement: Statement, options_cls: type) -> tuple[Any, CommonOptions, list[Problem]]:
    """Typed options (the transform's and the common ones) from a statement."""
    problems: list[Problem] = []
    own = {f.name: f for f in dataclasses.fields(options_cls)}
    common = {f.name: f for f in dataclasses.fields(CommonOptions)}
    own_values: dict[str, Any] = {}
    common_values: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    for opt in statement.options:
        if opt.name in seen:
            problems.append(Problem(f"option '{opt.name}' given twice", [opt.span, seen[opt.name]]))
            continue
        seen[opt.name] = opt.span
        target, fields = (own_values, own) if opt.name in own else (common_values, common)
        if opt.name not in fields:
            names = sorted(own) + sorted(common)
            allowed = ", ".join(sorted(own)) or "none of its own"
            problems.append(Problem(
                f"unknown option '{opt.name}' for '{statement.key}'{did_you_mean(opt.name, names)}",
                [opt.span], hint=f"'{statement.key}' takes: {allowed}; every statement takes: "
                + ", ".join(sorted(common))))
            continue
        try:
            target[opt.name] = coerce(fields[opt.name], opt.value)
        except ValueError as exc:
            problems.append(Problem(f"option '{opt.name}': {exc}", [opt.value_span or opt.span]))
    own_instance = common_instance = None
    try:
        own_instance = options_cls(**own_values)
    except (ValueError, TypeError) as exc:
        problems.append(Problem(f"invalid options for '{statement.key}': {exc}", [statement.span]))
    common_instance = CommonOptions(**common_values)
    return own_instance, common_instance, problems


def coerce(f: dataclasses.Field, value: Any) -> Any:
    """Check ``value`` against one option field; return the canonical value or raise ValueError."""
    meta = f.metadata
    kind = meta.get("kind") or _type_name(f.type)
    if kind == "dtype":
        if not isinstance(value, str) or value.lower() not in DTYPE_NAMES:
            raise ValueError(f"expected a dtype ({', '.join(sorted(set(DTYPE_NAMES.values())))}), got {value!r}"
                             + (did_you_mean(str(value), DTYPE_NAMES) if isinstance(value, str) else ""))
        value = DTYPE_NAMES[value.lower()]
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
    elif kind == "int_or_none":
        if value is None or value == "none":  # None: read back from a save's JSON
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer or none, got {value!r}")
    elif kind == "int_or_auto":
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer or auto, got {value!r}")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"expected a number, got {value!r}")  # NaN passes every min/max test
        value = float(value)
    elif kind in ("str", "Optional[str]", "str | None"):
        if not isinstance(value, str):
            value = str(value).lower() if isinstance(value, bool) else str(value)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        shown = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in choices)
        raise ValueError(f"expected one of {shown}, got {value!r}"
                         + (did_you_mean(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""))
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo:
        raise ValueError(f"must be at least {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"must be at most {hi}, got {value!r}")
    return value


def options_to_json(options: Any) -> dict:
    return dataclasses.asdict(options) if options is not None else {}
