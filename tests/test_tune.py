"""``transformdsl.tune``: the script that meets a quality budget, re-measured independently here.

On the trained LM (tests/trained/: real trained weights, held-out text) with two modes, so that each
tune takes seconds; the full vocabulary of modes is the benchmark's (benchmarks/bench_tune.py).
"""

from __future__ import annotations

import ast
import doctest
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformdsl
from tests import trained
from transformdsl.errors import TransformError
from transformdsl.verification import measure

ROOT = Path(__file__).resolve().parent.parent
MODES = ["quantize int8 weight_only=true", "quantize int4 group_size=32"]
TOKENS, ROWS = 64, 8


@pytest.fixture(scope="module")
def model():
    return trained.load_model()


@pytest.fixture(scope="module")
def rows():
    """8 rows of 64 held-out tokens: the tune holds out the last 2."""
    return [trained.text_inputs(TOKENS, offset=i * TOKENS)[0][0] for i in range(ROWS)]


@pytest.fixture(scope="module")
def tuned(model, rows, tmp_path_factory):
    storage = tmp_path_factory.mktemp("tune") / "study.db"
    return transformdsl.tune(model, max_kl=0.05, goal="size", calibration=rows, modes=MODES, storage=str(storage),
                             rounds=1), storage


def kl_on(model, script: str, rows) -> float:
    """The script applied to a fresh copy, KL on the held-out rows (worst), by transformdsl.transform."""
    fresh = trained.load_model()
    with torch.no_grad():
        before = [model(r).logits for r in rows]
    transformdsl.transform(fresh, script)
    with torch.no_grad():
        return max(measure("kl", b, fresh(r).logits) for b, r in zip(before, rows))


def saved(model, script: str, tmp_path, name: str) -> int:
    fresh = trained.load_model()
    if script:
        transformdsl.transform(fresh, script)
    out = transformdsl.save(fresh, tmp_path / name)
    return sum(p.stat().st_size for p in Path(out).rglob("*.safetensors"))


def statements(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.strip() and not line.startswith("#")]


def test_the_pick_meets_the_bound_and_is_no_larger_than_the_best_uniform_script(model, rows, tuned, tmp_path):
    result, _ = tuned
    assert result.passed and not result.partial, result.reason
    assert 1 <= result.evaluations <= 5
    heldout = rows[-2:]
    kl = kl_on(model, result.script, heldout)
    assert kl <= 0.05
    assert kl == pytest.approx(result.value, rel=1e-6)
    ours = saved(model, result.script, tmp_path, "tuned")
    assert ours == pytest.approx(result.size_ratio * result.float_bytes, rel=1e-9)
    uniform = {mode: (kl_on(model, mode, heldout), saved(model, mode, tmp_path, mode.replace(" ", "_")))
               for mode in MODES}
    meeting = [size for value, size in uniform.values() if value <= 0.05]
    assert meeting and ours <= min(meeting), (ours, uniform)
    # the script a person reads: a few statements with selectors, not one module per line
    lines = statements(result.script)
    assert 1 <= len(lines) <= len(MODES)
    assert sum(line.count(",") + 1 for line in lines) < result.layers
    assert "# tune: metric=kl bound=0.05 goal=size" in result.script
    assert "measured: kl" in result.script and "cores" in result.script
    transformdsl.plan(model, result.script)  # it plans on the model


