"""Fixes that are checked before they are shown.

When planning fails (two statements claim the same modules, a selector matches nothing, a selected
module does not suit the options), the error suggests an edit to the script.  Every edit suggested
here has been applied to a copy of the script and planned again against the same model: it is shown
only if that plan gets past the problem it fixes, and (for a conflict) leaves each of the two
statements something to do.  Candidates are tried smallest first, in the user's own vocabulary: the
selectors the script already uses, then the blocks that hold the modules (``transformer_blocks.*``,
``layers``), then the names of the modules themselves.

What a caller may rely on: a hint returned by :func:`conflict_fix`, :func:`working_names` or
:func:`exclusion_fix` makes that problem go away on this model; ``None`` (or an empty list) when no
candidate does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from .errors import ScriptError
from .ir import Selector, Statement
from .parser import make_selector
from .selectors import select, topmost
from .tree import is_below
from .validate import ValidatedScript

if TYPE_CHECKING:  # pragma: no cover
    from .tree import ModuleTree


class Planner(Protocol):
    """What a hint needs of the planner asking for it (:class:`transformdsl.planner.Planner`, which
    imports this module): its model, what its hints' plans share (:class:`Replanning`), a planner of
    the same class for an edited script, and a run."""

    model: Any
    replanning: Replanning | None

    def __init__(self, model: Any, validated: ValidatedScript, hints: bool = True, *,
                 replanning: Replanning | None = None, fail_fast: bool = False,
                 upto: Statement | None = None) -> None:
        ...

    def attempt(self) -> list | None: ...

    problems: list


class Step(Protocol):
    """A planned statement (:class:`transformdsl.planner.Step`), as far as a hint reads it."""

    statement: Statement

#: At most this many re-plans per hint (each is one walk of the model's tree).
MAX_TRIES = 12

#: The plans made to check one plan's hints do at most this many times the plan's own work, counted in
#: modules: each statement resolved counts the modules of its tree, and so does each copy of a tree...
HINT_WORK_FACTOR = 4
#: ... plus, whatever the script's length, :data:`MAX_TRIES` plans of a two-statement script (each
#: statement and the tree copy counting the largest tree's modules): a short script's hints are checked
#: in full, and a long one's hints cost a few plans of it, not a few per problem (32 repeated
#: `quantize int8` lines took 7.3 s to plan on the built-in Flux, 255 `attention` lines 85 s).
HINT_FLOOR_MODULES = 3 * MAX_TRIES


class HintBudgetSpent(Exception):
    """The plans made for hints used up their budget (:class:`Replanning`): no more hints are checked."""


class Replanning:
    """What the plans made to check one plan's hints share: the work they may still do (in modules, as
    :data:`HINT_WORK_FACTOR` counts it), the plans already made (by edits), and each component's tree as
    it was before any statement (a plan starts from a copy, not a new walk of the model)."""

    def __init__(self, work: int, trees: dict[str, ModuleTree]):
        largest = max((len(t) for t in trees.values()), default=0)
        self.left = HINT_WORK_FACTOR * work + HINT_FLOOR_MODULES * largest
        self.plans: dict = {}
        self.trees = trees

    @property
    def spent(self) -> bool:
        return self.left <= 0

    def spend(self, work: int) -> None:
        """Count ``work`` modules; :class:`HintBudgetSpent` once nothing was left."""
        if self.left <= 0:
            raise HintBudgetSpent
        self.left -= work

#: An edit: (statement, clause, selector texts): add ``except``/``in`` selectors to a statement.
Edit = tuple[Statement, str, tuple[str, ...]]


def replan(planner: Planner, validated: ValidatedScript, edits: Iterable[Edit] = (),
           replace: dict[tuple[Statement, str, int], str] | None = None, *, fail_fast: bool = False,
           upto: Statement | None = None):
    """Plan ``validated`` with ``edits`` (added clauses) and ``replace`` (selector texts swapped) applied.

    ``fail_fast``: stop at the first problem (for a fix that must leave none); ``upto``: stop after that
    (original) statement (for a fix of that statement's own problem: later statements cannot change
    it).  Each plan is made once per set of edits (conflicts of repeated lines try the same edits) and
    spends the planner's budget (:class:`Replanning`; :class:`HintBudgetSpent` once it is used up).

    Returns ``(steps or None, problems, statements)``: the planned steps (what a plan holds), and
    ``statements`` mapping each original statement's ``id`` to its edited copy.
    """
    edits = list(edits)
    replace = replace or {}
    replanning = planner.replanning
    cache = replanning.plans if replanning is not None else None
    key = (tuple((id(s), c, t) for s, c, t in edits),
           tuple(sorted(((id(s), c, i), t) for (s, c, i), t in replace.items())), fail_fast, id(upto))
    if cache is not None and key in cache:
        return cache[key]
    result = _replan(planner, validated, edits, replace, fail_fast, upto)
    if cache is not None:
        cache[key] = result
    return result


def _replan(planner: Planner, validated: ValidatedScript, edits: list[Edit],
            replace: dict[tuple[Statement, str, int], str], fail_fast: bool, upto: Statement | None):
    steps, statements = [], {}
    for transform in validated.steps:
        statement = transform.statement
        new = statement
        for (original, clause, index), text in replace.items():
            if original is statement:
                selectors = list(getattr(new, clause))
                selectors[index] = make_selector(text, selectors[index].span)
                new = dataclasses.replace(new, **{clause: tuple(selectors)})
        for original, clause, texts in edits:
            if original is statement:
                field = "exclude" if clause == "except" else "scope"
                added = tuple(make_selector(t, statement.span) for t in texts)
                new = dataclasses.replace(new, **{field: getattr(new, field) + added})
        statements[id(statement)] = new  # by identity: repeated lines are equal statements
        steps.append(transform if new is statement else type(transform)(new, transform.options, transform.common))
    planner = type(planner)(planner.model, ValidatedScript(validated.script, tuple(steps)), hints=False,
                            replanning=planner.replanning, fail_fast=fail_fast,
                            upto=statements.get(id(upto)) if upto is not None else None)
    try:
        steps = planner.attempt()
    except ScriptError as error:  # a transform's own check raising it
        return None, list(error.problems), statements
    return steps, list(planner.problems), statements


def _targets(steps, statement: Statement) -> int:
    return sum(len(s.targets) for s in steps if s.statement is statement)


# --------------------------------------------------------------------------- conflicts


def block_selectors(tree: ModuleTree, paths: list[str], limit: int | None = None) -> list[str]:
    """Selectors naming the blocks that hold ``paths``, outermost repeated block first (the first
    ``limit`` of them: each costs a look at the tree, and a hint tries a few).

    A module inside a container of repeated blocks (a ``ModuleList``: ``transformer_blocks``,
    ``layers``) is held by that container; the word naming it is used when it names that
    container alone (``single_transformer_blocks``), else its path glob (``transformer_blocks.*``:
    the word ``transformer_blocks`` also names ``single_transformer_blocks``).
    """
    containers: dict[str, None] = {}
    for path in paths:
        parts = path.split(".")
        holder = None
        for depth in range(1, len(parts)):
            if parts[depth].isdigit():
                holder = ".".join(parts[:depth])
                break
        containers.setdefault(holder if holder is not None else path, None)
    return [selector_for(tree, container) for container in list(containers)[:limit]]


def selector_for(tree: ModuleTree, path: str) -> str:
    """The plainest selector naming the module at ``path`` and its subtree, nothing else."""
    word = path.rpartition(".")[2]
    if word and not word.isdigit() and word.islower():
        try:
            if topmost(select(make_selector(word), tree)) == [path]:
                return word
        except ValueError:
            pass
    return f"{path}.*" if tree.get(path) is not None and tree.children(path) else path


def _leaf_names(paths: list[str]) -> list[str]:
    # The last segment that is a name: `to_out.0` -> `to_out` (the word `0` would name every block 0).
    return sorted({next((s for s in reversed(p.split(".")) if not s.isdigit()), p) for p in paths})


def conflict_fix(planner: Planner, validated: ValidatedScript, first: Step, second: Step, paths: list[str],
                 tree: ModuleTree) -> str | None:
    """A checked edit that resolves the conflict of ``first`` and ``second`` over ``paths``."""
    a, b = first.statement, second.statement
    blocks = block_selectors(tree, paths, limit=MAX_TRIES + 1)  # more than the tries can reach
    candidates: list[tuple[Edit, ...]] = []
    if b.scope:  # the user's own words first: what the other statement is scoped to
        candidates.append(((a, "except", tuple(s.text for s in b.scope)),))
    if a.scope:
        candidates.append(((b, "except", tuple(s.text for s in a.scope)),))
    for size in (1, 2):
        for start in range(0, max(1, len(blocks) - size + 1)):
            chosen = tuple(blocks[start : start + size])
            if len(chosen) < size:
                continue
            candidates.append(((a, "except", chosen),))
            candidates.append(((b, "except", chosen),))
            if not b.scope:  # split the model: the blocks go to the second statement, the rest to the first
                candidates.append(((a, "except", chosen), (b, "in", chosen)))
            if not a.scope:
                candidates.append(((b, "except", chosen), (a, "in", chosen)))
    leaves = _leaf_names(paths)
    if len(leaves) <= 3:
        candidates.append(((b, "except", tuple(leaves)),))
        candidates.append(((a, "except", tuple(leaves)),))
    seen = set()
    tries = 0
    for edits in candidates:
        key = tuple((id(s), c, t) for s, c, t in edits)
        if key in seen:
            continue
        seen.add(key)
        tries += 1
        if tries > MAX_TRIES:
            break
        planned, _, statements = replan(planner, validated, edits, fail_fast=True)
        if planned is not None and _targets(planned, statements[id(a)]) and _targets(planned, statements[id(b)]):
            return describe(edits)
    return None


def describe(edits: tuple[Edit, ...]) -> str:
    parts = [f"'{clause} {', '.join(texts)}' to line {statement.line}" for statement, clause, texts in edits]
    if len(parts) == 1:
        return f"add {parts[0]} (checked: the script then plans)"
    return "split the model between them: add " + " and ".join(parts) + " (checked: the script then plans)"


# --------------------------------------------------------------------------- selectors that match nothing


def working_names(planner: Planner, validated: ValidatedScript, statement: Statement, clause: str, index: int,
                   candidates: list[str]) -> list[str]:
    """The ``candidates`` that, written in place of the selector, make its problem go away (and, when
    the script then plans, leave the statement something to do)."""
    span = getattr(statement, clause)[index].span
    kept = []
    for text in candidates[:MAX_TRIES]:
        try:
            planned, problems, statements = replan(planner, validated, replace={(statement, clause, index): text},
                                                    upto=statement)
        except ValueError:  # not a valid selector
            continue
        if any(span in p.spans for p in problems):
            continue
        if planned is not None and not _targets(planned, statements[id(statement)]):
            continue
        kept.append(text)
    return kept


# --------------------------------------------------------------------------- modules that do not suit the options


def exclusion_fix(planner: Planner, validated: ValidatedScript, statement: Statement, paths: list[str],
                  tree: ModuleTree) -> str | None:
    """A checked ``except`` that drops the modules that do not suit ``statement``'s options."""
    paths = [p for p in paths if p]  # the component itself ("") cannot be excluded by a selector
    if not paths:
        return None
    candidates = [tuple(_leaf_names(paths))] if len(_leaf_names(paths)) <= 3 else []
    candidates.append(tuple(selector_for(tree, p) for p in topmost(paths))[:4])
    for texts in candidates:
        if not all(texts):
            continue
        planned, _, statements = replan(planner, validated, [(statement, "except", texts)], fail_fast=True)
        if planned is not None and _targets(planned, statements[id(statement)]):
            return describe(((statement, "except", texts),))
    return None


