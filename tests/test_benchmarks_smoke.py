"""The benchmark harness (benchmarks/run.py) runs end to end on its smallest configuration.

In this process, on the tiny Flux, one comparison (``quantize int8`` against bitsandbytes by
hand): the page, the raw numbers and the reload check are produced.  No timing is asserted.
"""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def harness(tmp_path, monkeypatch):
    """The benchmark modules, with their working folder in tmp_path and torch's threads restored."""
    monkeypatch.syspath_prepend(str(BENCH))
    import run
    import workloads

    monkeypatch.setattr(workloads, "WORK", tmp_path / "work")
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        yield run
    torch.set_num_threads(threads)


def test_smallest_configuration_runs(harness, tmp_path):
    out = tmp_path / "out"
    page = harness.main(["--quick", "--in-process", "--only", "quantize int8", "--repeats", "1", "--out", str(out)])

    data = json.loads((out / "results" / "run.json").read_text())
    rows = {row["side"]: row for row in data["rows"]}
    assert set(rows) == {"original", "transformdsl", "bitsandbytes Linear8bitLt by hand",
                         "the model unchanged (same process)"}  # ours ÷ original, calls in turn
    for row in rows.values():
        assert row["status"] == "ok" or row["status"].startswith("not available yet"), row.get("traceback")
    ours, by_hand = rows["transformdsl"], rows["bitsandbytes Linear8bitLt by hand"]
    if ours["status"] == "ok":
        assert ours["layers"] == by_hand["layers"]  # the same job on both sides
        assert ours["reload"]["exact"] is True
        assert ours["error"] < 0.05 and by_hand["error"] < 0.05

    text = page.read_text()
    assert text.startswith("# Benchmarks")
    assert "| flux-tiny | quantize int8 |" in text
    assert "## GPU" in text


def test_gpu_script_skips_without_cuda(harness, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu.py would run for minutes")
    import gpu

    assert gpu.main(["--out", str(tmp_path)]) is None
    assert "skipped" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_merge_regenerates_only_the_sections_it_ran(harness, tmp_path):
    """``--merge`` keeps the rows of the earlier run that this one did not measure again; ratios
    to the original model use the original measured by the same run."""
    out = tmp_path / "out"
    common = ["--quick", "--in-process", "--repeats", "1", "--out", str(out)]
    harness.main([*common, "--only", "quantize int8 weight_only"])
    first = json.loads((out / "results" / "run.json").read_text())["meta"]["measured_at"]
    page = harness.main([*common, "--only", "quantize hqq", "--merge"])

    data = json.loads((out / "results" / "run.json").read_text())
    kept = {(r["comparison"], r["side"]): r.get("run") for r in data["rows"]}
    assert kept[("quantize int8 weight_only", "transformdsl")] == first
    assert kept[("quantize hqq", "transformdsl")] == data["meta"]["measured_at"] != first
    assert sorted(r["run"] for r in data["rows"] if r["side"] == "original") == sorted(
        [first, data["meta"]["measured_at"]])  # each run's anchor stays beside its rows
    assert [r["measured_at"] for r in data["meta"]["runs"]] == [data["meta"]["measured_at"], first]
    text = page.read_text()
    assert "## Issue 15's targets" in text
    assert "| flux-tiny | int8 weight-only: latency ÷ fp32 |" in text
    assert "| flux-tiny | hqq reload ÷ floor (reading the bytes)" in text
    assert "Rows from an earlier run" in text


def test_fp8_apply_time_is_the_median_of_rounds_in_turn(harness, tmp_path):
    """The fp8 storage apply-time target compares milliseconds: each side runs in several fresh
    processes, in turn, and the target row gives the median of the rounds' ratios."""
    import report
    from comparisons import FP8_ROUNDS

    out = tmp_path / "out"
    page = harness.main(["--quick", "--in-process", "--only", "fp8 storage scale=none", "--repeats", "1",
                         "--out", str(out)])
    rows = {r["side"]: r for r in json.loads((out / "results" / "run.json").read_text())["rows"]}
    ours, hand = rows["transformdsl"], rows["diffusers enable_layerwise_casting(fp8)"]
    for row in (ours, hand):
        assert row["status"] == "ok", row.get("traceback")
        assert len(row["apply_rounds_s"]) == FP8_ROUNDS and all(t > 0 for t in row["apply_rounds_s"])
        assert row["apply_rounds_s"][0] == row["transform_s"]  # the full job is the first round
    pairs = [a / b for a, b in zip(ours["apply_rounds_s"], hand["apply_rounds_s"])]
    assert report.apply_ratio(ours, hand) == pytest.approx(statistics.median(pairs))
    assert f"median of {FP8_ROUNDS} rounds" in page.read_text()
    # the rounds after the first run their sides in turn, each in the other order than the one before
    jobs, _ = harness.plan_jobs(harness.parse_args(["--quick", "--only", "fp8 storage scale=none"]))
    rounds = [job.side for job in jobs if job.apply_only]
    assert rounds == ([hand["side"], ours["side"], ours["side"], hand["side"]] * FP8_ROUNDS)[:2 * (FP8_ROUNDS - 1)]


def test_cache_benchmark_runs_and_matches_by_hand(tmp_path, monkeypatch):
    """benchmarks/bench_cache.py on the tiny Flux, 4 steps, one round: every cache that runs on Flux
    gives the by-hand final latent bit for bit; a trial run (--out elsewhere) leaves RESULTS.md alone."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_cache

    before = (BENCH / "RESULTS.md").read_text()
    bench_cache.main(["--models", "tiny", "--steps", "4", "--rounds", "1", "--no-compile",
                      "--out", str(tmp_path / "cache.md")])
    page = (tmp_path / "cache.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| tiny | `cache")]
    assert len(rows) == 5
    assert not any("| NO |" in row for row in rows)
    assert sum("| yes |" in row for row in rows) >= 4
    assert "Random weights say little about image quality" in page
    assert (BENCH / "RESULTS.md").read_text() == before
