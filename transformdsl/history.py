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
