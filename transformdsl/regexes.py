"""Bounded-time matching for ``re:`` selectors.

Python's own ``re`` engine backtracks without bound: ``re:(\\w+\\.?)*\\(`` on a long module
path runs for minutes.  ``re:`` patterns are compiled with the ``regex`` package instead (the
same syntax, in its ``V0`` compatibility mode), whose matcher takes a timeout; all the
matching of one plan shares one time budget (:func:`regex_budget`).  Measured alternatives
are in SECURITY.md ("Scripts").
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Iterator

import regex

#: Seconds of ``re:`` matching one plan may spend, all selectors together.
REGEX_BUDGET_S = 0.5

#: Seconds of matching left to the current plan (a one-item list), or None outside one.
_left: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("transformdsl_regex_left", default=None)


class SelectorTooSlow(ValueError):
    """A ``re:`` selector used up the matching time of the plan (catastrophic backtracking)."""


@contextlib.contextmanager
def regex_budget(seconds: float = REGEX_BUDGET_S) -> Iterator[None]:
    """Bound the total time ``re:`` selectors may take in this block (one plan).

    Nested, it shares the enclosing budget: the plans a plan makes to check its hints (each fix
    planned again) spend the same 0.5 s, not 0.5 s each (40 statements with a slow pattern and a
    conflict each took 42 s of hints on the built-in UNet)."""
    if _left.get() is not None:
        yield
        return
    token = _left.set([seconds])
    try:
        yield
    finally:
        _left.reset(token)


def budget_spent() -> bool:
    """Whether the enclosing :func:`regex_budget` has no matching time left."""
    left = _left.get()
    return left is not None and left[0] <= 0


#: The syntax that repeats or branches (``*``, ``+``, ``?``, ``{m,n}``, ``|``; ``(?`` extensions
#: too, conservatively).  A pattern without any of it has one way to match at each position: it
#: matches in time bounded by its length times the path's, so it runs without the timeout, whose
#: bookkeeping makes a search of a short path an order of magnitude slower (``^proj_out$``,
#: diffusers' skip patterns).  Alternation alone can backtrack exponentially (``(\w|.)`` repeated).
_REPEATS = frozenset("*+?{|")


@functools.lru_cache(maxsize=1024)
def _repeats(pattern: str) -> bool:
    return not _REPEATS.isdisjoint(pattern)


@functools.lru_cache(maxsize=1024)
def compile_regex(pattern: str) -> regex.Pattern:
    """A ``re:`` selector's pattern (Python syntax; ``regex``'s compatible ``V0`` mode)."""
    return regex.compile(pattern, flags=regex.V0)


def fullmatch(compiled: regex.Pattern, path: str) -> bool:
    """Whether ``compiled`` matches the whole of ``path``, within the time left to the plan (as :func:`search`)."""
    return search(compiled, path, whole=True)


def search(compiled: regex.Pattern, path: str, whole: bool = False) -> bool:
    """Whether ``compiled`` matches somewhere in ``path`` (``whole``: all of it), within the time left to the plan.

    Raises :class:`SelectorTooSlow` once the budget is spent (outside a
    :func:`regex_budget` block, each call gets :data:`REGEX_BUDGET_S`).  A pattern that cannot
    repeat or branch (no ``*``, ``+``, ``?``, ``{`` or ``|``) runs without a timeout and spends none.
    """
    match = compiled.fullmatch if whole else compiled.search
    if not _repeats(compiled.pattern):
        return match(path) is not None
    left = _left.get()
    remaining = REGEX_BUDGET_S if left is None else left[0]
    started = time.monotonic()
    try:
        if remaining <= 0:
            raise TimeoutError
        return match(path, timeout=remaining) is not None
    except TimeoutError:
        raise SelectorTooSlow(f"regular expression {compiled.pattern[:60]!r} takes too long to match module paths "
                              f"(over {REGEX_BUDGET_S:g} s for the script: nested repetition such as (a+)+ "
                              "backtracks without end); simplify it or use a glob") from None
    finally:
        if left is not None:  # only time spent matching counts, not the rest of planning
            left[0] -= time.monotonic() - started
