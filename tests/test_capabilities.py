"""The plan knows the device: capabilities detected on this machine, and the notes they give.

Everything here runs against the real detected capabilities of the machine the tests run on
(no mock of torch): which note a plan shows depends on it, and each test says what it expects
from what was detected, the way the libraries themselves decide.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import capabilities, executor  # noqa: E402
from transformdsl.models import tiny_flux, tiny_llama  # noqa: E402
from transformdsl.transforms.quantize import device_notes, kernels

ROOT = Path(__file__).resolve().parent.parent
#: The label benchmarks/baselines.py gives the untransformed model's job (UNCHANGED_LABEL).
UNCHANGED_LABEL = "the model unchanged (same process)"


def test_detection_reads_the_machine():
    assert capabilities.cpu_capability() == torch.backends.cpu.get_cpu_capability()
    if Path("/proc/cpuinfo").is_file() and os.uname().machine == "x86_64":
        flags = capabilities.cpu_flags()
        assert "sse2" in flags  # every x86-64 CPU has it: the flags line was read
        assert ("avx2" in flags) == (capabilities.cpu_capability() in ("AVX2", "AVX512"))
    detected = capabilities.describe_cpu()
    assert detected["capability"] == capabilities.cpu_capability()
    assert detected["int8_matmul"] in ("int8 dot product", "int_mm without int8 dot product", "float32")


def test_int8_kind_is_the_path_bitsandbytes_takes_here():
    """bitsandbytes registers torch._int_mm for its CPU int8 matmul only with AVX-512 (its own test)."""
    from bitsandbytes.backends.cpu import ops

    kind = capabilities.cpu_int8_matmul()
    assert (kind != "float32") == ops._has_avx512
    has_dot = bool(capabilities.cpu_flags().intersection(capabilities.INT8_DOT_FLAGS))
    assert (kind == "int8 dot product") == (ops._has_avx512 and has_dot)


def test_hqq_compiled_backend_is_whether_hqq_aten_imports():
    try:
        import hqq_aten  # noqa: F401
        importable = True
    except ImportError:
        importable = False
    assert capabilities.hqq_compiled_backend() == importable


def test_int8_plan_notes_the_missing_int8_kernel_on_this_cpu():
    step = transformdsl.plan(tiny_llama(), "quantize int8").steps[0]
    if capabilities.cpu_int8_matmul() == "int8 dot product":
        assert step.device_note is None
    else:
        assert step.device_note == device_notes.int8_note("cpu")
        assert "weight_only=true" in step.device_note  # the faster alternative is named
        assert f"device: {step.device_note}" in str(step_plan := transformdsl.plan(tiny_llama(), "quantize int8"))
        assert step_plan.to_json()["steps"][0]["device_note"] == step.device_note
    weight_only = transformdsl.plan(tiny_llama(), "quantize int8 weight_only=true").steps[0]
    bf16 = transformdsl.plan(tiny_llama().to(torch.bfloat16), "quantize int8 weight_only=true").steps[0]
    if kernels.available():  # our row kernel decodes every float dtype, float32 activations: said, whatever the dtype
        for step in (weight_only, bf16):
            assert "row kernel" in step.device_note and kernels.status() in step.device_note


def test_weight_only_int8_notes_where_aten_kernels_decode(aten_kernels):
    weight_only = transformdsl.plan(tiny_llama(), "quantize int8 weight_only=true").steps[0]
    bf16 = transformdsl.plan(tiny_llama().to(torch.bfloat16), "quantize int8 weight_only=true").steps[0]
    assert bf16.device_note is None  # bfloat16 activations: aten's packed kernel decodes
    if "int8" in capabilities.packed_cpu_kernels():  # float32 activations are rounded to bfloat16 for it: said
        assert "activations rounded to bfloat16 inside the layer" in weight_only.device_note
        half = transformdsl.plan(tiny_llama().to(torch.float16), "quantize int8 weight_only=true").steps[0]
        assert "model.to(torch.bfloat16)" in half.device_note  # float16 cannot use it: said, with the fix


def test_hqq_and_fp8_native_note_their_fallbacks_on_a_cpu():
    hqq = transformdsl.plan(tiny_flux(), "quantize hqq group_size=16").steps[0]
    assert hqq.device_note == device_notes.hqq_note("cpu")
    assert "hqq_aten" in hqq.device_note and "CUDA only" in hqq.device_note
    native = transformdsl.plan(tiny_flux().to(torch.bfloat16), "fp8 native").steps[0]
    assert native.device_note.startswith("fallback: cpu has no fp8 matmul")
    storage = transformdsl.plan(tiny_flux().to(torch.bfloat16), "fp8 storage").steps[0]
    assert storage.device_note is None  # fp8 storage upcasts by design, on every device


def test_a_model_on_the_meta_device_gets_no_device_note():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    assert transformdsl.plan(model, "fp8 native").steps[0].device_note is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_tensor_cores_follow_the_compute_capability():
    major, minor = torch.cuda.get_device_capability(0)
    assert capabilities.cuda_fp8_matmul(0) == ((major, minor) >= (8, 9) and torch.version.hip is None)


def test_transform_logs_each_device_note_once(caplog, monkeypatch):
    monkeypatch.setattr(executor, "_LOGGED_DEVICE_NOTES", set())
    received = []
    with caplog.at_level(logging.WARNING, logger="transformdsl"):
        for _ in range(2):
            transformdsl.transform(nn.Sequential(nn.Linear(64, 64)), "quantize hqq group_size=16",
                                   log=received.append)
    with caplog.at_level(logging.WARNING, logger="transformdsl"):
        for _ in range(2):
            transformdsl.transform(nn.Sequential(nn.Linear(64, 64)), "quantize hqq group_size=16")
    warned = [r.getMessage() for r in caplog.records if r.name == "transformdsl"]
    assert warned == [f"line 1: quantize hqq: device: {device_notes.hqq_note('cpu')}"]  # once
    # log= (the command line's summary lines) gets it at every call, and the logger then stays quiet.
    assert received.count(f"line 1: quantize hqq: device: {device_notes.hqq_note('cpu')}") == 2


def test_quoted_figures_are_the_benchmark_rows():
    """measured.json is what benchmarks/report.py copied from results/run.json, by the kind of CPU
    each run was measured on: each figure still in run.json is ours ÷ the original model of the
    same run, as RESULTS.md prints it; a note quotes this kind of CPU's figure first."""
    kinds = capabilities.measured()
    if not kinds:
        pytest.skip("no measured.json (benchmarks/run.py writes it)")
    data = json.loads((ROOT / "benchmarks" / "results" / "run.json").read_text())
    rows = data["rows"]
    cpu_of_run = {r["measured_at"]: r.get("cpu") for r in data["meta"]["runs"]}
    checked = 0
    for kind, entry in kinds.items():
        assert capabilities.cpu_kind(entry["cpu"]) == kind
        assert set(entry["rows"]) <= {f"{w} | {c}" for w, c in capabilities.CITED}
        for key, figure in entry["rows"].items():
            if figure["measured_at"] not in cpu_of_run:
                continue  # its run's rows were all measured again since (on this kind of CPU or another)
            assert capabilities.cpu_kind(cpu_of_run[figure["measured_at"]]) == kind
            workload, comparison = key.split(" | ")
            ours = next(r for r in rows if (r["workload"], r["comparison"], r["side"]) == (
                workload, comparison, "transformdsl"))
            anchor = next((r for r in rows if (r["workload"], r["comparison"], r["side"]) == (
                workload, comparison, UNCHANGED_LABEL) and r.get("duel")), None)
            if anchor:  # ours and the unchanged model called in turn in one process
                expected = anchor["duel"]["ratio"]
            else:
                original = next(r for r in rows if r["workload"] == workload and r["side"] == "original"
                                and r.get("run") == ours.get("run"))
                expected = ours["latency_s"] / original["latency_s"]
            assert figure["latency_vs_original"] == round(expected, 3)
            if kind == capabilities.cpu_kind():
                assert f"{figure['latency_vs_original']:.2f}× fp32 latency ({workload}, '{comparison}' row" in (
                    capabilities.measured_latency(workload, comparison))
            checked += 1
    assert checked


