"""Model-independent validation: known verbs/modes/options, pairwise rules, execution order.

Every problem in the script is collected and reported together in one :class:`ScriptError`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

from . import registry
from .errors import Problem, ScriptError, did_you_mean
from .ir import Script, Statement
from .options import build_options
from .passes.base import Transform


@dataclass(frozen=True)
class ValidatedScript:
    """A script whose statements are bound to transforms, in execution order."""

    script: Script
    #: Transform instances in execution order (each holds its statement and typed options).
    steps: tuple[Transform, ...]


def bind(statement: Statement, problems: list[Problem],
         transforms: Mapping[str, type[Transform]] | None = None) -> Transform | None:
    """The transform instance for one statement, or ``None`` (problems appended)."""
    verbs = registry.verbs() if transforms is None else registry.verbs_of(transforms)
    if statement.verb not in verbs:
        problems.append(Problem(f"unknown verb '{statement.verb}'{did_you_mean(statement.verb, verbs)}",
                                [statement.verb_span], hint="verbs: " + ", ".join(sorted(verbs))))
        return None
    modes = verbs[statement.verb]
    cls = registry.get(statement.key) if transforms is None else transforms.get(statement.key)
    if cls is None:
        named = sorted(m for m in modes if m)
        if statement.mode is None:
            problems.append(Problem(f"'{statement.verb}' needs a mode: one of {', '.join(named)}",
                                    [statement.verb_span]))
        else:
            problems.append(Problem(
                f"unknown mode '{statement.mode}' for '{statement.verb}'{did_you_mean(statement.mode, named)}",
                [statement.mode_span], hint=f"'{statement.verb}' modes: " + ", ".join(named)))
        return None
    options, common, option_problems = build_options(statement, cls.Options)
    problems.extend(option_problems)
    if cls.requires_scope and not statement.scope and not statement.target:
        problems.append(Problem(f"'{statement.key}' needs an 'in' clause naming the blocks to work on",
                                [statement.span], hint=f"for example: {statement.key} in *TransformerBlock"))
    if option_problems or options is None:
        return None
    return cls(statement, options, common)


def validate(script: Script, transforms: Mapping[str, type[Transform]] | None = None) -> ValidatedScript:
    """Bind every statement, check pairwise rules and order the statements.

    ``transforms`` (registry key → class) defaults to the registry; ``transformdsl check`` passes
    :func:`transformdsl.catalog.transforms`, the same declarations without torch.
    Raises :class:`ScriptError` listing every problem found.
    """
    problems: list[Problem] = []
    bound = [bind(s, problems, transforms) for s in script.statements]
    transforms = [t for t in bound if t is not None]
    for a in transforms:
        for b in transforms:
            if a is b:
                continue
            reason = a.incompatible(b)
            if reason and not _reported(problems, a, b):
                first, second = sorted((a, b), key=lambda t: t.statement.line)
                problems.append(Problem(
                    f"'{first.statement.key}' (line {first.statement.line}) and '{second.statement.key}' "
                    f"(line {second.statement.line}) cannot be combined: {reason}",
                    [first.statement.span, second.statement.span]))
    order = None
    if len(transforms) == len(bound):
        order = execution_order(transforms, problems)
    if problems:
        raise ScriptError(problems, script.source)
    return ValidatedScript(script, tuple(order))


def _reported(problems: list[Problem], a: Transform, b: Transform) -> bool:
    spans = {a.statement.span, b.statement.span}
    return any(set(p.spans) == spans for p in problems)


def _must_precede(first: Transform, then: Transform) -> bool:
    """Whether the declared rules put ``first`` before ``then``."""
    def applies(patterns: tuple[str, ...], key: str, same_verb: bool) -> bool:
        # A bare wildcard ("*", "compile*") does not order statements of the same verb
        # among themselves: source order decides (or an incompatibility rule forbids them).
        explicit = tuple(p for p in patterns if not (same_verb and ("*" in p)))
        return registry.key_matches(key, explicit)

    same = first.verb == then.verb
    return applies(then.runs_after, first.key(), same) or applies(first.runs_before, then.key(), same)


def execution_order(transforms: list[Transform], problems: list[Problem]) -> list[Transform]:
    """Topological order of the declared constraints; ties keep source order."""
    n = len(transforms)
    successors: dict[int, set[int]] = {i: set() for i in range(n)}
    indegree = [0] * n
    for i in range(n):
        for j in range(n):
            if i != j and _must_precede(transforms[i], transforms[j]) and j not in successors[i]:
                if _must_precede(transforms[j], transforms[i]):
                    a, b = sorted((transforms[i], transforms[j]), key=lambda t: t.statement.line)
                    if not _reported(problems, a, b):
                        problems.append(Problem(
                            f"'{a.statement.key}' (line {a.statement.line}) and '{b.statement.key}' "
                            f"(line {b.statement.line}) each must run before the other", [a.statement.span,
                                                                                          b.statement.span]))
                    continue
                successors[i].add(j)
                indegree[j] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < n:
        stuck = [transforms[i] for i in range(n) if i not in order]
        problems.append(Problem("the ordering rules of these statements form a cycle: "
                                + ", ".join(t.statement.label() for t in stuck),
                                [t.statement.span for t in stuck]))
        return transforms
    return [transforms[i] for i in order]


def check_text(text: str, filename: str | None = None) -> ValidatedScript:
    """Parse and validate script text (what ``transformdsl check`` does)."""
    from .parser import parse

    return validate(parse(text, filename))
