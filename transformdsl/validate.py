"""Model-independent validation: known verbs/modes/options, pairwise rules, execution order.

Every problem in the script is collected and reported together in one :class:`ScriptError`.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping
from dataclasses import dataclass

from . import registry
from .errors import Problem, ScriptError, did_you_mean
from .extend import Transform
from .ir import Argument, Script, Statement
from .options import build_options


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
    statement = _bind_argument(statement, cls, problems)
    if statement is None:
        return None
    options, common, option_problems = build_options(statement, cls.Options)
    problems.extend(option_problems)
    if cls.requires_scope and not statement.scope and not statement.target:
        problems.append(Problem(f"'{statement.key}' needs an 'in' clause naming the blocks to work on",
                                [statement.span], hint=f"for example: {statement.key} in *TransformerBlock"))
    if option_problems or options is None:
        return None
    return cls(statement, options, common)


def _bind_argument(statement: Statement, cls: type[Transform], problems: list[Problem]) -> Statement | None:
    """The statement with its quoted argument checked against what ``cls`` takes (a bare word
    where an argument is due becomes the argument); ``None`` with a problem appended if wrong."""
    what, _, example = (cls.argument or "").partition("|")
    if cls.argument is None:
        if statement.argument is not None:
            problems.append(Problem(f"'{statement.key}' takes no quoted argument", [statement.argument.span]))
            return None
        return statement
    if statement.argument is None and len(statement.target) == 1:
        word = statement.target[0]
        return dataclasses.replace(statement, target=(), argument=Argument(word.text, word.span))
    if statement.argument is None:
        span = statement.target[1].span if statement.target else statement.span
        problems.append(Problem(f"'{statement.key}' needs {what.strip()}" + (", and no selector" if statement.target
                                                                             else ""), [span],
                                hint=f"for example: {example.strip()}" if example else None))
        return None
    if statement.target:
        problems.append(Problem(f"'{statement.key}' takes {what.strip()}, not selectors: name modules with 'in'",
                                [statement.target[0].span]))
        return None
    return statement


#: Pairwise problems (conflicts, ordering cycles) reported per script; past this the
#: rest are summarised: ``n`` statements could otherwise give ``n²`` of them.
MAX_PAIR_PROBLEMS = 20


def validate(script: Script, transforms: Mapping[str, type[Transform]] | None = None) -> ValidatedScript:
    """Bind every statement, check pairwise rules and order the statements.

    ``transforms`` (registry key → class) defaults to the registry; ``transformdsl check`` passes
    :func:`transformdsl.registry.declarations`, the same classes before their implementations (no torch).
    Raises :class:`ScriptError` listing every problem found.  Work is linear in the
    number of statements (times the number of registered transforms).
    """
    problems: list[Problem] = []
    bound = [bind(s, problems, transforms) for s in script.statements]
    transforms = [t for t in bound if t is not None]
    pairs = _PairProblems(problems)
    _check_pairs(transforms, pairs)
    order = None
    if len(transforms) == len(bound):
        order = execution_order(transforms, problems, pairs)
    if problems:
        raise ScriptError(problems, script.source)
    return ValidatedScript(script, tuple(order))


class _PairProblems:
    """Problems naming two statements: each pair once, at most :data:`MAX_PAIR_PROBLEMS`."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        self.seen: set[frozenset] = set()
        self.dropped = 0

    def full(self) -> bool:
        return len(self.seen) >= MAX_PAIR_PROBLEMS

    def add(self, a: Transform, b: Transform, message: str) -> None:
        first, second = sorted((a, b), key=lambda t: t.statement.line)
        spans = frozenset((first.statement.span, second.statement.span))
        if spans in self.seen:
            return
        if self.full():
            self.dropped += 1
            return
        self.seen.add(spans)
        self.problems.append(Problem(message.format(a=first.statement, b=second.statement),
                                     [first.statement.span, second.statement.span]))


