"""What was applied to a module: the scripts and their steps, kept on the module and saved with it.

``transform()`` appends to it; ``save()`` writes it (``transformdsl.json``'s ``scripts`` and
``steps``); ``load()`` rebuilds a model from it and sets it again, so a loaded model can be
transformed further and saved with its whole history.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

#: Attribute (in the module's ``__dict__``) holding what was applied to a component.
HISTORY_ATTR = "_transformdsl_history"


@dataclass
class AppliedStep:
    """One executed statement, as saved in the metadata and replayed on load."""

    key: str
    line: int
    statement: str
    options: dict
    common: dict
    record: dict
    script_index: int
    #: The transform's ``record_version`` when it ran (saves made before versions were saved: 1).
    record_version: int = 1

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class History:
    """What was applied to one component: the scripts and the steps, in order."""

    scripts: list[str]
    steps: list[AppliedStep]

    def to_json(self) -> dict:
        return {"scripts": list(self.scripts), "steps": [s.to_json() for s in self.steps]}


def history_of(module: nn.Module) -> History | None:
    return module.__dict__.get(HISTORY_ATTR)


def set_history(module: nn.Module, history: History) -> None:
    module.__dict__[HISTORY_ATTR] = history


def append_history(module: nn.Module, source: str, steps: list[AppliedStep]) -> None:
    history = history_of(module) or History([], [])
    index = len(history.scripts)
    history.scripts.append(source)
    for step in steps:
        step.script_index = index
        history.steps.append(step)
    set_history(module, history)


def applied_step(step, statement: str, record: dict) -> AppliedStep:
    """The history step of a planned statement ``step`` (a :class:`transformdsl.planner.Step`) that ran and
    returned ``record``; ``statement`` is its text as :func:`recorded_text` records it.  The one place a
    step is built from a plan, for ``transform`` and ``convert`` alike."""
    return AppliedStep(
        key=step.transform.key(),
        line=step.statement.line,
        statement=statement,
        options=dataclasses.asdict(step.transform.options),
        common=dataclasses.asdict(step.transform.common),
        record=record,
        script_index=0,
        record_version=step.transform.record_version,
    )


def recorded_text(the_plan) -> tuple[str, dict[int, str]]:
    """The script's source and each step's statement text as the model's history records them: each
    quoted argument replaced by what its transform records of it (``lora`` keeps a file's name, never
    the directories above it: a save does not carry the path of a file on the machine that made it).
    ``the_plan`` is a :class:`transformdsl.planner.Plan`; ``transform`` and ``convert`` both record with it."""
    from .formatter import format_value
    from .ir import source_lines

    original = the_plan.script.source
    lines = source_lines(original) if original else []
    edits: dict[int, list[tuple[int, int, str]]] = {}
    texts = {}
    for step in the_plan.steps:
        text = step.text(original)
        argument = step.statement.argument
        if argument is not None and argument.span is not None and 1 <= argument.span.line <= len(lines):
            span = argument.span
            written = lines[span.line - 1][span.column - 1 : span.end_column - 1]
            recorded = format_value(step.transform.recorded_argument())
            if not recorded.startswith('"'):
                recorded = f'"{recorded}"'
            text = text.replace(written, recorded, 1)
            edits.setdefault(span.line, []).append((span.column, span.end_column, recorded))
        texts[id(step)] = text
    if not edits:
        return original, texts
    for number, changes in edits.items():
        line = lines[number - 1]
        for start, end, recorded in sorted(set(changes), reverse=True):
            line = line[: start - 1] + recorded + line[end - 1 :]
        lines[number - 1] = line
    return "\n".join(lines) + ("\n" if original.endswith("\n") else ""), texts
