"""Execution: run a plan over a real module tree, atomically.

:func:`transform` validates, plans, then applies each statement in execution order.
Every change goes through one :class:`~transformdsl.edit.Edit`; if any statement fails
(or the run is interrupted), the edit is rolled back and the model is exactly as it was.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .edit import Edit
from .errors import TransformError
from .explain import human_bytes
from .ir import Script
from .passes.base import ApplyContext
from .planner import Plan, module_components, plan
from .tree import parameter_bytes
from .validate import ValidatedScript

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


def _progress_factory(enabled: bool) -> Callable:
    if not enabled:
        return lambda iterable, **kwargs: iterable

    from tqdm.auto import tqdm

    def progress(iterable, total=None, desc=None, **kwargs):
        return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr, **kwargs)

    return progress


def transform(model: Any, script: str | Path | Script | ValidatedScript | Plan, *, progress: bool = False,
              log: Callable[[str], None] | None = None) -> Any:
    """Apply ``script`` to ``model`` (an ``nn.Module`` or a diffusers pipeline); return the model.

    The model is changed in place and returned.  ``progress=True`` shows a progress bar
    for long work; ``log`` receives one summary line per statement (modules changed,
    parameter bytes before → after).  If any statement fails, the model is left exactly
    as it was and a :class:`TransformError` names the statement and its line.
    """
    the_plan = script if isinstance(script, Plan) else plan(model, script)
    components = module_components(model)
    edit = Edit()
    applied: dict[str, list[AppliedStep]] = {}
    source = the_plan.script.source
    make_progress = _progress_factory(progress)
    try:
        for step in the_plan.steps:
            root = components[step.component]
            before = parameter_bytes(root)
            started = time.perf_counter()
            ctx = ApplyContext(root, edit, make_progress)
            try:
                record = step.transform.apply(ctx, list(step.targets))
                record = _json_checked(record, step)
            except TransformError as exc:
                raise TransformError(f"line {step.statement.line}: '{step.statement.key}' failed: {exc}; "
                                     "the model was left unchanged") from exc
            except Exception as exc:
                raise TransformError(f"line {step.statement.line}: '{step.statement.key}' failed: "
                                     f"{type(exc).__name__}: {exc}; the model was left unchanged") from exc
            if log is not None:
                after = parameter_bytes(root)
                log(f"line {step.statement.line}: {step.text(source)}: {len(step.targets)} module(s), "
                    f"{human_bytes(before)} -> {human_bytes(after)} ({time.perf_counter() - started:.2f} s)")
            applied.setdefault(step.component, []).append(AppliedStep(
                key=step.transform.key(),
                line=step.statement.line,
                statement=step.text(source),
                options=dataclasses.asdict(step.transform.options),
                common=dataclasses.asdict(step.transform.common),
                record=record,
                script_index=0,
            ))
    except BaseException:
        edit.rollback()
        raise
    edit.commit()
    for name, steps in applied.items():
        _append_history(components[name], source, steps)
    return model


def _append_history(module: nn.Module, source: str, steps: list[AppliedStep]) -> None:
    history = history_of(module) or History([], [])
    index = len(history.scripts)
    history.scripts.append(source)
    for step in steps:
        step.script_index = index
        history.steps.append(step)
    set_history(module, history)


def _json_checked(record: Any, step) -> dict:
    if record is None:
        return {}
    try:
        json.dumps(record)
    except (TypeError, ValueError) as exc:  # a bug in a pass, not a user error
        raise TransformError(f"'{step.statement.key}' returned a record that is not JSON: {exc}") from None
    return record