def _check_pairs(transforms: list[Transform], pairs: _PairProblems) -> None:
    """``incompatible`` for every ordered pair whose first member has such a rule.

    Only transforms that override :meth:`Transform.incompatible` are asked, and the
    search stops once :data:`MAX_PAIR_PROBLEMS` are found.
    """
    ruled = [t for t in transforms if type(t).incompatible is not Transform.incompatible]
    for a in ruled:
        for b in transforms:
            if pairs.full():
                return
            if a is b:
                continue
            reason = a.incompatible(b)
            if reason:
                pairs.add(a, b, "'{a.key}' (line {a.line}) and '{b.key}' (line {b.line}) cannot be combined: "
                          + reason.replace("{", "{{").replace("}", "}}"))


def _must_precede(first: Transform, then: Transform) -> bool:
    """Whether the declared rules put ``first`` before ``then``."""
    def applies(patterns: tuple[str, ...], key: str, same_verb: bool) -> bool:
        # A bare wildcard ("*", "compile*") does not order statements of the same verb
        # among themselves: source order decides (or an incompatibility rule forbids them).
        explicit = tuple(p for p in patterns if not (same_verb and ("*" in p)))
        return registry.key_matches(key, explicit)

    same = first.verb == then.verb
    return applies(then.runs_after, first.key(), same) or applies(first.runs_before, then.key(), same)


def _rule_key(transform: Transform) -> tuple:
    """What the ordering rules see of a statement: its key, and its rules (a transform whose rules
    depend on its options, as ``lora merge=false``'s do, declares them as properties)."""
    return (transform.key(), tuple(transform.runs_after), tuple(transform.runs_before))


def execution_order(transforms: list[Transform], problems: list[Problem],
                    pairs: _PairProblems | None = None) -> list[Transform]:
    """Topological order of the declared constraints; ties keep source order.

    The rules are declared per transform (registry key, and the options where the rules depend on
    them), so the order is computed on those keys: a statement is ready once every statement of
    each key that must precede its key has run.  Cost: ``n log n`` in statements plus the square of the distinct keys.
    """
    pairs = pairs if pairs is not None else _PairProblems(problems)
    n = len(transforms)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(transforms):
        groups.setdefault(_rule_key(t), []).append(i)
    keys = list(groups)
    sample = {k: transforms[groups[k][0]] for k in keys}
    successors: dict[tuple, list[tuple]] = {k: [] for k in keys}
    predecessors: dict[tuple, set[tuple]] = {k: set() for k in keys}
    cycle = "'{a.key}' (line {a.line}) and '{b.key}' (line {b.line}) each must run before the other"
    for ki in keys:
        for kj in keys:
            if not _must_precede(sample[ki], sample[kj]):
                continue
            if ki == kj or _must_precede(sample[kj], sample[ki]):
                members = groups[ki] if ki == kj else (groups[ki][0], groups[kj][0])
                if len(members) > 1:
                    pairs.add(transforms[members[0]], transforms[members[1]], cycle)
                continue  # no edge either way, as between any two conflicting statements
            successors[ki].append(kj)
            predecessors[kj].add(ki)
    remaining = {k: len(members) for k, members in groups.items()}
    waiting = {k: len(predecessors[k]) for k in keys}
    ready = [i for k in keys if not waiting[k] for i in groups[k]]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        key = _rule_key(transforms[i])
        remaining[key] -= 1
        if remaining[key]:
            continue
        for kj in successors[key]:
            waiting[kj] -= 1
            if waiting[kj] == 0:
                for j in groups[kj]:
                    heapq.heappush(ready, j)
    if pairs.dropped:
        problems.append(Problem(f"and {pairs.dropped} more conflicting pair(s) of statements like those above",
                                [transforms[0].statement.span]))
        pairs.dropped = 0
    if len(order) < n:
        placed = set(order)
        stuck = [transforms[i] for i in range(n) if i not in placed]
        shown = stuck[:MAX_PAIR_PROBLEMS]
        more = f" (and {len(stuck) - len(shown)} more)" if len(stuck) > len(shown) else ""
        problems.append(Problem("the ordering rules of these statements form a cycle: "
                                + ", ".join(t.statement.label() for t in shown) + more,
                                [t.statement.span for t in shown]))
        return transforms
    return [transforms[i] for i in order]


def check_text(text: str, filename: str | None = None) -> ValidatedScript:
    """Parse and validate script text (what ``transformdsl check`` does)."""
    from .parser import parse

    return validate(parse(text, filename))