def test_table_plot_and_certificate(tuned, tmp_path):
    result, _ = tuned
    table = result.table()
    assert table.splitlines()[0].split()[:2] == ["measured", "kl"]
    assert sum(line.startswith("*") for line in table.splitlines()) == 1
    png = result.plot(tmp_path / "tune.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert transformdsl.tune.certificate(result.script)["bound"] == "0.05"


def test_a_tune_run_again_reads_everything_back(model, rows, tuned):
    first, storage = tuned
    again = transformdsl.tune(model, max_kl=0.05, goal="size", calibration=rows, modes=MODES, storage=str(storage),
                              rounds=1)
    assert again.measured_units == []
    assert statements(again.script) == statements(first.script)
    # a wider tune measures only what is new: the two modes' layers are read back
    wider = transformdsl.tune(model, max_kl=0.05, goal="size", calibration=rows, storage=str(storage), rounds=1,
                              modes=[*MODES, "quantize hqq bits=8"], evaluations=1)
    assert [u for u in wider.measured_units if u.startswith("layers|")] == ["layers|quantize hqq bits=8"]
    assert {f"layers|{m}" for m in MODES} <= set(wider.reused_units)


WORKER = """
import sys
import transformdsl
from transformdsl import models
result = transformdsl.tune(models.tiny_llama(), max_rms=0.05, modes={modes!r}, storage=sys.argv[1], rounds=1)
assert result.passed, result.reason
print("STATEMENTS", [line for line in result.script.splitlines() if line and not line.startswith("#")])
print("MEASURED", result.measured_units)
"""


@pytest.mark.slow
def test_two_workers_sharing_one_storage_find_what_one_finds(tmp_path):
    """On the built-in Llama (random weights: what is tested is the sharing, not the quality)."""
    from transformdsl import models

    alone = transformdsl.tune(models.tiny_llama(), max_rms=0.05, modes=MODES, rounds=1)
    storage = str(tmp_path / "shared.db")
    code = WORKER.format(modes=MODES)
    workers = [subprocess.Popen([sys.executable, "-c", code, storage], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT) for _ in range(2)]
    outputs = [w.communicate(timeout=300) for w in workers]
    for worker, (_, err) in zip(workers, outputs):
        assert worker.returncode == 0, err[-3000:]
    found = [next(line for line in out.splitlines() if line.startswith("STATEMENTS")) for out, _ in outputs]
    assert found[0] == found[1] == f"STATEMENTS {statements(alone.script)}"
    measured = [ast.literal_eval(next(line for line in out.splitlines() if line.startswith("MEASURED"))[9:]) for out, _ in outputs]
    assert set(measured[0]) | set(measured[1]) >= {f"layers|{m}" for m in MODES}  # between them, every unit


def test_an_impossible_budget_says_the_best_reached_and_by_which_script(model, rows, tuned):
    result = transformdsl.tune(model, max_kl=1e-9, goal="size", calibration=rows, modes=MODES, rounds=1)
    assert not result.passed
    assert "no layer can change within kl <= 1e-09" in result.reason
    assert "alone, gives kl" in result.reason and "model.layers." in result.reason


def test_a_time_budget_returns_the_best_so_far_marked_partial(model, rows):
    result = transformdsl.tune(model, max_kl=0.05, goal="size", calibration=rows, modes=MODES, budget_s=1e-6)
    assert result.partial and "time budget" in result.reason
    assert result.script == "" or "PARTIAL" in result.script


def test_the_latency_goal_measures_against_the_float_model_in_this_process(model, rows):
    result = transformdsl.tune(model, max_kl=0.05, goal="latency", calibration=rows, modes=MODES[:1], rounds=2,
                               evaluations=2)
    assert result.passed
    if result.chosen.chosen:  # some layer measured faster here: its script was verified end to end
        assert result.latency.rounds == 2 and result.value <= 0.05
    else:
        assert "fastest model is the float model" in result.reason


def test_flux_within_an_rms_budget():
    from transformdsl import models

    flux = models.tiny_flux()
    result = transformdsl.tune(flux, max_rms=0.05, goal="size", modes=["quantize int8 weight_only=true", "fp8 storage"],
                               rounds=1)
    assert result.passed, result.reason
    assert "model's own sample inputs (random" in result.inputs
    fresh = models.tiny_flux()
    before = models.run(flux)
    transformdsl.transform(fresh, result.script)
    assert measure("rms", before, models.run(fresh)) <= 0.05


def test_the_model_is_left_as_it_was():
    from transformdsl import models

    llama = models.tiny_llama()
    modules = dict(llama.named_modules())
    state = {k: v.clone() for k, v in llama.state_dict().items()}
    transformdsl.tune(llama, max_rms=0.05, modes=["quantize int8 weight_only=true"], rounds=1, evaluations=1)
    assert dict(llama.named_modules()).keys() == modules.keys()
    assert all(llama.get_submodule(name) is module for name, module in modules.items())
    after = llama.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())


