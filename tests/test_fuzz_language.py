"""Property-based and fuzz tests of the language: parser, syntax errors, formatter.

Whatever text it is given, :func:`transformdsl.parse` either returns a script or raises
:class:`ScriptError` whose line/column lie inside the text: never another exception,
never unbounded work.  A parsed script printed in canonical form parses back to the same
IR (types of option values included), and formatting is idempotent.

Inputs: random text, text over the grammar's own alphabet, mutations of real scripts
(``examples/*.tfm``, the code blocks of ``spec.md`` and the seeds below), scripts
generated from the grammar with known IR, and adversarial inputs timed against a bound.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transformdsl import ScriptError, parse
from transformdsl.formatter import format_script, format_statement, format_value
from transformdsl.ir import Argument, Option, Script, Selector, Statement
from transformdsl.parser import MAX_SCRIPT_CHARS, make_selector

ROOT = Path(__file__).resolve().parent.parent

SEEDS = [
    "fuse qkv in *Attention; quantize int8 except norm; compile fullgraph=false",
    "fuse qkv\nquantize nf4 in transformer_blocks except norm, proj_out compute=bfloat16\n",
    "fp8 native Linear, Conv1D scaling=row strict=true\ncompile regional in *TransformerBlock mode=max-autotune\n",
    "# comment\nquantize hqq in re:\"^blocks\\.[0-9]+$\" group_size=64 nbits=4 # trailing\n",
    "fp8 storage except re:^proj_in$, pos_embed dtype=e5m2 compute='float16'\r\n",
    "fuse bias_act_dropout in down_blocks.*.attentions, up_blocks.[01] default_except=false",
    "quantize int8 component=text_encoder threshold = 6.0 ; ; compile\n\n\n",
    "x y=\"a \\\"quoted\\\" value\" z='it\\'s' w=-1.5e-3 v=+7 u=TRUE",
]


def _spec_blocks() -> list[str]:
    """Fenced code blocks of spec.md written in the language (``tfm`` or no info string)."""
    spec = ROOT / "spec.md"
    if not spec.is_file():
        return []
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", spec.read_text(), flags=re.S | re.M)
    return [body for info, body in blocks if info in ("", "tfm", "transformdsl")]


def _corpus() -> list[str]:
    examples = sorted((ROOT / "examples").glob("*.tfm")) if (ROOT / "examples").is_dir() else []
    return SEEDS + [p.read_text() for p in examples] + _spec_blocks()


CORPUS = _corpus()

# Characters and fragments that matter to the grammar, to the lexer and to line counting.
ALPHABET = list("aZ09_ \t\n;,#=\"'\\:*?.[]!-+(){}|^$") + [
    "in", "except", "re:", "re:\"", "k=", "true", "1e400", "9" * 30, "\r", "\r\n", "\f", "\v", "\x00",
    "\x85", "\u2028", "\u00e9", "\U0001f600", "fuse", "qkv", "Linear", "x.y",
]


# --------------------------------------------------------------------------- helpers


def check_error(error: ScriptError, text: str) -> None:
    """Every problem's span starts inside ``text`` (lines counted at "\\n", like the parser)."""
    lines = text.split("\n")
    for problem in error.problems:
        span = problem.span
        assert span is not None, problem.message
        assert 1 <= span.line <= len(lines), (problem.message, span, len(lines))
        assert 1 <= span.column <= len(lines[span.line - 1]) + 1, (problem.message, span)
        assert problem.message
    assert (error.line, error.column) == (error.problems[0].span.line, error.problems[0].span.column)
    str(error)  # rendering (excerpt and caret) must not fail either
    error.diagnostics()


def parse_or_error(text: str) -> Script | None:
    """The parsed script, or None after checking the ScriptError.  Anything else propagates."""
    try:
        return parse(text)
    except ScriptError as error:
        check_error(error, text)
        return None


def ir(script: Script) -> list:
    """The script's IR for comparison: dataclass equality ignores spans, but ``1 == True``,
    so option values are compared with their types too."""
    return [(s, tuple((o.name, type(o.value), o.value) for o in s.options)) for s in script.statements]


