"""Text → :class:`~transformdsl.ir.Script`, with positions on every node.

The grammar lives in ``grammar/transformdsl.lark`` (shipped inside the package as
``transformdsl/transformdsl.lark``).  Parsing is registry-independent: it only decides
the shape of each statement.  Whether a verb, mode or option exists is the
validator's business (:mod:`transformdsl.validate`).
"""

from __future__ import annotations

import errno
import functools
import io
import math
import os
import re
import stat
from importlib import resources
from pathlib import Path

import lark
import regex
from lark import Lark, Token, Tree

from .errors import Problem, ScriptError
from .ir import Argument, Option, Script, Selector, Span, Statement
from .regexes import compile_regex

#: Scripts longer than this are refused before parsing (no unbounded work on hostile input).
MAX_SCRIPT_CHARS = 256 * 1024

#: Statements (not comments, see :func:`_pieces`) a script may hold: real scripts
#: have a few dozen; 32k one-word statements (256 KiB) took seconds to check, and each
#: statement is planned against every module of the model.
MAX_STATEMENTS = 256
#: Selectors and options a script may hold, counted (over-counted) as its commas and ``=``.
MAX_LIST_ITEMS = 256
_PIECE_RE = re.compile(r"[^\s;]+[^;\n]*")
#: A script's tokens as far as comments go: a quoted string (to its closing quote or the end of
#: its line, so that no match ever backtracks), a comment, or a run of anything else.
_COMMENT_SCAN_RE = re.compile(r""""(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?|#[^\n]*|[^"'#]+""")

_MODE_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
_IDENT_RE = re.compile(r"[a-z0-9_]+\Z")
_GLOB_CHARS = set("*?[")
#: Words that start a clause; never selectors.
KEYWORDS = ("in", "except")


def _grammar_text() -> str:
    # Development checkouts read grammar/ at the repository root; installed
    # packages carry a copy (see pyproject.toml's package data).
    repo = Path(__file__).resolve().parent.parent / "grammar" / "transformdsl.lark"
    if repo.is_file():
        return repo.read_text()
    return resources.files(__package__).joinpath("transformdsl.lark").read_text()


#: How the parser is built from the grammar (the shipped tables record the same options).
_LARK_OPTIONS = dict(parser="lalr", propagate_positions=True, maybe_placeholders=False)
#: The generated module holding the parser's LALR tables, beside this one.
TABLES_PATH = Path(__file__).with_name("parser_tables.py")


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    """The LALR parser: from the shipped tables when they were generated from this very grammar
    by this version of lark, else built from the grammar (a third of ``check``'s own time).

    Why shipped tables and not lark's ``cache=True``: lark's cache is a pickle in the shared
    temporary directory, unpickled on the next run, so any user of the machine who plants that
    file runs code in ours.  The tables are instead generated at development time
    (``python -m transformdsl.parser --write``) as a module of plain literals inside the package,
    trusted exactly as its code is, and used only when their recorded grammar hash and lark
    version match: an edited grammar or another lark never gets a stale parser, only a slower start.
    """
    if tables_are_current():
        from . import parser_tables as tables

        return Lark.load({"data": tables.DATA, "memo": tables.MEMO})
    return Lark(_grammar_text(), **_LARK_OPTIONS)


def _grammar_digest(grammar: str) -> str:
    import hashlib

    options = ",".join(f"{k}={v}" for k, v in sorted(_LARK_OPTIONS.items()))
    return hashlib.sha256(f"{options}\n{grammar}".encode()).hexdigest()


def tables_source() -> str:
    """The text of ``parser_tables.py`` for the current grammar and lark (see :func:`_parser`)."""
    import pprint

    grammar = _grammar_text()
    data, memo = Lark(grammar, **_LARK_OPTIONS).memo_serialize([lark.lexer.TerminalDef, lark.grammar.Rule])
    return "\n".join([
        '"""The LALR tables of the script grammar, serialized by lark: generated, do not edit.',
        "",
        "    python -m transformdsl.parser --write      # after changing grammar/transformdsl.lark",
        "",
        "Used by :func:`transformdsl.parser._parser` only while ``GRAMMAR_SHA256`` and ``LARK_VERSION``",
        'match the grammar and the lark installed; plain literals, nothing here runs code."""',
        "",
        f"GRAMMAR_SHA256 = {_grammar_digest(grammar)!r}",
        f"LARK_VERSION = {lark.__version__!r}",
        f"DATA = {pprint.pformat(data, width=120, sort_dicts=False)}",
        f"MEMO = {pprint.pformat(memo, width=120, sort_dicts=False)}",
        "",
    ])


