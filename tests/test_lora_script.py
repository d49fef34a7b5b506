"""A statement's quoted argument (``lora "PATH"``): grammar, IR, formatter, validation (spec.md "Grammar")."""

from __future__ import annotations

import pytest

from transformdsl import parse
from transformdsl.errors import ScriptError
from transformdsl.formatter import format_script
from transformdsl.ir import Argument
from transformdsl.validate import check_text


def problems(text: str) -> list[tuple[int, int, str]]:
    try:
        check_text(text)
    except ScriptError as error:
        return [(p.span.line, p.span.column, p.message) for p in error.problems]
    return []


def test_a_quoted_argument_is_parsed_with_its_span():
    (statement,) = parse('lora "loras/style v2.safetensors" scale=0.8 in transformer_blocks.*').statements
    assert statement.argument == Argument("loras/style v2.safetensors")
    span = statement.argument.span
    assert (span.line, span.column, span.end_column) == (1, 6, 34)
    assert statement.target == () and [s.text for s in statement.scope] == ["transformer_blocks.*"]
    assert [(o.name, o.value) for o in statement.options] == [("scale", 0.8)]


@pytest.mark.parametrize("text, argument", [
    ("lora 'a.safetensors'", "a.safetensors"),
    ('lora "a\\"b.safetensors"', 'a"b.safetensors'),
    ("lora 'C:/loras/x y.safetensors'", "C:/loras/x y.safetensors"),
    ('lora "#not a comment;" name=x', "#not a comment;"),
])
def test_quotes_escapes_and_separators_inside_the_argument(text, argument):
    (statement,) = parse(text).statements
    assert statement.argument.text == argument


@pytest.mark.parametrize("text, canonical", [
    ("lora   'loras/a.safetensors'  merge=false\tname=x", 'lora "loras/a.safetensors" merge=false name=x\n'),
    ('lora "a\\"b" # why', 'lora "a\\"b"  # why\n'),
    ('x mode Target "arg" except norm in a', 'x mode Target "arg" in a except norm\n'),
])
def test_formatter_writes_the_argument_quoted_and_round_trips(text, canonical):
    assert format_script(text) == canonical
    assert parse(canonical).statements == parse(text).statements


def test_an_unterminated_argument_is_a_syntax_error_at_the_quote():
    with pytest.raises(ScriptError) as info:
        parse('lora "loras/a.safetensors')
    (problem,) = info.value.problems
    assert (problem.span.column, problem.message) == (6, "unterminated string")


def test_two_arguments_are_a_syntax_error():
    with pytest.raises(ScriptError):
        parse("lora 'a' 'b'")


def test_a_verb_that_takes_no_argument_refuses_one_at_the_argument():
    assert problems('fuse qkv "x.safetensors"') == [(1, 10, "'fuse qkv' takes no quoted argument")]
    assert problems("quantize nf4 'x' in attn") == [(1, 14, "'quantize nf4' takes no quoted argument")]
