"""The modes ``tune`` tries on each layer, read from the registry's declarations.

A *mode* is one statement without selectors (``quantize int4 group_size=64``).  The candidates are
every registered transform of the ``weights`` exclusive group (each quantize and fp8 mode, and any
plugin that declares itself in that group), once per combination of the values of its *searched*
options (:data:`SEARCHED`: a field with declared ``choices``, or a bool), the other options at
their defaults.  A combination its ``Options.__post_init__`` refuses is pruned with the reason
(``int4 weight_only=false``), and so is one that declares no error bound (``hqq bits=2``: its
output is noise).  So a new mode, or a new value of ``method``, joins the search without a line
here.

>>> texts = [c.text for c in declared_modes(keys=["quantize int4"])]
>>> len(texts), texts[:2], texts[-1]
(12, ['quantize int4 group_size=32', 'quantize int4 group_size=64'], 'quantize int4 method=awq group_size=256')
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from ..formatter import format_value

#: Option fields whose values are searched; the others keep their defaults.  ``method`` is the
#: calibration method of a quantize mode (``gptq``, ``awq``, ``rtn``): a mode with one is passed
#: the calibration data.
SEARCHED = ("method", "bits", "group_size", "weight_only", "dtype")
#: The exclusive group of the transforms that change how weights are stored.
GROUP = "weights"


@dataclass(frozen=True)
class Mode:
    """One candidate mode: a statement without selectors, as text, and what it is made of."""

    key: str
    options: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        opts = " ".join(f"{name}={format_value(value)}" for name, value in self.options.items())
        return f"{self.key} {opts}".strip()

    @property
    def calibrated(self) -> bool:
        """Whether the mode takes calibration data (it has a ``method`` option other than ``rtn``)."""
        method = self.options.get("method")
        return method is not None and method != "rtn"


def _values(f: dataclasses.Field) -> tuple | None:
    choices = f.metadata.get("choices")
    if choices:
        return tuple(choices)
    if f.type in (bool, "bool"):
        return (False, True)
    return None


def declared_modes(keys: list[str] | None = None, pruned: list[tuple[str, str]] | None = None) -> list[Mode]:
    """The candidate modes of the registered ``weights`` transforms (or of ``keys``), in registry
    order; each refused combination is appended to ``pruned`` as (text, reason)."""
    from .. import registry

    pruned = [] if pruned is None else pruned
    chosen = keys if keys is not None else [k for k in registry.keys()
                                            if getattr(registry.declaration(k), "exclusive", None) == GROUP]
    modes = []
    for key in chosen:
        declared = registry.declaration(key)
        if declared is None:
            pruned.append((key, "no such transform"))
            continue
        fields = [f for f in dataclasses.fields(declared.Options) if f.name in SEARCHED and _values(f)]
        for combination in itertools.product(*(_values(f) for f in fields)):
            options = dict(zip((f.name for f in fields), combination))
            shown = {n: v for n, v in options.items()
                     if v != next(f.default for f in fields if f.name == n) or n in ("bits", "group_size")}
            mode = Mode(key, shown)
            try:
                built = declared.Options(**options)
            except (ValueError, TypeError) as exc:
                pruned.append((Mode(key, options).text, str(exc)))
                continue
            try:
                bound = declared(None, built).error_bound
            except Exception as exc:  # a declaration whose bound needs more than its options
                pruned.append((mode.text, f"its error bound cannot be read: {exc}"))
                continue
            if bound is None:
                pruned.append((mode.text, "it declares no error bound (its output is not meant to be used)"))
                continue
            modes.append(mode)
    return modes


def parse_modes(texts: list[str]) -> list[Mode]:
    """Modes given as statement texts (``["quantize int8 weight_only=true"]``), checked by the parser and the
    validator (a :class:`~transformdsl.errors.ScriptError` names a wrong one)."""
    from ..errors import TransformError
    from ..parser import parse
    from ..registry import declarations
    from ..validate import validate

    modes = []
    for text in texts:
        validated = validate(parse(text), declarations())
        for step in validated.steps:
            statement = step.statement
            if statement.target or statement.scope or statement.exclude:
                raise TransformError(f"tune: mode {text!r} names modules; a mode is a statement without selectors "
                                     f"(tune chooses the layers): {step.key()} with its options only")
            modes.append(Mode(step.key(), {o.name: o.value for o in statement.options}))
    return modes


def calibrated_script(text: str) -> bool:
    """Whether a script has a statement with a ``method`` option other than ``rtn`` (it takes calibration data)."""
    from ..parser import parse

    return any(o.name == "method" and o.value != "rtn" for statement in parse(text) for o in statement.options)