def parse(text: str, filename: str | None = None) -> Script:
    """Parse script text into a :class:`Script`.

    Raises :class:`ScriptError` (with ``line``/``column``) for syntax errors and for
    malformed selectors or values.  Nothing about verbs, modes or options is checked
    here: :func:`transformdsl.validate.validate` does that.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse() takes script text (str), not {type(text).__name__}")
    # A UTF-8 byte-order mark (some Windows editors write one) is not part of the script.
    text = text.removeprefix("\ufeff")
    if len(text) > MAX_SCRIPT_CHARS:
        span = Span(filename, 1, 1, 1, 2)
        raise ScriptError([Problem(f"script is {len(text)} characters; the limit is {MAX_SCRIPT_CHARS}", [span])], text)
    _check_counts(text, filename)
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as exc:
        raise ScriptError([_syntax_problem(exc, text, filename)], text) from None
    builder = _Builder(filename, text)
    statements = tuple(builder.statement(node) for node in tree.children if isinstance(node, Tree))
    if builder.problems:
        raise ScriptError(builder.problems, text)
    return Script(statements, source=text, filename=filename)


def _check_counts(text: str, filename: str | None) -> None:
    """Refuse, before parsing, scripts with more statements, selectors or options than
    :data:`MAX_STATEMENTS` / :data:`MAX_LIST_ITEMS` (planning cost grows with each)."""
    pieces = _code_pieces(text)
    code = "".join(pieces)
    # A comma inside a quoted value (a cache's mag_ratios="1.0,0.98,...") separates no selectors:
    # that value is one string, bounded by the script's length.
    commas = sum(piece.count(",") for piece in pieces if piece[:1] not in "\"'")
    counts = (("statements", _pieces(code), MAX_STATEMENTS),
              ("commas (selectors)", commas, MAX_LIST_ITEMS),
              ("'=' signs (options)", code.count("="), MAX_LIST_ITEMS))
    for what, count, limit in counts:
        if count > limit:
            span = Span(filename, 1, 1, 1, 2)
            raise ScriptError([Problem(f"script has {count} {what}; the limit is {limit} (checking and planning "
                                       "cost grows with each)", [span])], text)


def _code_pieces(text: str) -> list[str]:
    """``text`` without its comments, as the pieces of one linear pass without parsing: quoted strings
    (a ``#`` inside one is not a comment) and the code between them.  Where a quote is left open the
    rest of its line is kept: the counts stay upper bounds."""
    return [piece for piece in _COMMENT_SCAN_RE.findall(text) if not piece.startswith("#")]


def _pieces(text: str) -> int:
    """An upper bound on the statements in ``text`` (comments removed): its non-blank pieces
    between ``;`` and newlines (quoted separators count too), found without parsing."""
    return sum(1 for _ in _PIECE_RE.finditer(text))


def read_script_file(path: str | Path, newline: str | None = None) -> str:
    """A script file's text (UTF-8; ``newline`` as for :func:`open`), checked before reading.

    The file is opened without blocking and must be a regular file (not a FIFO, a device
    such as ``/dev/zero`` or a directory) of at most 4 bytes per allowed character; at
    most that much is read.  Raises ``OSError`` or ``ValueError`` (decoding) otherwise.
    """
    limit = 4 * MAX_SCRIPT_CHARS
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # checked before fdopen, which names a directory by its descriptor
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise OSError(errno.EINVAL, f"{what} (a script is read from a file)", str(path))
    with os.fdopen(fd, "rb") as f:
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes; the limit is {limit}", str(path))
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"over {limit} bytes", str(path))
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", newline=newline).read()


def parse_file(path: str | Path) -> Script:
    path = Path(path)
    try:
        text = read_script_file(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ScriptError([Problem(f"cannot read script: {exc}", [Span(str(path), 1, 1, 1, 2)])]) from None
    return parse(text, filename=str(path))


# --------------------------------------------------------------------------- syntax errors

_TOKEN_NAMES = {
    "WORD": "a selector or word",
    "OPTION_KEY": "an option (name=value)",
    "VALUE": "a value",
    "STRING": "a quoted string",
    "COMMA": "','",
    "IN": "'in'",
    "EXCEPT": "'except'",
    "_SEP": "end of statement",
    "$END": "end of script",
}


#: ``name= other`` right before an unexpected ``=``: ``other`` is the next option's name, not a value.
_MISSING_VALUE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]+([A-Za-z_][A-Za-z0-9_]*)\Z")


def _syntax_problem(exc: lark.exceptions.UnexpectedInput, text: str, filename: str | None) -> Problem:
    line, column = max(exc.line, 1), max(exc.column, 1)
    if isinstance(exc, lark.exceptions.UnexpectedCharacters):
        char = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else ""
        missing = _MISSING_VALUE.search(text, 0, exc.pos_in_stream) if char == "=" else None
        if missing:
            # `bits= group_size=64`: the next option's name was read as the value of `bits=`.
            start = column - (exc.pos_in_stream - missing.start(2))
            return Problem(f"expected a value after '{missing.group(1)}='",
                           [Span(filename, line, start, line, column)])
        if char in "\"'":
            message = "unterminated string"
        elif char == "=":
            message = "'=' must directly follow an option name (name=value)"
        else:
            message = f"unexpected character {char!r}"
        return Problem(message, [Span(filename, line, column, line, column + 1)])

    token = getattr(exc, "token", None)
    expected = set(getattr(exc, "expected", ()) or ())
    if token is None or token.type == "$END":
        # End of input: point just past the last token.  lark's $END token borrows the
        # position of the last real token, so trailing comments and blank space (and
        # characters such as \f that str.splitlines() would count as line breaks) do
        # not move the caret off the script's last line.
        line, column = _end_position(text, token)
        span = Span(filename, line, column, line, column + 1)
        found = "end of script"
    else:
        span = Span(filename, line, column, token.end_line or line, token.end_column or column + 1)
        found = "end of statement" if token.type == "_SEP" else repr(str(token))
    previous = _previous_word(exc, text, token)
    if expected == {"VALUE", "STRING"}:
        message = f"expected a value after '{previous}'"
    elif "WORD" in expected and previous in {"in", "except", ","}:
        message = f"expected a selector after '{previous}', found {found}"
    elif token is not None and token.type in {"IN", "EXCEPT"}:
        message = f"expected a selector after '{previous}', found {found}"
    elif token is not None and token.type in {"VALUE", "STRING"}:
        message = f"unexpected {found}; options are written name=value"
    else:
        names = sorted(_TOKEN_NAMES.get(e, e) for e in expected)
        message = f"unexpected {found}; expected {', '.join(names)}" if names else f"unexpected {found}"
    return Problem(message, [span])


def _end_position(text: str, token: Token | None) -> tuple[int, int]:
    """(line, column) just past the last token of ``text`` (lark counts lines by ``\\n`` only)."""
    if token is not None and token.end_line is not None and token.end_column is not None:
        return token.end_line, token.end_column
    lines = text.split("\n")
    return len(lines), len(lines[-1]) + 1


def _previous_word(exc: lark.exceptions.UnexpectedInput, text: str, token: Token | None) -> str:
    """The text of the token before the unexpected one (``in``, ``,``, ``k=``...).

    Read from the parser's value stack rather than from the text, so that a comment
    between the two tokens (``k= # note``) is not mistaken for the previous word.
    """
    stack = getattr(getattr(exc, "state", None), "value_stack", None)
    if stack:
        last = stack[-1]
        while isinstance(last, Tree) and last.children:
            last = last.children[-1]
        if isinstance(last, Token):
            return "," if last.type == "COMMA" else str(last)
    at_end = token is None or token.type == "$END" or token.start_pos is None
    end = len(text) if at_end else token.start_pos
    head = text[:end].rstrip(" \t")
    if head.endswith(","):
        return ","
    match = re.search(r"([^\s;,]+)$", head)
    return match.group(1) if match else ""


# --------------------------------------------------------------------------- tree → IR


class _Builder:
    def __init__(self, filename: str | None, text: str):
        self.filename = filename
        self.text = text
        self.problems: list[Problem] = []

    def span(self, item) -> Span:
        if isinstance(item, Token):
            return Span(self.filename, item.line, item.column, item.end_line, item.end_column)
        meta = item.meta
        return Span(self.filename, meta.line, meta.column, meta.end_line, meta.end_column)

    def statement(self, node: Tree) -> Statement:
        verb_token, *rest = node.children
        mode = mode_span = None
        target: list[Selector] = []
        scope: list[Selector] = []
        exclude: list[Selector] = []
        options: list[Option] = []
        argument = None
        for child in rest:
            if child.data == "words":
                tokens = list(child.children)
                if _MODE_RE.match(tokens[0]):
                    mode, mode_span = str(tokens[0]), self.span(tokens[0])
                    tokens = tokens[1:]
                target.extend(self.selector(t) for t in tokens)
                self._check_commas(child, mode is not None)
            elif child.data == "argument":
                (token,) = child.children
                argument = Argument(_unquote(str(token)), self.span(token))
            elif child.data == "scope":
                scope.extend(self.selectors(child))
            elif child.data == "exclusion":
                exclude.extend(self.selectors(child))
            elif child.data == "option":
                options.append(self.option(child))
        return Statement(
            verb=str(verb_token),
            mode=mode,
            target=tuple(target),
            scope=tuple(scope),
            exclude=tuple(exclude),
            options=tuple(options),
            span=self.span(node),
            verb_span=self.span(verb_token),
            mode_span=mode_span,
            argument=argument,
        )

    def _check_commas(self, words: Tree, has_mode: bool) -> None:
        # `fp8 native Linear Conv2d` (two targets without a comma) is almost
        # certainly a missing comma, not a mode plus a target.
        tokens = list(words.children)
        head = tokens[1:] if has_mode else tokens
        for first, second in zip(head, head[1:]):
            if "," not in self.text[first.end_pos : second.start_pos]:
                self.problems.append(
                    Problem(
                        f"two target selectors without a comma: '{first}' '{second}'",
                        [self.span(second)],
                        hint=f"write '{first}, {second}'",
                    )
                )
                return

    def selectors(self, node: Tree) -> list[Selector]:
        (group,) = node.children
        return [self.selector(t) for t in group.children]

    def selector(self, token: Token) -> Selector:
        text = str(token)
        span = self.span(token)
        try:
            return make_selector(text, span)
        except ValueError as exc:
            self.problems.append(Problem(str(exc), [span]))
            return Selector(text, "regex", "(?!)", span)

    def option(self, node: Tree) -> Option:
        key_token, value_node = node.children
        name = str(key_token).rstrip(" \t=")
        (value_token,) = value_node.children
        span = Span(self.filename, key_token.line, key_token.column, value_token.end_line, value_token.end_column)
        value_span = self.span(value_token)
        if value_token.type == "STRING":
            value = _unquote(str(value_token))
        else:
            value = typed_value(str(value_token))
        return Option(name, value, span, value_span)


def make_selector(text: str, span: Span | None = None) -> Selector:
    """Classify a selector word (see spec.md "Selectors").  Raises ValueError if malformed."""
    if text in KEYWORDS:
        # The lexer reads `in` as a word where the keyword cannot follow (`fuse qkv, in`),
        # but the same text after a mode (`fuse qkv in`) is the keyword: refuse it as a
        # selector everywhere, so that a script means one thing however it is spaced.
        raise ValueError(f"'{text}' is a keyword, not a selector (a module named '{text}' is re:^{text}$)")
    if text.startswith("re:"):
        pattern = text[3:]
        if pattern.startswith(("'", '"')):
            # `re:"a b` (no closing quote on the line) is lexed as a bare word; without
            # this check unquoting it would silently drop its last character.
            if len(pattern) < 2 or pattern[-1] != pattern[0] or _escaped_end(pattern):
                raise ValueError(f"unterminated quoted regular expression: {_clip(text)}")
            pattern = _unquote(pattern)
        if not pattern:
            raise ValueError("empty regular expression after 're:'")
        try:
            compile_regex(pattern)
        except regex.error as exc:
            raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None
        except (RecursionError, OverflowError) as exc:
            # Deeply nested groups exhaust the regex compiler's recursion, huge
            # repeat counts overflow it: both are malformed input, not crashes.
            raise ValueError(f"regular expression too complex ({type(exc).__name__}): {_clip(pattern)}") from None
        return Selector(text, "regex", pattern, span)
    _check_brackets(text)
    if "." in text:
        segments = text.split(".")
        if any(not s for s in segments):
            raise ValueError(f"empty path segment in {text!r}")
        return Selector(text, "path", text, span)
    first_letter = next((c for c in text if c.isalpha()), "")
    if first_letter.isupper():
        return Selector(text, "class", text, span)
    if _IDENT_RE.match(text):
        return Selector(text, "word", text, span)
    if _GLOB_CHARS & set(text) or text:
        return Selector(text, "name", text, span)
    raise ValueError("empty selector")  # pragma: no cover - grammar forbids it


def _check_brackets(text: str) -> None:
    """Refuse malformed ``[...]`` classes in a glob: empty (``[]``, ``[!]``) or with a
    reversed range (``[z-a]``).  A ``[`` with no closing ``]`` is a literal character."""
    i = 0
    while i < len(text):
        if text[i] != "[":
            i += 1
            continue
        close = text.find("]", i + 1)
        if close == -1:
            return
        body = text[i + 1 : close]
        if body.startswith("!"):
            body = body[1:]
        if not body:
            raise ValueError(f"empty character class {text[i:close + 1]!r} in {text!r}; a class names at least "
                             "one character, e.g. [0-9] or [!0]")
        for low, high in re.findall(r"(.)-(.)", body):
            if low > high:
                raise ValueError(f"reversed range '{low}-{high}' in {text!r}; write it low to high: [{high}-{low}]")
        i = close + 1


def typed_value(text: str):
    """``true``/``false`` → bool, integers → int, decimals → float, anything else → str."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if not text.isascii():
        return text  # Python's int() and float() accept other scripts' digits (`４`); a script does not
    try:
        return int(text, 10)
    except ValueError:
        pass
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
        number = float(text)
        # 1e400 (or an integer too long for int()) overflows to inf, which no script
        # can write back: keep the text, and the option check reports "not a number".
        if math.isfinite(number):
            return number
    return text


def _escaped_end(quoted: str) -> bool:
    """Whether the last character of ``quoted`` is escaped (``"a\\"``: no closing quote)."""
    body = quoted[1:-1]
    return (len(body) - len(body.rstrip("\\"))) % 2 == 1


def _clip(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _unquote(text: str) -> str:
    quote, body = text[0], text[1:-1]
    # Only a backslash before a quote or a backslash escapes; any other stays, so a regex such as
    # "blocks\.\d+" means what it says.
    return re.sub(r"\\([\\\"'])", r"\1", body) if "\\" in body else body if quote else text


def tables_are_current() -> bool:
    """Whether the shipped ``parser_tables.py`` was generated from this grammar by this lark.

    (Its text is not compared: lark numbers the LALR states in set order, which varies between runs.)
    """
    try:
        from . import parser_tables as tables
    except ImportError:
        return False
    return tables.GRAMMAR_SHA256 == _grammar_digest(_grammar_text()) and tables.LARK_VERSION == lark.__version__


def main(argv: list[str] | None = None) -> int:
    """``python -m transformdsl.parser --write``: regenerate ``parser_tables.py``; ``--check``: exit 1 if stale."""
    import argparse

    cli = argparse.ArgumentParser(prog="python -m transformdsl.parser", description=main.__doc__)
    action = cli.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true")
    action.add_argument("--check", action="store_true")
    args = cli.parse_args(argv)
    if args.check:
        if not tables_are_current():
            print(f"{TABLES_PATH} is out of date: run `python -m transformdsl.parser --write`")
            return 1
        return 0
    TABLES_PATH.write_text(tables_source(), encoding="utf-8")
    print(f"wrote {TABLES_PATH}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
