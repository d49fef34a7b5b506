"""The numerical guard on trained weights (spec.md "Numerical guard"; transformdsl/verification.py).

The model is tests/trained/ (a small Llama trained here on Python's docs, byte-level), float32, with
the outlier structure random weights lack.  Each scheme's *cost* is the mean KL per token of its
next-token distributions against the float model's on held-out text it never saw (4,096 tokens);
``verify`` measures on a sample: the library's own (random tokens, 2 x 8) or held-out text of 64 or
512 tokens.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import transformdsl
from tests import trained
from tests.trained.train import outlier_stats
from transformdsl.errors import TransformError
from transformdsl.verification import (
    Check,
    VerifyError,
    checks,
    default_metric,
    measure,
    parse_cli,
    script_error_bound,
    token_kl,
)

NEAR_LOSSLESS = ("quantize int8 weight_only=true", "quantize int8 threshold=6", "fp8 storage",
                 "quantize hqq bits=4 group_size=64")
#: Every scheme whose verdicts are compared, best to worst as measured on this model (the order is
#: not assumed: the test reads it from the costs).
SCHEMES = NEAR_LOSSLESS + ("quantize hqq bits=8", "quantize int8", "fp8 native", "fp8 storage dtype=e5m2",
                           "quantize nf4", "quantize fp4", "quantize hqq bits=3")
INPUTS = {"sample": None, "text 64": trained.text_inputs(64), "text 512": trained.text_inputs(512)}
#: A scheme is "measurably worse" than another when its cost is at least this many times the other's.
MEASURABLY = 1.5
VALUE = re.compile(r"^verify: kl ([0-9.eE+-]+) ")


@pytest.fixture(scope="module")
def model():
    return trained.load_model()


@pytest.fixture(scope="module")
def heldout():
    return trained.heldout_ids()[0, :4096].view(8, 512)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(row[None], use_cache=False).logits for row in ids])


@pytest.fixture(scope="module")
def measured(model, heldout):
    """scheme -> {"cost": KL per token on the held-out windows, input name -> KL verify measured,
    "<input name> passed" -> its verdict}, from ``transform(copy, script, verify=True)``: the guard's
    own figures (its log line, or the refusal's report)."""
    reference = logits(model, heldout)
    out = {}
    for script in SCHEMES:
        ours = copy.deepcopy(model)
        transformdsl.transform(ours, script)
        row = {"cost": token_kl(reference, logits(ours, heldout))}
        for name, inputs in INPUTS.items():
            lines = []
            try:
                transformdsl.transform(copy.deepcopy(model), script, verify=True, verify_inputs=inputs,
                                       log=lines.append)
                row[name], row[f"{name} passed"] = float(VALUE.match(lines[-1]).group(1)), True
            except VerifyError as exc:
                row[name], row[f"{name} passed"] = exc.report.value, False
        out[script] = row
    return out


# --------------------------------------------------------------------------- the fixture


def test_the_trained_model_has_the_structure_random_weights_lack(model, heldout):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    random = LlamaForCausalLM(model.config).eval()
    probe = heldout[:1]
    trained_stats, random_stats = outlier_stats(model, probe), outlier_stats(random, probe)
    # hidden channels whose activations pass LLM.int8's outlier threshold: none at random init
    assert random_stats["channels_over_6"] == 0 and trained_stats["channels_over_6"] >= 0.05
    assert trained_stats["max_over_rms"] >= 2 * random_stats["max_over_rms"]
    ids = heldout[:2]
    with torch.no_grad():
        loss = model(ids, labels=ids, use_cache=False).loss.item()
    assert loss < 2.2  # nats per byte on text it never saw (a uniform guess: 5.5)


# --------------------------------------------------------------------------- the verdicts


@pytest.mark.parametrize("script", NEAR_LOSSLESS)
@pytest.mark.parametrize("inputs", list(INPUTS))
def test_near_lossless_schemes_pass_with_the_default_bound(model, script, inputs):
    lines = []
    transformdsl.transform(copy.deepcopy(model), script, verify=True, verify_inputs=INPUTS[inputs], log=lines.append)
    assert lines[-1].startswith("verify: kl ") and " within the bound " in lines[-1], lines[-1]
    # the statement as written labels its bound (weight_only=true is not plain 'quantize int8')
    assert f"(the script's: {script}: " in lines[-1]


def test_verify_ranks_the_schemes_as_they_cost(measured):
    """Wherever one scheme is measurably worse than another on held-out text, verify measures it as
    worse too on text of 64 and 512 tokens: so whatever the bound, a worse scheme never passes where
    a better one is refused.  (Not on the sample input: on 16 random tokens ``fp8 storage dtype=e5m2``
    measured above hqq 4-bit, which costs 2x as much on text; the declared bounds still order the
    verdicts there: test_default_verdicts_follow_the_cost.)"""
    for name in ("text 64", "text 512"):
        for better, a in measured.items():
            for worse, b in measured.items():
                if b["cost"] >= MEASURABLY * a["cost"]:
                    assert b[name] > a[name], f"{name}: {worse} ({b}) measured below {better} ({a})"


def test_default_verdicts_follow_the_cost(measured):
    """With each scheme's declared bound: no scheme passes while a measurably better one is refused."""
    for name in INPUTS:
        passed = {script: row[f"{name} passed"] for script, row in measured.items()}
        assert all(passed[s] for s in NEAR_LOSSLESS), passed
        for better in SCHEMES:
            for worse in SCHEMES:
                if measured[worse]["cost"] >= MEASURABLY * measured[better]["cost"]:
                    assert passed[better] or not passed[worse], (name, better, worse, passed)


def test_a_bound_given_to_verify_passes_exactly_the_schemes_that_cost_less(model, measured):
    values = sorted(row["text 512"] for row in measured.values())
    budget = (values[len(values) // 2 - 1] * values[len(values) // 2]) ** 0.5  # between the middle two
    passed = set()
    for script in SCHEMES:
        try:
            transformdsl.transform(copy.deepcopy(model), script, verify=budget, verify_inputs=INPUTS["text 512"])
            passed.add(script)
        except VerifyError as exc:
            assert exc.report.bound == budget and exc.report.metric == "kl"
            assert f"more than the bound {budget:g} given to verify" in str(exc)
    assert passed == {s for s, row in measured.items() if row["text 512"] <= budget}
    cheapest_refused = min(measured[s]["cost"] for s in SCHEMES if s not in passed)
    assert all(measured[s]["cost"] < MEASURABLY * cheapest_refused for s in passed)


def test_the_metric_does_not_grow_with_the_length(measured):
    """KL is a mean per token: 64 and 512 tokens of the same text measure the same cost."""
    for script in NEAR_LOSSLESS:
        row = measured[script]
        assert row["text 64"] / 3 <= row["text 512"] <= 3 * row["text 64"], (script, row)


# --------------------------------------------------------------------------- what verify= takes


def test_a_refusal_reports_metric_value_bound_and_inputs_and_changes_nothing(model):
    subject = copy.deepcopy(model)
    before = {k: v.clone() for k, v in subject.state_dict().items()}
    with pytest.raises(VerifyError) as caught:
        transformdsl.transform(subject, "quantize int8 weight_only=true", verify=1e-9,
                               verify_inputs=[INPUTS["text 64"], trained.text_inputs(64, offset=4096)])
    report = caught.value.report
    assert report.metric == "kl" and report.bound == 1e-9 and not report.passed
    assert report.value == max(report.values) and len(report.values) == 2
    assert report.inputs == ["args[0] 1x64", "args[0] 1x64"]
    assert re.match(r"verify: the output changed by [0-9.e-]+ \(kl: mean KL\(before ‖ after\) per token .*; worst "
                    r"of 2 samples: #\d, args\[0\] 1x64\), more than the bound 1e-09 given to verify; the model "
                    r"was left unchanged$", str(caught.value)), str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in subject.state_dict().items())


def test_verify_takes_a_metric_or_several_bounds(model):
    lines = []
    transformdsl.transform(copy.deepcopy(model), "quantize int8 weight_only=true", verify="top1",
                           verify_inputs=INPUTS["text 512"], log=lines.append)
    assert lines[-1].startswith("verify: top1 ") and "within the bound 0.15 (the script's: " in lines[-1]
    lines = []
    transformdsl.transform(copy.deepcopy(model), "quantize int8 weight_only=true", verify={"rms": None, "max": None},
                           log=lines.append)
    assert [line.split()[1] for line in lines[-2:]] == ["rms", "max"]
    with pytest.raises(VerifyError, match=r"more than the bound 1e-09 given to verify") as caught:
        transformdsl.transform(copy.deepcopy(model), "fp8 storage", verify={"kl": 1.0, "rms": 1e-9})
    assert caught.value.report.metric == "rms"


@pytest.mark.parametrize("bad, message", [
    ("kld", r"verify: 'kld' is not a metric; one of kl, top1, rms, max"),
    (-1, r"verify=-1: a bound is a finite number >= 0"),
    (float("nan"), r"verify=nan: a bound"),
    ([0.1], r"verify=\[0.1\]: expected True, a bound \(verify=0.05\), a metric"),
    ({"kl": "x"}, r"verify\['kl'\]='x': a bound"),
])
def test_bad_verify_values_are_refused_before_anything_changes(bad, message):
    from transformdsl import models

    model = models.tiny_llama()
    before = models.run(model)
    with pytest.raises(TransformError, match=message):
        transformdsl.transform(model, "quantize int8", verify=bad)
    assert torch.equal(models.run(model), before) and not any("Int8" in type(m).__name__ for m in model.modules())


def test_bounds_compose_the_way_each_metric_adds_up():
    class A:
        error_bound = {"kl": 0.01, "rms": 0.1}

    class B:
        error_bound = {"kl": 0.04, "rms": 0.2}

    class Exact:
        error_bound = 0.0

    class RmsOnly:
        error_bound = 0.05

    assert script_error_bound([A(), B()], "kl") == pytest.approx(0.09)  # (sqrt .01 + sqrt .04)^2
    assert script_error_bound([A(), B()], "rms") == pytest.approx(0.3)
    assert script_error_bound([A(), Exact()], "kl") == pytest.approx(0.01)
    assert script_error_bound([A(), RmsOnly()], "kl") is None and script_error_bound([RmsOnly()]) == 0.05
    assert script_error_bound([A()], "top1") is None
    # the default metric for logits is kl when every statement bounds it, else rms
    assert default_metric("logits", [A(), Exact()]) == "kl" and default_metric("logits", [RmsOnly()]) == "rms"
    assert default_metric("logits", [RmsOnly()], bound_given=True) == "kl" and default_metric("tensor", [A()]) == "rms"


def test_metrics():
    before = torch.tensor([[[4.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    assert measure("kl", before, before) == 0 and measure("top1", before, before) == 0
    assert measure("kl", before, before + 5.0) == pytest.approx(0, abs=1e-12)  # a shift changes no probability
    assert measure("rms", before, before * 1.5) == pytest.approx(0.5)
    assert measure("max", before, before * 1.5) == pytest.approx(0.5)
    # a tie resolved the other way is no change in top-1; a real change is
    assert measure("top1", before, before + torch.tensor([0.0, 0.0, 0.0])) == 0
    assert measure("top1", before, before + torch.tensor([0.0, 3.5, 0.0])) == pytest.approx(0.5)
    p = before.softmax(-1)
    after = before + torch.tensor([0.0, 1.0, 0.0])
    expected = (p * (p.log() - after.log_softmax(-1))).sum(-1).mean().item()
    assert measure("kl", before, after) == pytest.approx(expected, rel=1e-6)


def test_parse_cli_and_checks():
    assert parse_cli(None) is True and parse_cli("kl") == "kl" and parse_cli("0.05") == 0.05
    assert parse_cli("kl=0.05") == {"kl": 0.05}
    assert checks(True) == [Check()] and checks(False) == [] and checks(0.05) == [Check(None, 0.05)]
    assert checks({"kl": 0.1, "top1": None}) == [Check("kl", 0.1), Check("top1", None)]


def test_cli_verify_with(tmp_path, capsys):
    from transformdsl.cli import main

    script = tmp_path / "q.tfm"
    script.write_text("quantize int8 weight_only=true in transformer.h.0\n")
    assert main(["apply", str(script), "--model", "gpt2", "--verify-with", "top1", "--out", str(tmp_path / "a")]) == 0
    assert "verify: top1 " in capsys.readouterr().out
    assert main(["apply", str(script), "--model", "gpt2", "--verify-with", "kl=1e-12", "-q",
                 "--out", str(tmp_path / "b")]) == 1
    assert "more than the bound 1e-12 given to verify" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
