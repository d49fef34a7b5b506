"""Execution: run a plan over a real module tree, atomically.

:func:`transform` validates, plans, then applies each statement in execution order.
Every change goes through one :class:`~transformdsl.edit.Edit`; if any statement fails
(or the run is interrupted), the edit is rolled back and the model is exactly as it was.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import verification
from .edit import Edit
from .errors import TransformError
from .explain import human_bytes
from .extend import ApplyContext
from .history import AppliedStep, append_history, applied_step, recorded_text
from .ir import Script
from .planner import Plan, module_components, plan
from .spill import UndoStore, auto_budget, check_undo_options
from .tree import parameter_bytes
from .validate import ValidatedScript
from .verification import (  # noqa: F401  (importable from here, as before the guard had its module)
    ROUNDING_EPS,
    VERIFIED_BEFORE,
    VERIFY_INPUTS_HINT,
    relative_error,
    sample_output,
    script_error_bound,
)

logger = logging.getLogger("transformdsl")


def _progress_factory(enabled: bool) -> Callable:
    if not enabled:
        return lambda iterable, **kwargs: iterable

    from tqdm.auto import tqdm

    def progress(iterable, total=None, desc=None, **kwargs):
        return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr, **kwargs)

    return progress


class NothingToDoWarning(UserWarning):
    """A statement of the script changes nothing on this model (``transform(..., strict=True)``: an error)."""


def idle_statements(the_plan: Plan) -> list[str]:
    """One line per statement of ``the_plan`` that changes no module, saying so and why."""
    source = the_plan.script.source
    out = []
    for step in the_plan.steps:
        if step.targets:
            continue
        why = (f"its {len(step.skipped)} selected module(s) cannot be changed ({step.skipped[0][1]})"
               if step.skipped else step.idle_reason or ("it selects no module" if not step.excluded else
               "its exclusions remove every module it selects (" + ", ".join(step.excluded) + ")"))
        out.append(f"line {step.statement.line}: '{step.text(source)}' changes nothing on this model: {why}")
    return out


class MostlySkippedWarning(UserWarning):
    """A statement changes fewer than half of the modules it selects (``Step.mostly_skipped``)."""


def mostly_skipped_statements(the_plan: Plan) -> list[str]:
    """One line per statement of ``the_plan`` that leaves most of what it selects as it is."""
    source = the_plan.script.source
    return [f"line {step.statement.line}: '{step.text(source)}' {partial}"
            for step in the_plan.steps if (partial := step.mostly_skipped())]


#: Device notes already logged by this process (each is logged once, not at every transform()).
_LOGGED_DEVICE_NOTES: set[str] = set()


def _log_device_notes(the_plan: Plan, log: Callable[[str], None] | None) -> None:
    """Each statement's note that its backend has no fast kernel on this device: to ``log`` when
    given (at every call, with the other summary lines), else to the ``transformdsl`` logger at
    WARNING, once per process."""
    for step in the_plan.steps:
        note = step.device_note
        if not note:
            continue
        line = f"line {step.statement.line}: {step.statement.key}: device: {note}"
        if log is not None:
            log(line)
        elif note not in _LOGGED_DEVICE_NOTES:
            _LOGGED_DEVICE_NOTES.add(note)
            logger.warning(line)


def transform(model: Any, script: str | Path | Script | ValidatedScript | Plan, *, progress: bool = False,
              log: Callable[[str], None] | None = None, verify: bool | float | str | dict = False,
              verify_inputs: tuple[tuple, dict] | list[tuple[tuple, dict]] | None = None, strict: bool = False,
              undo: str = "auto", undo_budget: int | None = None, undo_dir: str | Path | None = None,
              calibration: Any = None, tokenizer: Any = None) -> Any:
    """Apply ``script`` to ``model`` (an ``nn.Module`` or a diffusers pipeline); return the model.

    The model is changed in place and returned.  ``progress=True`` shows a progress bar
    for long work; ``log`` receives one summary line per statement (modules changed,
    parameter bytes before → after).  If any statement fails, the model is left exactly
    as it was and a :class:`TransformError` names the statement and its line.

    ``verify=True`` runs the model on a sample input before and after (that of
    :func:`transformdsl.models.sample_inputs`, or ``verify_inputs=(args, kwargs)``, which
    implies ``verify``) and fails the same way, leaving the model as it was, when the
    output moved more than the script's error bound: per-token KL for logits, relative RMS
    otherwise (:mod:`transformdsl.verification`).  ``verify=`` also takes a bound
    (``verify=0.05``), a metric (``verify="top1"``) or both (``verify={"kl": 0.05}``).
    ``verify_inputs=[(args, kwargs), ...]`` checks several samples, the worst error counts:
    how much a lossy transform moves the output varies from input to input (2x across random
    inputs on a narrow UNet), so one sample that happens to sit under the bound proves little.
    A script that compiles is verified just before its ``compile`` statement runs, on the transformed
    model not yet compiled (compiling changes no weight; after it, each sample would be compiled).

    A statement that changes no module (its selectors name nothing the transform can change on
    this model) is a :class:`NothingToDoWarning`; with ``strict=True`` it is a
    :class:`TransformError`, raised before anything is changed.

    Until the script has run, the originals it replaces are kept so that a failure can put them
    back (the undo log).  ``undo`` says where they wait once they exceed ``undo_budget`` bytes:
    ``"auto"`` (the default) keeps up to ``undo_budget`` bytes of them in memory (default: 5% of
    the model's parameter bytes, at least 64 MiB and at most 1 GiB) and the rest on disk;
    ``"disk"`` keeps none in memory (``undo_budget`` 0); ``"memory"`` keeps them all in memory
    (the fastest, and twice the memory of the replaced layers at the peak).  On disk means: an
    original memory-mapped from an unchanged file (``from_pretrained`` of a safetensors checkpoint)
    gives its pages back and is read from that file again if needed; any other is written to a
    nameless temporary file in ``undo_dir`` (default: the system's temporary directory), freed when
    the transform ends, whatever way it ends.  Either way a rollback is bit-exact, and only
    originals that nothing but the undo log refers to leave memory.

    ``calibration``: the inputs the statements that learn from data (``quantize int4 method=gptq``,
    ``method=awq``, ``quantize w8a8 smooth=0.5``) fit on: an iterable of model inputs, each a tensor
    (the first positional argument: token ids ``(1, seqlen)``), a mapping of forward keyword
    arguments, or an ``(args, kwargs)`` pair; or the script's ``calibrate "PATH"`` statement
    (text is tokenized with ``tokenizer``, default: the tokenizer saved beside the model).  The
    data are read and checked before anything changes.  With ``verify`` and no ``verify_inputs``,
    the guard measures on a held-out eighth of the samples, which the methods never fit on.
    """
    check_undo_options(undo, undo_budget)
    the_plan = script if isinstance(script, Plan) else plan(model, script, calibration=calibration is not None)
    if the_plan.skeletons:
        which = "the model's" if the_plan.skeletons == [""] else f"{', '.join(the_plan.skeletons)}'s"
        raise TransformError(f"{which} weights are all on the meta device (none loaded): load them before "
                             "transforming (plan() and explain show what the script would do); nothing was changed")
    idle = idle_statements(the_plan)
    if idle and strict:
        raise TransformError("; ".join(idle) + " (strict: nothing was changed)")
    for line in idle:
        warnings.warn(line, NothingToDoWarning, stacklevel=2)
    for line in mostly_skipped_statements(the_plan):
        warnings.warn(line, MostlySkippedWarning, stacklevel=2)
        if log is not None:
            log(line)
    _log_device_notes(the_plan, log)
    components = module_components(model)
    from .calibration import for_run

    data = for_run(the_plan, components, calibration, tokenizer)
    checks = verification.checks(verify) or ([verification.Check()] if verify_inputs is not None else [])
    if data is not None:
        for line in data.warnings():
            warnings.warn(line, UserWarning, stacklevel=2)
            if log is not None:
                log(line)
        if checks and verify_inputs is None and len(data.samples) > 1:
            data.split_heldout()
            verify_inputs = list(data.heldout)
            if log is not None:
                log(f"verify: on {len(data.heldout)} held-out calibration sample(s) ({data.name}), which the methods "
                    f"do not fit on; they fit on the other {len(data.samples)}")
    samples = verify_inputs if isinstance(verify_inputs, list) else [verify_inputs]
    if not samples:
        raise TransformError("verify_inputs=[] holds no sample: pass [(args, kwargs), ...] (nothing was changed)")
    reference = [verification.reference_output(model, sample) for sample in samples] if checks else None
    edit = Edit(_undo_store(undo, undo_budget, undo_dir, components))
    applied: dict[str, list[AppliedStep]] = {}
    source, texts = recorded_text(the_plan)
    make_progress = _progress_factory(progress)
    verified = not checks
    statements = [(step.text(source), step.transform) for step in the_plan.steps]
    try:
        for step in the_plan.steps:
            if not verified and step.transform.verb in VERIFIED_BEFORE:
                verification.verify(model, reference, samples, statements, checks, log, before=step.transform.verb)
                verified = True
            if not step.targets:  # it changes nothing (warned above): neither run nor recorded in the history
                if log is not None:
                    log(f"line {step.statement.line}: {texts[id(step)]}: changes nothing on this model (not run, "
                        "not recorded)")
                continue
            root = components[step.component]
            before = parameter_bytes(root)
            started = time.perf_counter()
            ctx = ApplyContext(root, edit, make_progress, calibration=data)
            record = apply_step(step, ctx, list(step.targets), "the model was left unchanged")
            if edit.store is not None:
                edit.store.settle()
            if log is not None:
                after = parameter_bytes(root)
                log(f"line {step.statement.line}: {texts[id(step)]}: {len(step.targets)} module(s), "
                    f"{human_bytes(before)} -> {human_bytes(after)} ({time.perf_counter() - started:.2f} s)")
            applied.setdefault(step.component, []).append(applied_step(step, texts[id(step)], record))
        if not verified:
            verification.verify(model, reference, samples, statements, checks, log)
    except BaseException:
        try:
            edit.rollback()
        finally:
            _close_store(edit.store, log)
        raise
    edit.commit()
    _close_store(edit.store, log)
    for name, steps in applied.items():
        append_history(components[name], source, steps)
    return model


def _undo_store(undo: str, budget: int | None, directory, components: dict) -> UndoStore | None:
    """The store that bounds the undo log's memory (None: everything stays in memory)."""
    if undo == "memory":
        return None
    if undo == "disk":
        budget = 0
    elif budget is None:
        budget = auto_budget(sum(parameter_bytes(root) for root in components.values()))
    return UndoStore(budget, directory)


def _close_store(store: UndoStore | None, log) -> None:
    if store is None:
        return
    store.close()
    parts = ([f"{human_bytes(store.spilled_bytes)} of originals kept on disk"] if store.spilled_bytes else []) + \
        ([f"{human_bytes(store.dropped_bytes)} of memory-mapped originals left in their files"]
         if store.dropped_bytes else [])
    if log is not None and parts:
        log(f"undo log: {', '.join(parts)} (budget {human_bytes(store.budget)} in memory)")


def apply_step(step, ctx, targets: list[str], consequence: str, apply: Callable | None = None) -> dict:
    """Run one statement's pass on ``targets`` (``apply(ctx, targets)``, default its transform's
    ``apply``); any failure becomes a TransformError naming the line and statement, followed by
    ``consequence`` (what the caller guarantees was kept)."""
    try:
        return _json_checked((apply or step.transform.apply)(ctx, targets), step)
    except TransformError as exc:
        raise TransformError(f"line {step.statement.line}: '{step.statement.key}' failed: {exc}; "
                             f"{consequence}") from exc
    except Exception as exc:
        raise TransformError(f"line {step.statement.line}: '{step.statement.key}' failed: "
                             f"{type(exc).__name__}: {exc}; {consequence}") from exc


def _json_checked(record: Any, step) -> dict:
    if record is None:
        return {}
    try:
        json.dumps(record)
    except (TypeError, ValueError) as exc:  # a bug in a pass, not a user error
        raise TransformError(f"'{step.statement.key}' returned a record that is not JSON: {exc}") from None
    return record

