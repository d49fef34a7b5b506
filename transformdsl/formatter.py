"""The canonical text of a script: what ``transformdsl fmt`` writes.

>>> from transformdsl.formatter import format_script
>>> print(format_script("quantize int8 except norm,proj_out;fuse qkv in *Attention # fast\\n"), end="")
quantize int8 except norm, proj_out
fuse qkv in *Attention  # fast

The canonical form:

- one statement per line, in source order (not execution order: the order is the
  author's, and the validator decides the execution order anyway);
- each statement written ``verb [mode] [target, ...] ["argument"] [in scope, ...] [except selector, ...]
  [name=value ...]``: clauses in that order, several ``in`` (or ``except``) clauses merged
  into one, selectors separated by ``", "``, options in the order written;
- values written so that they parse back to the same type: ``true``/``false``, integers,
  floats as Python's ``repr`` (``0.5``, ``1e-05``), strings bare when they would read back
  as the same string (``max-autotune``, ``bfloat16``) and double-quoted otherwise
  (``""``, ``"64"``, ``"true"``, ``"a b"``);
- **comments are kept**: a comment on a line of its own stays on a line of its own before
  what follows it; a comment after a statement stays at the end of that statement's line
  (after the last statement, when ``;`` put several on one line), two spaces before the
  ``#``; comment text is kept as written (trailing blanks removed);
- a run of blank lines becomes one blank line; none at the start or end.  The text ends
  with a newline unless the script is empty.

``parse(format_script(parse(x))) == parse(x)`` for every script ``x`` that parses, and
formatting is idempotent: both are property-tested in ``tests/test_fuzz_language.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from .ir import Option, Script, Selector, Statement
from .parser import KEYWORDS, parse, typed_value

# The grammar's terminals (grammar/transformdsl.lark), used to check that what is written
# reads back as one token of the same kind.
_WORD_RE = re.compile(r're:"(?:[^"\\\n]|\\.)*"|re:[^\s,;#]+|[A-Za-z0-9_*?.\[\]!\-]+')
_VALUE_RE = re.compile(r"""[^\s,;#="']+""")
_OPTION_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODE_RE = re.compile(r"[a-z][a-z0-9_]*")


def format_script(script: Script | str, *, comments: bool = True) -> str:
    """The canonical text of ``script`` (a parsed :class:`Script` or script text).

    Comments come from ``script.source`` (kept unless ``comments=False``); a script built
    in code without source text has none.  Raises :class:`~transformdsl.ScriptError` if
    text does not parse, and ``ValueError`` for a hand-built script that no text can
    express (a value with a line break, a selector that is not one word...).
    """
    if isinstance(script, str):
        script = parse(script)
    if not comments or not script.source or any(s.span is None for s in script.statements):
        lines = [format_statement(s) for s in script.statements]
        return "".join(line + "\n" for line in lines)
    return _layout(script)


def format_statement(statement: Statement) -> str:
    """One statement in canonical form (no comment, no newline)."""
    parts = [_word(statement.verb, "verb")]
    if statement.mode is not None:
        if not _MODE_RE.fullmatch(statement.mode):
            raise ValueError(f"mode {statement.mode!r} cannot be written in a script")
        parts.append(statement.mode)
    elif statement.target and _MODE_RE.fullmatch(statement.target[0].text):
        # Without a mode, a lowercase first target would read back as the mode.
        raise ValueError(f"target {statement.target[0].text!r} would read back as a mode")
    if statement.target:
        parts.append(_selectors(statement.target))
    if statement.argument is not None:
        parts.append(_quoted(statement.argument.text, "argument"))
    if statement.scope:
        parts.append("in " + _selectors(statement.scope))
    if statement.exclude:
        parts.append("except " + _selectors(statement.exclude))
    parts.extend(_option(o) for o in statement.options)
    return " ".join(parts)


def format_value(value: object) -> str:
    """An option value as script text that reads back as the same value and type.

    >>> [format_value(v) for v in (True, 64, 0.5, "bfloat16", "64", "", 'say "hi"')]
    ['true', '64', '0.5', 'bfloat16', '"64"', '""', '"say \\\\"hi\\\\""']
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} cannot be written in a script")
        return repr(value)
    if isinstance(value, str):
        if "\n" in value:
            raise ValueError(f"a value with a line break cannot be written in a script: {value!r}")
        bare = _VALUE_RE.fullmatch(value) is not None and typed_value(value) == value
        if bare and isinstance(typed_value(value), str):
            return value
        return _quoted(value, "value")
    raise ValueError(f"a {type(value).__name__} cannot be written in a script")


# --------------------------------------------------------------------------- pieces


def _quoted(text: str, what: str) -> str:
    if "\n" in text:
        raise ValueError(f"a{'n' if what[0] in 'aeiou' else ''} {what} with a line break cannot be written in a "
                         f"script: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _word(text: str, what: str) -> str:
    # A verb may be spelled `in` (the keyword cannot start a statement); a selector may not.
    if not _WORD_RE.fullmatch(text) or (what != "verb" and text in KEYWORDS):
        raise ValueError(f"{what} {text!r} cannot be written as one word of a script")
    return text


def _selectors(selectors: Iterable[Selector]) -> str:
    return ", ".join(_word(s.text, "selector") for s in selectors)


def _option(option: Option) -> str:
    if not _OPTION_NAME_RE.fullmatch(option.name):
        raise ValueError(f"option name {option.name!r} cannot be written in a script")
    return f"{option.name}={format_value(option.value)}"


# --------------------------------------------------------------------------- layout with comments


def _layout(script: Script) -> str:
    """Statements one per line, with the source's comments and (collapsed) blank lines."""
    lines = script.source.split("\n")  # the parser's lines: split at "\n" only
    by_line: dict[int, list[Statement]] = {}
    for statement in script.statements:
        by_line.setdefault(statement.span.line, []).append(statement)
    out: list[str] = []
    last_content = None  # source line number of the last line that produced output
    for number, text in enumerate(lines, 1):
        statements = by_line.get(number, [])
        comment = _comment(text, statements)
        if not statements and comment is None:
            continue
        if out and last_content is not None and number - last_content > 1:
            out.append("")  # one blank line stands for any run of them
        last_content = number
        out.extend(format_statement(s) for s in statements)
        if comment is not None:
            if statements:
                out[-1] += "  " + comment
            else:
                out.append(comment)
    return "".join(line + "\n" for line in out)


def _comment(text: str, statements: list[Statement]) -> str | None:
    """The comment on one source line, if any.

    After the last statement on a line there can only be blanks, ``;`` and a comment,
    so the first ``#`` there starts it (a ``#`` inside a quoted value or ``re:"..."``
    selector is within a statement's span and is not searched).
    """
    start = max((s.span.end_column - 1 for s in statements if s.span.end_line == s.span.line), default=0)
    at = text.find("#", start)
    return text[at:].rstrip() if at >= 0 else None


__all__ = ["format_script", "format_statement", "format_value"]