def test_bad_input_is_a_clear_error(model):
    with pytest.raises(TransformError, match="exactly one quality budget"):
        transformdsl.tune(model, max_kl=0.1, max_rms=0.1)
    with pytest.raises(TransformError, match="goal='speed'"):
        transformdsl.tune(model, max_kl=0.1, goal="speed")
    with pytest.raises(TransformError, match="a mode is a statement without selectors"):
        transformdsl.tune(model, max_kl=0.1, modes=["quantize int8 weight_only=true in model.layers.0"])
    with pytest.raises(TransformError, match="no mode applies to this model"):
        transformdsl.tune(torch.nn.Sequential(torch.nn.Linear(4, 4)), max_rms=0.1, heldout=[torch.randn(2, 4)],
                          modes=["quantize int4 group_size=32"])


def test_candidates_come_from_the_declarations():
    from transformdsl.tune import candidates

    pruned = []
    texts = [m.text for m in candidates.declared_modes(pruned=pruned)]
    assert "quantize int8 weight_only=true" in texts and "fp8 storage dtype=e5m2" in texts
    assert "quantize int4 group_size=128" in texts
    assert any(text.startswith("quantize hqq bits=2") for text, _ in pruned)  # no error bound declared
    assert not any("weight_only=false" in t for t in texts if t.startswith("quantize int4"))


def test_the_modules_doctests():
    from transformdsl.tune import candidates, script, search

    for module in (candidates, script, search):
        assert doctest.testmod(module).failed == 0


@pytest.mark.slow
def test_cli_tune_then_check(tmp_path, capsys):
    from safetensors.torch import save_file

    from transformdsl.cli import main

    ids = torch.cat([trained.text_inputs(TOKENS, offset=i * TOKENS)[0][0] for i in range(ROWS)])
    save_file({"input_ids": ids}, tmp_path / "calibration.safetensors")
    out = tmp_path / "best.tfm"
    common = ["--model", "tests.trained:load_model", "--calibration", str(tmp_path / "calibration.safetensors")]
    status = main(["tune", *common, "--max-kl", "0.05", "--mode", MODES[1], "--out", str(out), "-q"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "chosen:" in printed and out.is_file() and (tmp_path / "best.png").is_file()
    assert (tmp_path / "best.tfm.study.db").is_file()
    assert main(["tune", *common, "--check", str(out), "-q"]) == 0
    assert "ok: kl" in capsys.readouterr().out
    assert main(["tune", *common, "--check", str(out), "--max-kl", "1e-9", "-q"]) == 1
    assert "FAILED: kl" in capsys.readouterr().out
    save_file({"tokens": ids}, tmp_path / "bad.safetensors")
    assert main(["tune", "--model", "llama", "--calibration", str(tmp_path / "bad.safetensors"), "--max-kl", "0.1",
                 "--out", str(out)]) == 1
    assert "expected an integer tensor named input_ids" in capsys.readouterr().err


def test_import_transformdsl_and_the_cli_import_no_optuna_or_matplotlib():
    code = ("import sys, transformdsl; from transformdsl import cli; cli.build_parser(); import transformdsl.tune; "
            "print(sorted(m for m in ('optuna', 'matplotlib') if m in sys.modules)); "
            "print(callable(transformdsl.tune))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split() == ["[]", "True"]


def test_a_method_that_learns_from_data_is_searched_with_the_calibration_inputs(model, rows):
    result = transformdsl.tune(model, max_kl=0.05, goal="size", calibration=rows,
                               modes=["quantize int4 group_size=32 method=gptq"], rounds=1, evaluations=1)
    assert result.passed, result.reason
    assert "method=gptq" in result.script
    fresh = trained.load_model()
    held = rows[-2:]
    with torch.no_grad():
        before = [model(r).logits for r in held]
    transformdsl.transform(fresh, result.script.replace("calibrate", "# calibrate"), calibration=rows[:-2])
    with torch.no_grad():
        assert max(measure("kl", b, fresh(r).logits) for b, r in zip(before, held)) <= 0.05