# --------------------------------------------------------------------------- what to suggest


def candidates_for(selector: Selector, tree: ModuleTree, clause: str, close: list[str]) -> list[str]:
    """Names to try in place of a selector that matched nothing: the close spellings first, then the
    model's repeated blocks, named the way the selector was written (class glob, or block names for
    ``in``): ``*TransformerBlock`` on Llama gives ``*DecoderLayer``, on GPT-2 ``GPT2Block``."""
    containers = _block_containers(tree)
    blocks: list[str] = []
    if selector.kind == "class" or (clause == "scope" and selector.pattern[:1].isupper()):
        blocks.extend(_class_glob(tree[kids[0]].cls.__name__) for _, kids in containers)
    if clause == "scope" or selector.kind in ("word", "name", "path"):
        blocks.extend(selector_for(tree, path) for path, _ in containers)
    # A scope usually names blocks: after the closest spelling, the model's blocks come first.
    out = close[:1] + blocks + close[1:] if clause == "scope" else close + blocks
    return list(dict.fromkeys(out))


def _block_containers(tree: ModuleTree) -> list[tuple[str, list[str]]]:
    """(path, child paths) of each container of numbered blocks (``transformer_blocks``, ``h``), in tree order."""
    children: dict[str, list[str]] = {}
    for info in tree:
        head, _, last = info.path.rpartition(".")
        if last.isdigit():
            children.setdefault(head, []).append(info.path)
    found = [(path, kids) for path, kids in children.items() if path]
    # The outermost ones: the model's blocks, not the numbered layers inside a block (``ff.net.0``).
    return [(path, kids) for path, kids in found
            if not any(other != path and is_below(path, other) for other, _ in found)]


def _class_glob(name: str) -> str:
    """``LlamaDecoderLayer`` -> ``*DecoderLayer`` (the model's prefix dropped); ``GPT2Block`` stays."""
    import re

    tokens = re.findall(r"[A-Z][a-z]+|[A-Z0-9]+(?![a-z])", name)
    tail = tokens[1:]
    return "*" + "".join(tail) if len(tail) >= 2 and name.endswith("".join(tail)) else name