def assert_round_trip(script: Script) -> None:
    text = format_script(script)
    again = parse(text)
    assert ir(again) == ir(script), text
    assert format_script(again) == text  # idempotent
    assert format_script(script, comments=False) == format_script(again, comments=False)


# --------------------------------------------------------------------------- arbitrary text


@given(st.text(max_size=200))
def test_random_text_parses_or_raises_script_error(text):
    parse_or_error(text)


@given(st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join))
def test_grammar_alphabet_text_parses_or_raises_script_error(text):
    script = parse_or_error(text)
    if script is not None:
        assert_round_trip(script)


@st.composite
def mutated(draw) -> str:
    """A corpus script with a few random edits (insert, delete, replace, duplicate, swap)."""
    text = draw(st.sampled_from(CORPUS))
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 12)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "duplicate", "swap"]))
        piece = draw(st.sampled_from(ALPHABET))
        if op == "insert":
            text = text[:i] + piece + text[i:]
        elif op == "delete":
            text = text[:i] + text[j:]
        elif op == "replace":
            text = text[:i] + piece + text[j:]
        elif op == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i] + text[j:] + text[i:j]
    return text


@given(mutated())
def test_mutated_scripts_parse_or_raise_script_error(text):
    script = parse_or_error(text)
    if script is not None:
        assert_round_trip(script)


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_corpus_round_trips(text):
    script = parse_or_error(text)
    if script is not None:
        assert_round_trip(script)


# --------------------------------------------------------------------------- generated scripts

KEYWORDS = {"in", "except"}
LOWER, UPPER, DIGITS = "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789"


def _joined(*parts: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.tuples(*parts).map("".join)


def _chars(alphabet: str, min_size: int = 0, max_size: int = 8) -> st.SearchStrategy[str]:
    return st.text(alphabet, min_size=min_size, max_size=max_size)


# Plain text strategies rather than st.from_regex: an order of magnitude cheaper to draw.
verbs = _chars(LOWER + UPPER + DIGITS + "_*?.-", 1, 10).filter(lambda w: w not in KEYWORDS)
modes = _joined(st.sampled_from(LOWER), _chars(LOWER + DIGITS + "_")).filter(lambda w: w not in KEYWORDS)
selector_texts = st.one_of(
    _joined(st.sampled_from(UPPER), _chars(LOWER + UPPER + DIGITS + "_*?")),              # class glob
    st.lists(_chars(LOWER + DIGITS + "_*?[]", 1, 5), min_size=2, max_size=4).map(".".join),  # dotted path
    _chars(LOWER + DIGITS + "_", 1, 10).filter(lambda w: w not in KEYWORDS),              # word
    _joined(_chars(LOWER + "_"), st.sampled_from("*?"), _chars(LOWER + DIGITS + "*?")),  # name glob
    st.sampled_from(["re:^blocks\\.\\d+$", "re:(q|k|v)_proj", "re:attn", "re:.*norm.*"]),
    st.sampled_from(['re:"a b"', 're:"x\\"y"', 're:"^(to_q|to_k)$"', 're:"#x;y,z"']),
)
option_names = _joined(st.sampled_from(LOWER + UPPER + "_"), _chars(LOWER + UPPER + DIGITS + "_"))
values = st.one_of(
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    _joined(st.sampled_from(LOWER + "_"), _chars(LOWER + UPPER + DIGITS + "_.-")),
    st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=12),
)


