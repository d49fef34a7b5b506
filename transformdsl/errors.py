"""The exceptions a user of transformdsl may catch.

Every error that reaches a user derives from :class:`TransformError`.  Errors about a
script carry source spans and render the offending lines with carets; errors about a
saved model name the file and what is wrong with it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .ir import Span


class TransformError(Exception):
    """Base class of every error raised by transformdsl."""


class LoadError(TransformError):
    """A saved model cannot be loaded: missing, corrupt, tampered or mismatched files."""


#: Problems shown in full by ``str(ScriptError)``; all of them stay in ``.problems``.
MAX_RENDERED_PROBLEMS = 50


class Problem:
    """One diagnostic: a message anchored at one or more source spans."""

    __slots__ = ("message", "spans", "hint")

    def __init__(self, message: str, spans: Sequence[Span] = (), hint: str | None = None):
        self.message = message
        self.spans = tuple(s for s in spans if s is not None)
        self.hint = hint

    @property
    def span(self) -> Span | None:
        return self.spans[0] if self.spans else None

    def headline(self) -> str:
        where = self.span.location() if self.span else "<script>"
        return f"{where}: {self.message}"

    def render(self, source: str | None) -> str:
        lines = [self.headline()]
        if source is not None:
            for span in self.spans:
                lines.extend(span.excerpt(source))
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Problem({self.headline()!r})"


class ScriptError(TransformError):
    """A script is malformed or invalid.

    ``line`` and ``column`` (1-based) locate the first problem; ``problems`` holds every
    problem found, in source order.  ``str(error)`` shows ``file:line:col: message``, the
    offending line and a caret under the offending text, for each problem.
    """

    def __init__(self, problems: Sequence[Problem], source: str | None = None):
        if not problems:
            raise ValueError("ScriptError needs at least one problem")
        self.problems = tuple(sorted(problems, key=_problem_order))
        self.source = source
        first = self.problems[0].span
        self.line = first.line if first else 1
        self.column = first.column if first else 1
        self.filename = first.file if first else None
        super().__init__(self._render())

    @property
    def message(self) -> str:
        return self.problems[0].message

    def _render(self) -> str:
        shown = [p.render(self.source) for p in self.problems[:MAX_RENDERED_PROBLEMS]]
        return "\n".join(shown + self._more())

    def diagnostics(self) -> list[str]:
        """One ``FILE:LINE:COL: message`` line per problem (the CLI's stderr format), the
        first :data:`MAX_RENDERED_PROBLEMS` of them and a count of the rest."""
        return [p.headline() for p in self.problems[:MAX_RENDERED_PROBLEMS]] + self._more()

    def _more(self) -> list[str]:
        rest = len(self.problems) - MAX_RENDERED_PROBLEMS
        return [f"... and {rest} more problem(s) (fix the first ones and check again)"] if rest > 0 else []


def _problem_order(problem: Problem):
    span = problem.span
    return (span.line, span.column) if span else (0, 0)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when a close choice exists, else ``''``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
