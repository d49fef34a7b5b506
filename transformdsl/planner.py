"""Planning: resolve every statement's selectors against a real module tree.

:func:`plan` walks the model once (``named_modules()``), then resolves statements in
execution order against that snapshot, letting each transform describe its structural
effect so that later statements see the tree as it will be when they run.  The result is
a :class:`Plan`: data you can print (``explain``), compare and save.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .declarations import declared_exclusions
from .errors import Problem, ScriptError
from .extend import Transform
from .hints import HintBudgetSpent, Replanning, candidates_for, conflict_fix, exclusion_fix, working_names
from .ir import Script, Selector, source_lines
from .parser import make_selector, parse, parse_file
from .regexes import SelectorTooSlow, budget_spent, regex_budget
from .registry import key_matches
from .selectors import matches, select, suggestions, topmost
from .tree import WEIGHTS_PENDING, ModuleTree, below_any, is_below, is_skeleton, parameter_bytes
from .validate import ValidatedScript, validate

#: Pipeline components that hold the denoiser, in the order they are looked for.
DENOISERS = ("transformer", "unet", "prior", "decoder")


def load_script(script: str | Path | Script | ValidatedScript) -> Script:
    """A :class:`Script` from text, a ``.tfm`` path, or an already parsed script."""
    if isinstance(script, ValidatedScript):
        return script.script
    if isinstance(script, Script):
        return script
    if isinstance(script, Path) or (isinstance(script, str) and script.endswith(".tfm") and "\n" not in script):
        return parse_file(script)
    if isinstance(script, str):
        return parse(script)
    raise TypeError(f"a script is text, a .tfm path or a parsed Script, not {type(script).__name__}")


# --------------------------------------------------------------------------- models and pipelines


def is_pipeline(model: Any) -> bool:
    """A diffusers pipeline (duck-typed: a ``components`` dict, not an ``nn.Module``)."""
    return not isinstance(model, nn.Module) and isinstance(getattr(model, "components", None), dict)


def module_components(model: Any) -> dict[str, nn.Module]:
    """Name → module for what a script can target: ``{"": model}`` for a plain module."""
    if isinstance(model, nn.Module):
        return {"": model}
    if is_pipeline(model):
        return {k: v for k, v in model.components.items() if isinstance(v, nn.Module)}
    raise TypeError(f"expected a torch.nn.Module or a diffusers pipeline, got {type(model).__name__}")


def denoiser_name(model: Any) -> str:
    if isinstance(model, nn.Module):
        return ""
    components = module_components(model)
    for name in DENOISERS:
        if name in components:
            return name
    raise ValueError(f"this pipeline has no denoiser ({', '.join(DENOISERS)}); name one with component=")


# --------------------------------------------------------------------------- the plan


@dataclass
class Step:
    """One statement as it will run."""

    transform: Transform
    component: str
    targets: list[str]
    #: (path, reason): selected modules the transform cannot change, shown in the plan.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: selector text → number of selected modules it excluded.
    excluded: dict[str, int] = field(default_factory=dict)
    #: modules given up to a statement that takes precedence (path, line).
    overridden: list[tuple[str, int]] = field(default_factory=list)
    bytes: int = 0
    notes: list[str] = field(default_factory=list)
    #: Why the chosen backend is slow on the device the targets are on (no fast kernel there),
    #: what that costs as measured, and the faster alternative; None when it is fast there.
    device_note: str | None = None
    #: Why a statement that targets and skips nothing changes nothing, where the transform can say more
    #: than the selection (``Transform.idle_reason``); None otherwise.
    idle_reason: str | None = None

    @property
    def statement(self):
        return self.transform.statement

    def mostly_skipped(self) -> str | None:
        """A sentence when the transform can change fewer than half of the modules the statement
        selects (a shape rule leaving most of its targets as they are: ``quantize int4`` at group
        128 on 576-wide layers), with the commonest reason (which names the fix where there is
        one); None otherwise (and when it changes nothing: :func:`~transformdsl.executor.idle_statements`)."""
        if not self.targets or len(self.skipped) <= len(self.targets):
            return None
        reasons: dict[str, int] = {}
        for _, reason in self.skipped:
            reasons[reason] = reasons.get(reason, 0) + 1
        commonest = max(reasons, key=reasons.get)
        selected = len(self.skipped) + len(self.targets)
        return (f"changes {len(self.targets)} of the {selected} modules it selects: {len(self.skipped)} are left as "
                f"they are ({reasons[commonest]} because {commonest})")

    def text(self, source: str) -> str:
        """The statement as written in the script."""
        span = self.statement.span
        if span is None or not source:
            return self.statement.key
        lines = source_lines(source)
        if span.line == span.end_line:
            return lines[span.line - 1][span.column - 1 : span.end_column - 1].strip()
        return lines[span.line - 1][span.column - 1 :].strip()

    def to_json(self, source: str = "") -> dict:
        return {
            "line": self.statement.line,
            "statement": self.text(source),
            "key": self.transform.key(),
            "options": dataclasses.asdict(self.transform.options),
            "component": self.component,
            "targets": list(self.targets),
            "skipped": [list(s) for s in self.skipped],
            "excluded": dict(self.excluded),
            "bytes": self.bytes,
            "notes": list(self.notes),
            "device_note": self.device_note,
        }


@dataclass
class Plan:
    """What a script will do to a model: the steps in execution order."""

    script: Script
    steps: list[Step]
    model_name: str
    components: dict[str, str]
    module_count: int
    total_bytes: int
    #: Component (``""`` for a plain module) -> the floating dtype holding most of its parameters.
    dtypes: dict[str, str] = field(default_factory=dict)
    #: Components whose weights are all on the meta device (none loaded): planned as they will be.
    skeletons: list[str] = field(default_factory=list)

    def __iter__(self):
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def to_json(self) -> dict:
        return {
            "model": self.model_name,
            "components": self.components,
            "modules": self.module_count,
            "bytes": self.total_bytes,
            "dtypes": self.dtypes,
            "skeletons": self.skeletons,
            "steps": [s.to_json(self.script.source) for s in self.steps],
        }

    def __str__(self) -> str:
        from .explain import render_plan

        return render_plan(self)


def plan(model: Any, script: str | Path | Script | ValidatedScript, *, component: str | None = None,
         calibration: bool = False) -> Plan:
    """Validate ``script`` and resolve it against ``model`` (an ``nn.Module`` or a pipeline).

    ``component``: ``model`` is that component of a pipeline, planned alone (``convert`` streams
    one component per run): statements with ``component=`` that name it apply to it, those that
    name another are problems saying how to convert that one.

    Raises :class:`ScriptError` for any problem: invalid script, a selector that matches
    nothing (with the nearest names), two statements changing the same module in ways
    that exclude each other, options that do not suit a selected module.
    """
    validated = script if isinstance(script, ValidatedScript) else validate(load_script(script))
    _check_calibration_data(validated, calibration)
    planner = Planner(model, validated)
    planner.component_name = component if isinstance(model, nn.Module) else None
    return planner.run()


def _check_calibration_data(validated: ValidatedScript, given: bool) -> None:
    """A statement that learns from data, in a script without ``calibrate`` and with no
    ``calibration=`` given: a plan error naming both fixes."""
    from .calibration import missing_data_message, needs_data

    if given or any(t.verb == "calibrate" for t in validated.steps):
        return
    problems = []
    for transform in needs_data(validated.steps):
        span = next((o.span for o in transform.statement.options if o.name in ("method", "smooth")),
                    transform.statement.span)
        problems.append(Problem(missing_data_message(transform), [span]))
    if problems:
        raise ScriptError(problems, validated.script.source)


#: Selectors matching nothing for which the plan looks up the nearest names.
MAX_SUGGESTED = 20


class Planner:
    def __init__(self, model: Any, validated: ValidatedScript, hints: bool = True, *,
                 replanning: Replanning | None = None, fail_fast: bool = False, upto=None):
        self.model = model
        #: Whether to compute (and check, by planning again) the fix each problem suggests.
        self.hints = hints
        #: Hints to compute once the run is over: (compute, withdraw), each setting one problem's hint
        #: (``withdraw`` drops a hint that was not checked, when the hints' budget ran out first).
        self.pending: list = []
        #: For a plan made to check a hint: what such plans share (their budget, the plans made, the
        #: trees before any statement), whether it stops at the first problem (a fix must leave none),
        #: and the statement it stops after (later ones cannot change that statement's own problems).
        self.replanning = replanning
        self.fail_fast = fail_fast
        self.upto = upto
        #: Planning work done, in modules: each tree walked or copied, and each statement resolved,
        #: counts the modules of its tree.
        self.work = 0
        #: Each component's tree as it was before any statement (kept for the hints' plans).
        self.pristine: dict[str, ModuleTree] = {}
        self.validated = validated
        self.script = validated.script
        self.components = module_components(model)
        self.trees: dict[str, ModuleTree] = {}
        self.problems: list[Problem] = []
        #: (component, exclusive group) → path → the step that claimed it.
        self.claims: dict[tuple[str, str], dict[str, Step]] = {}
        #: Selectors that matched nothing so far (nearest names are looked for the first few).
        self.suggested = 0
        #: The pipeline component ``model`` is, when it is planned alone (:func:`plan`'s ``component``).
        self.component_name: str | None = None

    def tree(self, component: str) -> ModuleTree:
        if component not in self.trees:
            shared = self.replanning.trees if self.replanning is not None else {}
            if component in shared:
                tree = shared[component].copy()
            else:
                tree = ModuleTree.of(self.components[component])
                if self.hints:
                    self.pristine[component] = tree.copy()
            self._spend(len(tree))
            self.trees[component] = tree
        return self.trees[component]

    def _spend(self, work: int) -> None:
        self.work += work
        if self.replanning is not None:
            self.replanning.spend(work)

    def run(self) -> Plan:
        steps = self.attempt()
        if steps is None:
            raise ScriptError(self.problems, self.script.source)
        # The snapshots counted their modules and bytes; components no statement used are walked here.
        module_count = sum(self.trees[n].module_count if n in self.trees else sum(1 for _ in m.modules())
                           for n, m in self.components.items())
        total = sum(self.trees[n].total_bytes if n in self.trees else parameter_bytes(m)
                    for n, m in self.components.items())
        from .dtypes import model_dtypes

        skeletons = [name for name, m in self.components.items()
                     if not m.__dict__.get(WEIGHTS_PENDING) and is_skeleton(m)]
        return Plan(self.script, steps, type(self.model).__name__,
                    {name: type(m).__name__ for name, m in self.components.items()}, module_count, total,
                    model_dtypes(self.model), skeletons)

    def attempt(self) -> list[Step] | None:
        """Resolve the statements: the steps, or None with :attr:`problems` set (their hints computed
        when :attr:`hints`).  What :meth:`run` builds its plan from, and all a hint's plan needs."""
        default = denoiser_name(self.model)
        steps = []
        with regex_budget():  # one budget for the plan and the plans its hints make
            for transform in self.validated.steps:
                if self.fail_fast and self.problems:
                    break
                component = transform.common.component or default
                if component == self.component_name:
                    component = ""
                if component not in self.components:
                    self._component_problem(transform, component)
                    continue
                tree = self.tree(component)
                self._spend(len(tree))
                try:
                    step = self.resolve(transform, component, tree)
                except SelectorTooSlow as exc:
                    self.problems.append(Problem(str(exc), [transform.statement.span]))
                    continue
                if step is not None:
                    steps.append(step)
                if transform.statement is self.upto:
                    break
            if self.problems:
                if self.hints:
                    self._compute_hints()
                return None
        return steps

    def _compute_hints(self) -> None:
        """Check the fixes the problems suggest, within one budget: the plans they make together may do
        :data:`~transformdsl.hints.HINT_WORK_FACTOR` times this plan's work, plus a short script's
        share, so that planning stays linear in statements x modules however many problems a script
        has.  Hints past it are not shown (never an edit that was not checked)."""
        self.replanning = Replanning(self.work, self.pristine)
        for index, (compute, _) in enumerate(self.pending):
            if budget_spent() or self.replanning.spent:  # a regex too slow, or the planning work used up
                for _, rest in self.pending[index:]:
                    rest()
                return
            try:
                compute()
            except HintBudgetSpent:
                for _, rest in self.pending[index:]:
                    rest()
                return

    def _component_problem(self, transform: Transform, component: str) -> None:
        statement = transform.statement
        span = next((o.span for o in statement.options if o.name == "component"), statement.span)
        if self.component_name is not None:
            self.problems.append(Problem(
                f"component={component}: convert streams one pipeline component per run, and this run converts "
                f"'{self.component_name}'", [span],
                hint=f"convert {component} in a run of its own: --component {component}, with a script of its "
                     f"statements"))
        elif isinstance(self.model, nn.Module):
            self.problems.append(Problem("component= applies to pipelines; this model is a single module",
                                         [span]))
        else:
            names = ", ".join(sorted(self.components))
            self.problems.append(Problem(f"the pipeline has no component '{component}'", [span],
                                         hint=f"components: {names}"))

    def _selectors_or_problem(self, selectors: tuple[Selector, ...], tree: ModuleTree,
                              within: list[str] | None, scope: tuple[Selector, ...] = (),
                              statement=None, clause: str = "target") -> list[list[str]]:
        found = []
        for index, selector in enumerate(selectors):
            paths = select(selector, tree, within)
            if not paths:
                outside = select(selector, tree, None) if scope else []
                if outside:
                    # Not "matches no module, nearest: <itself>": it matches, but not within `in ...`.
                    where = ", ".join(s.text for s in scope)
                    more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
                    self.problems.append(Problem(
                        f"selector '{selector.text}' matches no module in the scope ('in {where}')",
                        [selector.span], hint=f"it matches {outside[0] or '<root>'}{more}, outside the scope"))
                else:
                    # Nearest names cost a fuzzy search over the tree (and checking them, a plan each):
                    # a few are enough.
                    self.suggested += 1
                    wanted = self.hints and self.suggested <= MAX_SUGGESTED  # a hint's own plan shows none
                    close = suggestions(selector, tree) if wanted else []
                    problem = Problem(f"selector '{selector.text}' matches no module", [selector.span],
                                      hint=("nearest names: " + ", ".join(close)) if close else None)
                    self.problems.append(problem)
                    if statement is not None and wanted:
                        self.pending.append((functools.partial(self._names_hint, problem, selector, statement,
                                                               clause, index, close, tree),
                                             functools.partial(setattr, problem, "hint", None)))
            found.append(paths)
        return found

    def resolve(self, transform: Transform, component: str, tree: ModuleTree) -> Step | None:
        statement = transform.statement
        before = len(self.problems)
        # 1. scope: modules at or below what `in` names (the whole component by default).
        if statement.scope:
            roots = topmost([p for paths in self._selectors_or_problem(statement.scope, tree, None,
                                                                        statement=statement, clause="scope")
                             for p in paths])
        else:
            roots = [""]
        # 2. targets: what the statement (or the transform, by default) names, within scope.
        if statement.target and len(self.problems) > before:
            candidates = []  # the scope matched nothing: its error says so; targets are not looked for
        elif statement.target:
            selected = self._selectors_or_problem(statement.target, tree, roots, statement.scope,
                                                  statement=statement, clause="target")
            candidates = _union(selected)
        elif transform.default_target is None:
            candidates = list(roots)
        else:
            defaults = [make_selector(text) for text in transform.default_target]
            candidates = _union([select(s, tree, roots) for s in defaults])
        # 3. exclusions: what `except` names, the transform's defaults and what the model itself
        #    declares (declarations.py), with their subtrees; each labelled as the plan shows it.
        exclusions: list[tuple[str, list[str]]] = []
        declared: list[tuple[str, list[str]]] = []
        if statement.exclude:
            found = self._selectors_or_problem(statement.exclude, tree, None, statement=statement,
                                               clause="exclude")
            exclusions.extend((f"except {s.text}", paths) for s, paths in zip(statement.exclude, found))
        if transform.common.default_except:
            for text in transform.default_except:
                exclusions.append((f"default: {text}", select(make_selector(text), tree, None)))
            for declaration, paths in declared_exclusions(tree, transform.honoured_declarations):
                declared.append((f"model: {declaration.label}", paths))
        if len(self.problems) > before:
            return None
        step = Step(transform, component, [])
        kept = []
        excluded_below = [(label, frozenset(roots_)) for label, roots_ in exclusions + declared]
        by_declaration: dict[str, list[str]] = {}
        for path in candidates:
            label = next((label for label, roots_ in excluded_below if below_any(path, roots_)), None)
            if label is not None:
                step.excluded[label] = step.excluded.get(label, 0) + 1
                if label.startswith("model: "):
                    by_declaration.setdefault(label, []).append(path)
            else:
                kept.append(path)
        # An `except` that names only modules inside a target would be silently ignored: the
        # transform changes each target as a whole (compile, a cache on the denoiser, a LoRA on the model).
        for selector, (label, paths) in zip(statement.exclude, exclusions):
            inside = [p for p in paths if any(p != t and is_below(p, t) for t in kept)]
            if paths and inside and not step.excluded.get(label):
                where = ", ".join(t or "<root>" for t in kept if is_below(inside[0], t))
                self.problems.append(Problem(
                    f"'except {selector.text}' would change nothing: '{transform.key()}' changes {where} as a "
                    f"whole, and {inside[0]} lies inside it", [selector.span],
                    hint=f"name what '{statement.key}' should change with 'in' (or a target) instead"))
        if len(self.problems) > before:
            return None
        for label, paths in by_declaration.items():
            shown = ", ".join(paths[:2]) + (f" (+{len(paths) - 2})" if len(paths) > 2 else "")
            step.notes.append(f"the model declares {label.removeprefix('model: ')}: {shown} left as they are "
                              "(default_except=false transforms them too)")
        # 4. can the transform change each one?  Near misses are kept with their reason.
        errors = []
        for path in kept:
            info = tree[path]
            reason = transform.candidate(info, tree)
            if reason:
                step.skipped.append((path, reason))
                continue
            error = transform.check(info, tree)
            if error:
                errors.append((path, error))
                continue
            step.targets.append(path)
        partial = step.mostly_skipped()
        if partial:
            step.notes.append(partial)
        if errors:
            by_error: dict[str, list[str]] = {}  # one device problem is said once, not per module
            for p, e in errors:
                by_error.setdefault(e, []).append(p or "<root>")
            shown = "; ".join(", ".join(ps[:2]) + (f" (+{len(ps) - 2})" if len(ps) > 2 else "") + f": {e}"
                              for e, ps in list(by_error.items())[:5])
            more = f" (and {len(by_error) - 5} more)" if len(by_error) > 5 else ""
            problem = Problem(f"'{statement.key}' cannot transform {len(errors)} selected "
                              f"module(s): {shown}{more}", [statement.span],
                              hint="exclude them with 'except' or change the options")
            self.problems.append(problem)
            self.pending.append((functools.partial(self._exclusion_hint, problem, statement,
                                                   [p for p, _ in errors], tree), _keep))
            return None
        self._claim(step)
        step.bytes = _bytes(tree, step.targets)
        step.notes.extend(transform.notes(tree, step.targets))
        step.device_note = transform.device_note(tree, step.targets) if step.targets else None
        if not step.targets:
            step.notes.append("selects no module: this statement does nothing on this model")
            if not step.skipped:
                step.idle_reason = transform.idle_reason(tree)
        transform.plan_effect(tree, list(step.targets))
        return step

    def _claim(self, step: Step) -> None:
        group = step.transform.exclusive
        if group is None:
            return
        claims = self.claims.setdefault((step.component, group), {})
        conflicts: dict[int, tuple[Step, list[str]]] = {}
        kept = []
        for path in step.targets:
            owner = claims.get(path)
            if owner is None:
                kept.append(path)
                continue
            if key_matches(step.transform.key(), owner.transform.overrides):
                step.overridden.append((path, owner.statement.line))
                continue
            conflicts.setdefault(id(owner), (owner, []))[1].append(path)
        for owner, paths in conflicts.values():
            a, b = owner.statement, step.statement
            sample = ", ".join(p or "<root>" for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
            problem = Problem(
                f"'{a.key}' (line {a.line}) and '{b.key}' (line {b.line}) both change {len(paths)} module(s) "
                f"({sample}); a module takes one of them", [a.span, b.span],
                hint="narrow one statement with 'except' or 'in' so that each module is named by one of them")
            self.problems.append(problem)
            self.pending.append((functools.partial(self._conflict_hint, problem, owner, step, list(paths),
                                                   self.tree(step.component)), _keep))
        step.targets = kept
        for path in kept:
            claims[path] = step
        if step.overridden:
            lines = sorted({line for _, line in step.overridden})
            step.notes.append(f"{len(step.overridden)} module(s) left to line(s) "
                              f"{', '.join(map(str, lines))}, which take precedence")


    # ------------------------------------------------------------------ hints, checked by planning again

    def _conflict_hint(self, problem: Problem, first: Step, second: Step, paths: list[str],
                       tree: ModuleTree) -> None:
        fix = conflict_fix(self, self.validated, first, second, paths, tree)
        if fix:
            problem.hint = fix

    def _names_hint(self, problem: Problem, selector: Selector, statement, clause: str, index: int,
                    close: list[str], tree: ModuleTree) -> None:
        names = working_names(self, self.validated, statement, clause, index,
                              candidates_for(selector, tree, clause, close))
        # Only names that work: each was written in place of the selector and the script planned again.
        problem.hint = "nearest names: " + ", ".join(names[:3]) if names else None

    def _exclusion_hint(self, problem: Problem, statement, paths: list[str], tree: ModuleTree) -> None:
        fix = exclusion_fix(self, self.validated, statement, paths, tree)
        problem.hint = fix or "change the options (no 'except' leaves this statement something to do)"


def _keep() -> None:
    """A pending hint whose unchecked text is no edit (a conflict's or an exclusion's advice): kept."""


def _union(lists: list[list[str]]) -> list[str]:
    seen: dict[str, None] = {}
    for paths in lists:
        for p in paths:
            seen.setdefault(p, None)
    return list(seen)


def _bytes(tree: ModuleTree, paths: list[str]) -> int:
    roots = topmost(paths)
    return sum(tree.subtree_bytes(p) for p in roots)


__all__ = ["Plan", "Step", "plan", "load_script", "is_pipeline", "module_components", "denoiser_name",
           "matches"]