@st.composite
def statements(draw) -> tuple[Statement, str]:
    """A statement's IR and one of the many texts that spell it."""
    verb = draw(verbs)
    mode = draw(st.none() | modes)
    target = draw(st.lists(selector_texts, max_size=3))
    if mode is None and target and re.fullmatch(r"[a-z][a-z0-9_]*", target[0]):
        target[0] = target[0].capitalize()  # a lowercase first target would be the mode
    argument = draw(st.none() | st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)),
                                         max_size=12))
    comma = draw(st.sampled_from([", ", ",", " , ", " ,\t"]))
    # Clauses as (keyword, selectors) or ("option", (name, value)); `in` and `except`
    # selectors may be split over several clauses of the same keyword, in any order.
    clauses: list[tuple[str, object]] = []
    for keyword in ("in", "except"):
        selectors = draw(st.lists(selector_texts, max_size=3))
        if selectors:
            cut = draw(st.integers(1, len(selectors)))
            clauses.append((keyword, selectors[:cut]))
            if cut < len(selectors):
                clauses.append((keyword, selectors[cut:]))
    for name in draw(st.lists(option_names, max_size=3, unique=True)):
        clauses.append(("option", (name, draw(values))))
    clauses = draw(st.permutations(clauses))
    words = [verb] + ([mode] if mode else []) + ([comma.join(target)] if target else [])
    if argument is not None:
        quote = draw(st.sampled_from(["'", '"']))
        words.append(quote + argument.replace("\\", "\\\\").replace(quote, "\\" + quote) + quote)
    for keyword, payload in clauses:
        if keyword == "option":
            name, value = payload
            equals = draw(st.sampled_from(["=", " =", "\t="]))
            words.append(f"{name}{equals}{_spell(draw, value)}")
        else:
            words.append(f"{keyword} " + comma.join(payload))

    def selected(keyword: str) -> tuple[Selector, ...]:
        return tuple(make_selector(t) for k, p in clauses if k == keyword for t in p)

    statement = Statement(
        verb=verb, mode=mode, target=tuple(make_selector(t) for t in target),
        scope=selected("in"), exclude=selected("except"),
        options=tuple(Option(n, v) for k, (n, v) in ((k, p) for k, p in clauses if k == "option")),
        argument=None if argument is None else Argument(argument),
    )
    return statement, " ".join(words)


def _spell(draw, value) -> str:
    """``value`` as option text: canonical, or quoted with either quote when it is a string."""
    if isinstance(value, str) and draw(st.booleans()):
        quote = draw(st.sampled_from(["'", '"']))
        return quote + value.replace("\\", "\\\\").replace(quote, "\\" + quote) + quote
    return format_value(value)


@st.composite
def scripts(draw) -> tuple[list[Statement], str]:
    """Several generated statements with separators, comments, blank lines and CRLF."""
    pairs = draw(st.lists(statements(), max_size=4))
    out = draw(st.sampled_from(["", "\n", "# header\n", " \t"]))
    for i, (_, text) in enumerate(pairs):
        out += text
        if draw(st.booleans()):
            out += draw(st.sampled_from([" # note", "\t#x;y,z 'q", "  #"]))
            out += "\n"
        else:
            out += draw(st.sampled_from(["\n", ";", "; ", "\r\n", "\n\n", " ;\n"])) if i < len(pairs) - 1 else ""
    return [s for s, _ in pairs], out


@given(scripts())
def test_generated_scripts_parse_to_their_ir(case):
    expected, text = case
    script = parse(text)
    assert ir(script) == ir(Script(tuple(expected))), text
    assert_round_trip(script)


@given(st.lists(statements(), min_size=1, max_size=4))
def test_format_statement_without_source(pairs):
    # A script built in code (no spans, no source) formats without comments and reads back.
    script = Script(tuple(s for s, _ in pairs))
    text = format_script(script)
    assert text.count("\n") == len(pairs)
    assert ir(parse(text)) == ir(script)


@given(values)
def test_format_value_reads_back_with_its_type(value):
    script = parse(f"x k={format_value(value)}")
    got = script.statements[0].options[0].value
    assert (type(got), got) == (type(value), value)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), "a\nb", None, [1]])
def test_format_value_refuses_what_no_script_can_say(value):
    with pytest.raises(ValueError):
        format_value(value)


@pytest.mark.parametrize("statement", [
    Statement("fuse", None, (Selector("lower", "word", "lower"),), (), (), ()),  # would read as a mode
    Statement("fuse", None, (Selector("a b", "name", "a b"),), (), (), ()),      # not one word
    Statement("fuse", "qkv", (Selector("in", "word", "in"),), (), (), ()),       # a keyword
    Statement("fuse", "Mode", (), (), (), ()),                                   # not a mode
    Statement("fuse", None, (), (), (), (Option("a-b", 1),)),                    # not an option name
    Statement("lora", None, (), (), (), (), argument=Argument("a\nb")),          # a line break
])
def test_format_refuses_statements_no_text_can_spell(statement):
    with pytest.raises(ValueError):
        format_statement(statement)


