"""The grammar (spec.md "Grammar"): text -> typed statements with positions; syntax errors.

Statements are compared field by field as plain data (``shape``): verb, mode, each selector's
text and kind, and each option's value *with its type* (``False`` and ``0`` are different values).
Syntax errors are compared the way sqlglot's tests compare them: line, column, end column and
message exactly, and the rendered caret where it matters.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformdsl import parse
from transformdsl.errors import ScriptError
from transformdsl.ir import Span, source_lines
from transformdsl.parser import MAX_SCRIPT_CHARS

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def shape(statement) -> dict:
    """A statement as plain, comparable data (no spans)."""
    def selectors(items):
        return [(s.text, s.kind) if s.kind != "regex" else (s.text, s.kind, s.pattern) for s in items]

    return {
        "verb": statement.verb,
        "mode": statement.mode,
        "target": selectors(statement.target),
        "scope": selectors(statement.scope),
        "exclude": selectors(statement.exclude),
        "options": {o.name: (type(o.value).__name__, o.value) for o in statement.options},
    }


def stmt(verb, mode=None, /, *, target=(), scope=(), exclude=(), **options) -> dict:
    """The expected :func:`shape` of a statement; options are written as Python values."""
    return {
        "verb": verb,
        "mode": mode,
        "target": list(target),
        "scope": list(scope),
        "exclude": list(exclude),
        "options": {k: (type(v).__name__, v) for k, v in options.items()},
    }


CLASS, PATH, WORD, NAME, REGEX = "class", "path", "word", "name", "regex"

# --------------------------------------------------------------------------- statements

SCRIPTS = {
    "fuse qkv in *Attention; quantize int8 except norm; fp8 native Linear; compile fullgraph=false": [
        stmt("fuse", "qkv", scope=[("*Attention", CLASS)]),
        stmt("quantize", "int8", exclude=[("norm", WORD)]),
        stmt("fp8", "native", target=[("Linear", CLASS)]),
        stmt("compile", fullgraph=False),
    ],
    "fuse qkv in *Attention except attn2": [
        stmt("fuse", "qkv", scope=[("*Attention", CLASS)], exclude=[("attn2", WORD)]),
    ],
    "quantize int8 in transformer_blocks.* except *norm*, proj_out": [
        stmt("quantize", "int8", scope=[("transformer_blocks.*", PATH)],
             exclude=[("*norm*", NAME), ("proj_out", WORD)]),
    ],
    "quantize nf4 compute=bfloat16": [
        stmt("quantize", "nf4", compute="bfloat16"),
    ],
    "quantize hqq bits=4 group_size=64 except re:.*norm.*, lm_head": [
        stmt("quantize", "hqq", exclude=[("re:.*norm.*", REGEX, ".*norm.*"), ("lm_head", WORD)],
             bits=4, group_size=64),
    ],
    "fp8 storage compute=bfloat16 except norm, pos_embed": [
        stmt("fp8", "storage", exclude=[("norm", WORD), ("pos_embed", WORD)], compute="bfloat16"),
    ],
    "fp8 native Linear in transformer_blocks.*": [
        stmt("fp8", "native", target=[("Linear", CLASS)], scope=[("transformer_blocks.*", PATH)]),
    ],
    "fuse bias_act_dropout in *FeedForward": [
        stmt("fuse", "bias_act_dropout", scope=[("*FeedForward", CLASS)]),
    ],
    "compile fullgraph=false mode=max-autotune-no-cudagraphs": [
        stmt("compile", fullgraph=False, mode="max-autotune-no-cudagraphs"),
    ],
    "compile regional in *TransformerBlock fullgraph=true": [
        stmt("compile", "regional", scope=[("*TransformerBlock", CLASS)], fullgraph=True),
    ],
}


@pytest.mark.parametrize("text", list(SCRIPTS))
def test_statements(text):
    assert [shape(s) for s in parse(text)] == SCRIPTS[text]


SYNTAX = {
    # Separators, comments and blank lines.
    "# a comment only\n\n": [],
    "": [],
    ";;\n;": [],
    "fuse qkv # to the end of the line; quantize int8 is commented out": [stmt("fuse", "qkv")],
    "fuse qkv\n\n\nquantize int8": [stmt("fuse", "qkv"), stmt("quantize", "int8")],
    "fuse qkv;;; quantize int8;": [stmt("fuse", "qkv"), stmt("quantize", "int8")],
    "fuse qkv\r\nquantize int8 except norm\r\n": [stmt("fuse", "qkv"), stmt("quantize", "int8", exclude=[("norm", WORD)])],
    "fuse\tqkv\tin\t*Attention": [stmt("fuse", "qkv", scope=[("*Attention", CLASS)])],
    # Clauses in any order after the target.
    "fp8 native Linear compute=float16 except norm in transformer_blocks.*": [
        stmt("fp8", "native", target=[("Linear", CLASS)], scope=[("transformer_blocks.*", PATH)],
             exclude=[("norm", WORD)], compute="float16"),
    ],
    "quantize int8 except norm except lm_head": [stmt("quantize", "int8", exclude=[("norm", WORD), ("lm_head", WORD)])],
    # Several targets, separated by commas (line breaks are statement separators).
    "fp8 native Linear, Conv1D": [stmt("fp8", "native", target=[("Linear", CLASS), ("Conv1D", CLASS)])],
    "fp8 native Linear , Conv1D": [stmt("fp8", "native", target=[("Linear", CLASS), ("Conv1D", CLASS)])],
    # The word after the verb is the mode only when it is a plain lowercase identifier.
    "compile *TransformerBlock": [stmt("compile", target=[("*TransformerBlock", CLASS)])],
    "compile transformer_blocks.0": [stmt("compile", target=[("transformer_blocks.0", PATH)])],
    "compile": [stmt("compile")],
    # Option values are typed: bool, int, float, anything else a string; quotes make a string.
    "quantize int8 threshold=6": [stmt("quantize", "int8", threshold=6)],
    "quantize int8 threshold=6.0": [stmt("quantize", "int8", threshold=6.0)],
    "x y a=true b=false c=64 d=-1 e=0.5 f=1e-3 g=.5 h=bfloat16 i=max-autotune": [
        stmt("x", "y", a=True, b=False, c=64, d=-1, e=0.5, f=1e-3, g=0.5, h="bfloat16", i="max-autotune"),
    ],
    'compile fullgraph="true" mode=\'max-autotune\'': [stmt("compile", fullgraph="true", mode="max-autotune")],
    'x y a="with space, comma; semicolon # hash" b="esc\\"aped"': [
        stmt("x", "y", a="with space, comma; semicolon # hash", b='esc"aped'),
    ],
    "quantize hqq bits = 4": [stmt("quantize", "hqq", bits=4)],
    # Selector forms (spec.md "Selectors").
    "x y in a.*.b, down_blocks.**, Conv?d, to_?, *norm*, [ab]c, attn2, re:^proj_out$": [
        stmt("x", "y", scope=[("a.*.b", PATH), ("down_blocks.**", PATH), ("Conv?d", CLASS), ("to_?", NAME),
                              ("*norm*", NAME), ("[ab]c", NAME), ("attn2", WORD),
                              ("re:^proj_out$", REGEX, "^proj_out$")]),
    ],
    'quantize int8 except re:"a{1,2}", re:"x y"': [
        stmt("quantize", "int8", exclude=[('re:"a{1,2}"', REGEX, "a{1,2}"), ('re:"x y"', REGEX, "x y")]),
    ],
    "quantize int8 except re:a|b": [stmt("quantize", "int8", exclude=[("re:a|b", REGEX, "a|b")])],
}


@pytest.mark.parametrize("text", list(SYNTAX))
def test_syntax(text):
    assert [shape(s) for s in parse(text)] == SYNTAX[text]


# --------------------------------------------------------------------------- positions


def test_spans_of_every_node():
    text = "fuse qkv in *Attention\n  quantize hqq bits=4 except norm, lm_head # c\n\ncompile fullgraph=false"
    fuse, quantize, compile_ = parse(text, filename="s.tfm")

    assert fuse.span == Span("s.tfm", 1, 1, 1, 23)
    assert fuse.verb_span == Span("s.tfm", 1, 1, 1, 5)
    assert fuse.mode_span == Span("s.tfm", 1, 6, 1, 9)
    assert fuse.scope[0].span == Span("s.tfm", 1, 13, 1, 23)

    assert quantize.span == Span("s.tfm", 2, 3, 2, 43)
    assert quantize.verb_span == Span("s.tfm", 2, 3, 2, 11)
    assert quantize.mode_span == Span("s.tfm", 2, 12, 2, 15)
    (bits,) = quantize.options
    assert bits.span == Span("s.tfm", 2, 16, 2, 22)
    assert bits.value_span == Span("s.tfm", 2, 21, 2, 22)
    assert [s.span for s in quantize.exclude] == [Span("s.tfm", 2, 30, 2, 34), Span("s.tfm", 2, 36, 2, 43)]

    assert compile_.span == Span("s.tfm", 4, 1, 4, 24)
    assert compile_.mode_span is None
    assert compile_.line == 4


def test_spans_with_crlf_and_semicolons():
    text = "# header\r\nfuse qkv in *Attention # trailing\r\n\r\n;;quantize int8 except norm\r\n"
    fuse, quantize = parse(text)
    assert fuse.span == Span(None, 2, 1, 2, 23)
    assert quantize.span == Span(None, 4, 3, 4, 28)
    assert quantize.exclude[0].span == Span(None, 4, 24, 4, 28)


def test_statements_on_one_line_have_their_own_columns():
    spans = [s.span for s in parse("fuse qkv; quantize int8;compile")]
    assert spans == [Span(None, 1, 1, 1, 9), Span(None, 1, 11, 1, 24), Span(None, 1, 25, 1, 32)]


def test_script_keeps_source_and_filename():
    text = "fuse qkv\n"
    script = parse(text, filename="a.tfm")
    assert (script.source, script.filename, len(script)) == (text, "a.tfm", 1)
    assert script.statements[0].key == "fuse qkv"
    assert script.statements[0].label() == "line 1: fuse qkv"


def test_parse_takes_text_only():
    with pytest.raises(TypeError, match="script text"):
        parse(b"fuse qkv")


# --------------------------------------------------------------------------- syntax errors

# text -> (line, column, end_line, end_column, message)
ERRORS = {
    'quantize int8 except "norm': (1, 22, 1, 23, "unterminated string"),
    "quantize hqq compute='bfloat16": (1, 22, 1, 23, "unterminated string"),
    "fuse qkv in": (1, 12, 1, 13, "expected a selector after 'in', found end of script"),
    "fuse qkv in ; quantize int8": (1, 13, 1, 14, "expected a selector after 'in', found end of statement"),
    "fuse qkv in\nquantize int8": (1, 12, 2, 1, "expected a selector after 'in', found end of statement"),
    "quantize int8 except": (1, 21, 1, 22, "expected a selector after 'except', found end of script"),
    "quantize int8 except norm,": (1, 27, 1, 28, "expected a selector after ',', found end of script"),
    "quantize int8 except norm, ; compile": (1, 28, 1, 29, "expected a selector after ',', found end of statement"),
    "fuse qkv in *Attention, , x": (1, 25, 1, 26, "expected a selector after ',', found ','"),
    "quantize hqq bits=": (1, 19, 1, 20, "expected a value after 'bits='"),
    "quantize hqq bits=; compile": (1, 19, 1, 20, "expected a value after 'bits='"),
    "quantize hqq bits=, group_size=64": (1, 19, 1, 20, "expected a value after 'bits='"),
    "quantize hqq bits= group_size=64": (1, 20, 1, 30, "expected a value after 'bits='"),
    "quantize int8 except norm @": (1, 27, 1, 28, "unexpected '@'; options are written name=value"),
    "fuse {qkv}": (1, 6, 1, 11, "unexpected '{qkv}'; options are written name=value"),
    "quantize hqq bits=4,": (1, 20, 1, 21, "unexpected ','; expected 'except', 'in', an option (name=value), "
                                        "end of statement"),
    "quantize hqq bits=4=8": (1, 20, 1, 21, "'=' must directly follow an option name (name=value)"),
    "fp8 native Linear Conv1D": (1, 19, 1, 25, "two target selectors without a comma: 'Linear' 'Conv1D'"),
    "quantize int8 in a..b": (1, 18, 1, 22, "empty path segment in 'a..b'"),
    'quantize int8 except re:""': (1, 22, 1, 27, "empty regular expression after 're:'"),
}


@pytest.mark.parametrize("text", list(ERRORS))
def test_syntax_error_fields(text):
    line, column, end_line, end_column, message = ERRORS[text]
    with pytest.raises(ScriptError) as info:
        parse(text, filename="s.tfm")
    error = info.value
    assert (error.line, error.column, error.message) == (line, column, message)
    assert len(error.problems) == 1
    span = error.problems[0].span
    assert span == Span("s.tfm", line, column, end_line, end_column)


@pytest.mark.parametrize("text, pattern", [
    ("quantize int8 except re:(abc", "(abc"),
    ('quantize int8 except re:"(a b"', "(a b"),
    ("quantize int8 in re:[z-a]", "[z-a]"),
])
def test_bad_regex(text, pattern):
    with pytest.raises(ScriptError) as info:
        parse(text)
    error = info.value
    assert (error.line, error.column) == (1, text.index("re:") + 1)
    assert error.problems[0].span.end_column == len(text) + 1
    assert re.fullmatch(rf"invalid regular expression {re.escape(repr(pattern))}: .+", error.message)


@pytest.mark.parametrize("text, rendered", [
    ('quantize int8 except "norm', [
        "s.tfm:1:22: unterminated string",
        "   1 | quantize int8 except \"norm",
        "                            ^",
    ]),
    ("fuse qkv in *Attention\n  quantize int8 except", [
        "s.tfm:2:23: expected a selector after 'except', found end of script",
        "   2 |   quantize int8 except",
        "                             ^",
    ]),
    ("quantize hqq bits=", [
        "s.tfm:1:19: expected a value after 'bits='",
        "   1 | quantize hqq bits=",
        "                         ^",
    ]),
    ("fp8 native Linear Conv1D", [
        "s.tfm:1:19: two target selectors without a comma: 'Linear' 'Conv1D'",
        "   1 | fp8 native Linear Conv1D",
        "                         ^^^^^^",
        "  hint: write 'Linear, Conv1D'",
    ]),
    ("quantize int8 except re:(abc", [
        "s.tfm:1:22: invalid regular expression '(abc': missing ) at position 4",
        "   1 | quantize int8 except re:(abc",
        "                            ^^^^^^^",
    ]),
])
def test_syntax_error_rendering(text, rendered):
    with pytest.raises(ScriptError) as info:
        parse(text, filename="s.tfm")
    assert str(info.value).splitlines() == rendered
    assert info.value.diagnostics() == [rendered[0]]


def test_two_malformed_selectors_are_reported_together():
    with pytest.raises(ScriptError) as info:
        parse("quantize int8 except re:(a\nfuse qkv in a..b")
    assert [(p.span.line, p.span.column) for p in info.value.problems] == [(1, 22), (2, 13)]


def test_script_too_long():
    text = "#" * MAX_SCRIPT_CHARS + "\nfuse qkv"
    with pytest.raises(ScriptError) as info:
        parse(text, filename="big.tfm")
    error = info.value
    assert (error.line, error.column, error.filename) == (1, 1, "big.tfm")
    assert error.message == f"script is {len(text)} characters; the limit is {MAX_SCRIPT_CHARS}"


def test_script_at_the_limit_parses():
    text = "fuse qkv\n" + "#" * (MAX_SCRIPT_CHARS - len("fuse qkv\n"))
    assert len(parse(text)) == 1


# --------------------------------------------------------------------------- any text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("fuse qkv in *Attention except norm re:\"' ,;=#\n\r\t.x1@{")), max_size=60))
def test_any_text_parses_or_raises_a_located_script_error(text):
    lines = source_lines(text)
    try:
        script = parse(text)
    except ScriptError as error:
        assert 1 <= error.line <= len(lines) + 1
        assert error.column >= 1
        assert str(error)
        return
    for statement in script:
        span = statement.span
        assert 1 <= span.line <= span.end_line <= len(lines)
        assert lines[span.line - 1][span.column - 1:].startswith(statement.verb)


@pytest.mark.parametrize("text, line, rendered", [
    # Lines are counted at \n only, as the parser counts them: a form feed or a lone \r is a space.
    ("fuse qkv\f\nquantize int8 except", 2, "   2 | quantize int8 except"),
    ("fuse qkv\rquantize int8 in", 1, "   1 | fuse qkv quantize int8 in"),
])
def test_carets_land_on_the_line_the_parser_counted(text, line, rendered):
    with pytest.raises(ScriptError) as info:
        parse(text)
    assert info.value.line == line
    assert str(info.value).splitlines()[1] == rendered


# --------------------------------------------------------------------------- the shipped LALR tables


def test_shipped_parser_tables_are_current_and_used(monkeypatch):
    """``check`` starts from the tables generated from this grammar, not from building the parser."""
    from lark import Lark
    from lark.exceptions import UnexpectedInput

    from transformdsl import parser

    assert parser.tables_are_current(), "run `python -m transformdsl.parser --write`"

    class Counting(Lark):
        built = 0

        def __init__(self, *args, **kwargs):
            Counting.built += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(parser, "Lark", Counting)
    parser._parser.cache_clear()
    try:
        loaded = parser._parser()
        assert Counting.built == 0
        built = Lark(parser._grammar_text(), **parser._LARK_OPTIONS)
        texts = [p.read_text() for p in sorted(EXAMPLES.glob("*.tfm"))]
        texts += ["quantize int8 in re:\"blocks\\.[0-9]+\" except norm a='x;y'", ";;\n# only a comment\n"]
        for text in texts:
            assert loaded.parse(text) == built.parse(text)
        for bad in ["quantize int8 except", "fuse qkv in a,,b", "quantize x=", "fp8 'x' 'y'", "a\n= b"]:
            problems = []
            for one in (loaded, built):
                with pytest.raises(UnexpectedInput) as error:
                    one.parse(bad)
                problem = parser._syntax_problem(error.value, bad, None)  # lark's own text lists a set: any order
                problems.append((problem.message, problem.spans, set(getattr(error.value, "expected", ()))))
            assert problems[0] == problems[1]
    finally:
        parser._parser.cache_clear()


def test_a_changed_grammar_is_never_served_stale_tables(monkeypatch):
    """The tables are keyed by the grammar's hash: edit the grammar and the parser is built from it."""
    from transformdsl import parser

    original = parser._grammar_text()
    monkeypatch.setattr(parser, "_grammar_text", lambda: original.replace('"except" selectors', '"besides" selectors'))
    parser._parser.cache_clear()
    try:
        assert not parser.tables_are_current()
        assert [s.text for s in parse("quantize int8 besides norm").statements[0].exclude] == ["norm"]
        with pytest.raises(ScriptError):
            parse("quantize int8 except norm")
    finally:
        parser._parser.cache_clear()
    monkeypatch.undo()
    assert parser.tables_are_current()
    assert [s.text for s in parse("quantize int8 except norm").statements[0].exclude] == ["norm"]


def test_a_backslash_escapes_only_a_quote_or_a_backslash():
    """Quoted values keep a regex's backslashes (`\\d`, `\\.`): dropping them changed what a cache's
    identifiers matched without a word."""
    from transformdsl import parse
    from transformdsl.formatter import format_script

    text = r'cache taylorseer cache_identifiers="blocks\.\d+\.attn|a\"b\\c"'
    (option,) = parse(text).statements[0].options
    assert option.value == 'blocks\\.\\d+\\.attn|a"b\\c'
    assert parse(format_script(parse(text))).statements[0].options[0].value == option.value