def test_a_note_quotes_int8_figures_of_its_own_kind_of_cpu_only(monkeypatch):
    """bitsandbytes' int8 costs 0.56x fp32 latency with VNNI and ~36x without: a figure measured on
    one kind of CPU is never quoted as the cost on another."""
    kinds = capabilities.measured()
    if not kinds:
        pytest.skip("no measured.json (benchmarks/run.py writes it)")
    for kind in [*kinds, "int_mm without int8 dot product"]:
        monkeypatch.setattr(capabilities, "cpu_kind", lambda cpu=None, kind=kind: kind)
        quote = capabilities.measured_latency("flux-medium", "quantize int8")
        row = (kinds.get(kind) or {}).get("rows", {}).get("flux-medium | quantize int8")
        if row is None:
            assert quote is None
        else:
            assert quote.startswith(f"{row['latency_vs_original']:.2f}× fp32") and quote.cpu == kinds[kind]["cpu"]


@pytest.mark.parametrize("flags, compute, noted", [
    ({"avx512f", "avx512_bf16"}, "float32", True),
    ({"avx512f", "amx_bf16"}, "float32", True),
    ({"avx512f", "avx512_bf16"}, "bfloat16", False),
    ({"avx2", "avx512_vnni"}, "float32", False),
])
def test_four_bit_note_points_bf16_cpus_to_bf16_compute(monkeypatch, flags, compute, noted):
    """On a CPU with bf16 dot products, 4-bit layers computing in float32 leave them unused: the plan
    says so, with this kind of CPU's figures when the benchmarks measured it; nowhere else."""
    monkeypatch.setattr(capabilities, "cpu_flags", lambda: frozenset(flags))
    note = device_notes.four_bit_note("cpu", compute)
    assert (note is not None) == noted
    if noted:
        assert "'compute=bfloat16' multiplies in bfloat16" in note
    assert device_notes.four_bit_note("cuda", compute) is None


def test_importing_capabilities_imports_no_torch():
    code = ("import sys; import transformdsl.capabilities as c; c.cpu_flags(); c.measured(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