def test_formatter_keeps_comments_and_collapses_blank_lines():
    text = ("\n\n# header\n\nfuse qkv in *Attention;quantize int8 except norm,proj_out   # why\n\n\n\n"
            "# before compile\ncompile fullgraph=false mode='max-autotune' tag=\"64\" # done  \r\n# end\n\n")
    assert format_script(text) == (
        "# header\n"
        "\n"
        "fuse qkv in *Attention\n"
        "quantize int8 except norm, proj_out  # why\n"
        "\n"
        "# before compile\n"
        "compile fullgraph=false mode=max-autotune tag=\"64\"  # done\n"
        "# end\n"
    )
    assert format_script(text, comments=False) == (
        "fuse qkv in *Attention\nquantize int8 except norm, proj_out\n"
        "compile fullgraph=false mode=max-autotune tag=\"64\"\n")
    assert format_script("") == "" and format_script("# only\n") == "# only\n"


def test_hash_inside_quotes_is_not_a_comment():
    text = 'fuse re:"a#b" k="#1" # real\n'
    assert format_script(text) == 'fuse re:"a#b" k="#1"  # real\n'


# --------------------------------------------------------------------------- regressions (bugs found)


@pytest.mark.parametrize("text, line, column, message", [
    # The regex compiler's recursion / repeat limits raised RecursionError / OverflowError.
    ("fuse re:" + "(" * 3000 + ")" * 3000, 1, 6, "regular expression too complex"),
    ("fuse re:a{99999999999999999999}", 1, 6, "repeat count too big"),
    ("fuse re:a{4294967296}", 1, 6, "repeat count too big"),
    # Positions at end of input came from str.splitlines(), which also splits at \f, \r,
    # \x85, \u2028: the reported line could be past the last line.
    ("fuse qkv in\f ", 1, 12, "expected a selector after 'in'"),
    ("fuse qkv\rk=", 1, 12, "expected a value after 'k='"),
    ("a\x0cb k=", 1, 7, "expected a value after 'k='"),
    # The "previous word" was read from the text and picked up comments.
    ("fuse a k= # note\n", 1, 17, "expected a value after 'k='"),
    ("fuse a k=#", 1, 10, "expected a value after 'k='"),
    # An unterminated quoted regex lost its last character silently (re:"ab matched 'a').
    ('fuse re:"ab', 1, 6, "unterminated quoted regular expression"),
    ("fuse x in re:'a, b", 1, 11, "unterminated quoted regular expression"),
    # `fuse qkv, in` made `in` a target, which reads back as the keyword once formatted.
    ("fuse qkv, in", 1, 11, "'in' is a keyword, not a selector"),
    ("fuse in a, except", 1, 12, "'except' is a keyword, not a selector"),
])
def test_regressions(text, line, column, message):
    with pytest.raises(ScriptError) as caught:
        parse(text)
    check_error(caught.value, text)
    assert (caught.value.line, caught.value.column) == (line, column)
    assert message in caught.value.message


def test_numbers_that_overflow_stay_text():
    # 1e400 and 5000-digit integers became float('inf'), which no script can write back.
    options = parse("x a=1e400 b=" + "9" * 5000 + " c=1e3").statements[0].options
    assert [type(o.value) for o in options] == [str, str, float]


def test_excerpt_counts_lines_like_the_parser():
    error = pytest.raises(ScriptError, parse, "fuse a\f\nfuse b,,").value
    assert error.line == 2
    assert "fuse b,," in str(error)


# --------------------------------------------------------------------------- bounded work

#: Seconds a script of MAX_SCRIPT_CHARS may take, extrapolated linearly from a 1/16 size
#: input (linearity is checked below).  The densest case, 128k one-word statements, takes
#: ~8 s of CPU on a laptop-class core: lark builds a tree node per token.
FULL_SIZE_LIMIT = 40.0
N = MAX_SCRIPT_CHARS // 16

