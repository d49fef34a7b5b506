"""The typed intermediate representation of a script.

Nodes are small frozen dataclasses; each carries the :class:`Span` it came from so that
any later stage (validation, planning, execution, loading) can point back at the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Span:
    """A region of a script: 1-based line/column of its start and end (end exclusive)."""

    file: str | None
    line: int
    column: int
    end_line: int
    end_column: int

    def location(self) -> str:
        return f"{self.file or '<script>'}:{self.line}:{self.column}"

    def excerpt(self, source: str) -> list[str]:
        """The span's first line, indented, with carets under the spanned text."""
        lines = source_lines(source)
        if not 1 <= self.line <= len(lines):
            return []
        # One column per character, as the parser counts them: a tab or a stray \r is one space.
        # Control characters (a terminal escape in a shared script) are shown as `?`.
        text = lines[self.line - 1].expandtabs(1).translate(_BLANKS)
        end = self.end_column if self.end_line == self.line else len(text) + 1
        column = self.column
        if len(text) > _EXCERPT_WIDTH:  # a long line: the part around the span
            start = max(0, min(column - 1 - _EXCERPT_WIDTH // 4, len(text) - _EXCERPT_WIDTH))
            text = ("..." if start else "") + text[start : start + _EXCERPT_WIDTH] + (
                "..." if start + _EXCERPT_WIDTH < len(text) else "")
            shift = start - (3 if start else 0)
            column, end = column - shift, min(end - shift, len(text) + 1)
        width = max(1, end - column)
        gutter = f"{self.line:>4} | "
        return [gutter + text, " " * len(gutter) + " " * (column - 1) + "^" * width]

    def to_json(self) -> list[int]:
        return [self.line, self.column, self.end_line, self.end_column]


_BLANKS = {ord(c): " " for c in "\r\f\v"} | {c: "?" for c in (*range(32), 127) if chr(c) not in "\t\r\f\v"}
#: Characters of a long line shown around a span in an error.
_EXCERPT_WIDTH = 160


def source_lines(source: str) -> list[str]:
    """The lines of a script as the parser counts them: split at ``\\n`` only (a ``\\r`` before it is
    dropped).  ``str.splitlines`` also splits at a lone ``\\r``, form feeds and other separators
    that the grammar treats as spaces, which would put carets on the wrong line."""
    lines = [line.removesuffix("\r") for line in source.split("\n")]
    if len(lines) > 1 and lines[-1] == "":
        lines.pop()
    return lines


@dataclass(frozen=True)
class Selector:
    """One pattern naming modules; see spec.md "Selectors" for the matching rules.

    ``kind`` is one of ``class`` (capitalised glob over class names, base classes
    included), ``path`` (dotted glob over module paths, segment by segment), ``word``
    (lowercase name: path segment tokens or class-name tokens) or ``regex`` (``re:``).
    """

    text: str
    kind: str
    pattern: str
    span: Span | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Option:
    """``name=value`` as written; ``value`` is already typed (bool, int, float or str)."""

    name: str
    value: Any
    span: Span | None = field(default=None, compare=False)
    value_span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Argument:
    """A statement's quoted argument as written, unquoted (``lora "loras/style.safetensors"``: a path)."""

    text: str
    span: Span | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Statement:
    """One statement: ``verb [mode] [target] ["argument"] [in scope] [except exclusions] [options]``."""

    verb: str
    mode: str | None
    target: tuple[Selector, ...]
    scope: tuple[Selector, ...]
    exclude: tuple[Selector, ...]
    options: tuple[Option, ...]
    span: Span | None = field(default=None, compare=False)
    verb_span: Span | None = field(default=None, compare=False)
    mode_span: Span | None = field(default=None, compare=False)
    #: The quoted argument (``lora "PATH"``), for the verbs that take one (``Transform.argument``).
    argument: Argument | None = None

    @property
    def key(self) -> str:
        """``verb mode`` (or ``verb``): the registry key of the transform."""
        return f"{self.verb} {self.mode}" if self.mode else self.verb

    @property
    def line(self) -> int:
        return self.span.line if self.span else 0

    def option(self, name: str, default: Any = None) -> Any:
        for opt in self.options:
            if opt.name == name:
                return opt.value
        return default

    def label(self) -> str:
        """``line N: verb mode`` for messages."""
        return f"line {self.line}: {self.key}" if self.span else self.key


@dataclass(frozen=True)
class Script:
    """A parsed script: its statements in source order, and the text they came from."""

    statements: tuple[Statement, ...]
    source: str = field(default="", compare=False)
    filename: str | None = field(default=None, compare=False)

    def __iter__(self):
        return iter(self.statements)

    def __len__(self) -> int:
        return len(self.statements)