ADVERSARIAL = {
    "10k commas": "fuse qkv in " + "," * 10_000,
    "long selector list": "fuse a" + ", b" * (N // 3),
    "words without commas": "fuse " + "a " * (N // 2),
    "repeated clauses": "fuse a" + " in b" * (N // 5),
    "repeated options": "fuse a" + " k=1" * (N // 4),
    "max-size selector": "fuse " + "A" * (MAX_SCRIPT_CHARS - 5),
    "max-size unterminated quoted regex": 'fuse re:"' + "x" * (MAX_SCRIPT_CHARS - 9),
    "max-size unterminated string": 'fuse a k="' + "x" * (MAX_SCRIPT_CHARS - 10),
    "max-size comment": "#" * MAX_SCRIPT_CHARS,
    "backslashes in a string": 'fuse a k="' + "\\" * (2 * (N // 2)) + '"',
    "many statements": "x;" * (N // 2),
    "many separators": ";" * N,
    "many comments": "# c\n" * (N // 4),
    "nested regex groups": "fuse re:" + "(" * 5000 + ")" * 5000,
    "exponential-looking regexes": "fuse re:(a+)+$ in " + ", ".join(["re:(a*)*b"] * 2000),
    "deep brackets": "fuse " + "[" * N,
    "long word then error": "a" * N + "\n,",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_inputs_finish_in_bounded_time(name):
    text = ADVERSARIAL[name]
    assert len(text) <= MAX_SCRIPT_CHARS
    started = time.process_time()
    parse_or_error(text)
    elapsed = time.process_time() - started
    extrapolated = elapsed * MAX_SCRIPT_CHARS / len(text)
    assert extrapolated < FULL_SIZE_LIMIT, f"{name}: {elapsed:.2f} s, {extrapolated:.1f} s at full size"


def test_parse_time_grows_linearly():
    # LALR parsing is linear; catch a quadratic step (error reporting, building the IR).
    def timed(n: int) -> float:
        text = "fuse a in b, c except d k=1\n" * n
        started = time.process_time()
        parse(text)
        return time.process_time() - started

    small, large = min(timed(32) for _ in range(2)), min(timed(256) for _ in range(2))
    assert large < 3 * 8 * small + 0.05, (small, large)  # 8x the text: linear ~8x, quadratic ~64x


def test_oversized_script_is_refused_before_parsing():
    text = "compile\n" * (MAX_SCRIPT_CHARS // 8 + 1)
    started = time.process_time()  # our CPU time: a busy CI machine must not fail the guard
    with pytest.raises(ScriptError) as caught:
        parse(text)
    assert time.process_time() - started < 0.5
    assert "the limit is" in caught.value.message
    check_error(caught.value, text)


def test_not_text_is_a_type_error():
    with pytest.raises(TypeError):
        parse(b"compile")


# --------------------------------------------------------------------------- transformdsl fmt


def test_cli_fmt_rewrites_checks_and_leaves_bad_files_alone(tmp_path, capsys):
    from transformdsl.cli import main

    messy = tmp_path / "messy.tfm"
    messy.write_bytes(b"fuse qkv in *Attention;quantize int8 except norm,proj_out # why\r\n")
    broken = tmp_path / "broken.tfm"
    broken.write_text("fuse qkv in ,\n")
    assert main(["fmt", "--check", str(messy)]) == 1
    assert "would reformat" in capsys.readouterr().out
    assert messy.read_bytes().endswith(b"\r\n")  # --check writes nothing
    assert main(["fmt", str(messy), str(broken)]) == 1  # the broken one fails, the other is rewritten
    captured = capsys.readouterr()
    assert f"reformatted {messy}" in captured.out and "expected a selector after 'in'" in captured.err
    assert messy.read_text() == "fuse qkv in *Attention\nquantize int8 except norm, proj_out  # why\n"
    assert broken.read_text() == "fuse qkv in ,\n"
    assert main(["fmt", "--check", str(messy)]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
