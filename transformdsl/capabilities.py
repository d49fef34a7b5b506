"""What the hardware a model sits on can run fast, detected, never guessed from a device's name.

The plan's device notes (each family's own: ``transforms/quantize/device_notes.py``, fp8's
``device_note``) use it to say when the backend a statement chooses has no fast kernel on the
model's device, what that costs (a figure measured by the benchmarks, quoted with
:func:`measured_latency` and :func:`cited`, with the row it comes from) and what runs faster:

- **bitsandbytes int8** (``quantize int8``) multiplies int8 by int8.  On a CPU, bitsandbytes
  calls ``torch._int_mm`` when torch reports AVX-512, and that is fast only with int8 dot
  product instructions (``avx512_vnni``, ``avx_vnni``, ``amx_int8`` in ``/proc/cpuinfo``);
  without AVX-512 it multiplies in float32 after converting both sides.
- **fp8 native** needs fp8 tensor cores: CUDA compute capability 8.9+ (and not ROCm, whose
  fp8 formats differ).  Elsewhere its layers upcast their weights at each call.
- **hqq**'s compiled dequantize kernel is the ``hqq_aten`` extension (CUDA only); without it
  each layer dequantizes its whole weight in PyTorch at every call.

Detection reads ``/proc/cpuinfo``, ``torch.backends.cpu.get_cpu_capability()``,
``torch.cuda.get_device_capability()`` and whether ``hqq_aten`` can be imported (found, not
imported).  Importing this module imports no torch; the functions that need it import it.

The figures come from ``measured.json`` beside this file, which ``benchmarks/report.py`` writes
from the rows of its run (``benchmarks/RESULTS.md``, "Every configuration"): nothing here is
typed by hand.

>>> flags = cpu_flags()
>>> isinstance(flags, frozenset)
True
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: ``/proc/cpuinfo`` flags of int8 dot-product instructions (x86): what makes ``torch._int_mm`` fast.
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: ``/proc/cpuinfo`` flags of bfloat16 dot-product instructions (x86): a bf16 matmul then runs ~3-4x
#: faster than a float32 one (measured: 48x3072 @ 3072x3072, 3.0 ms against 11.2 ms, one thread).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: Where the benchmark figures the notes quote are kept (written by benchmarks/report.py).
MEASURED = Path(__file__).with_name("measured.json")
#: The RESULTS.md rows (workload, comparison) the notes quote; report.py copies exactly these.
CITED = (("flux-medium", "quantize int8"), ("flux-medium", "quantize int8 weight_only"),
         ("flux-medium", "quantize hqq"), ("flux-medium", "fp8 native"), ("flux-medium", "quantize nf4"),
         ("flux-medium", "quantize nf4 compute=bfloat16"))


# --------------------------------------------------------------------------- detection


#: Environment variable naming CPU flags to treat as absent (comma- or space-separated): how a test
#: or a benchmark sees what a CPU without them gets (the plan's notes, the kernels layers choose).
HIDE_FLAGS_ENV = "TRANSFORMDSL_HIDE_CPU_FLAGS"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``flags`` on x86, ``Features`` on Arm), less those hidden by
    :data:`HIDE_FLAGS_ENV` (:func:`hidden_cpu_flags`); empty when unknown."""
    hidden = os.environ.get(HIDE_FLAGS_ENV, "")
    flags = _proc_cpu_flags()
    return flags.difference(hidden.replace(",", " ").split()) if hidden.strip() else flags


@contextlib.contextmanager
def hidden_cpu_flags(*flags: str) -> Iterator[None]:
    """Within the block (and in subprocesses started in it) the CPU is seen without ``flags``:
    ``with hidden_cpu_flags(*INT8_DOT_FLAGS):`` plans and builds layers as on a CPU without int8
    dot products.  Layers built inside keep the kernel they chose."""
    previous = os.environ.get(HIDE_FLAGS_ENV)
    os.environ[HIDE_FLAGS_ENV] = " ".join(sorted({*(previous or "").replace(",", " ").split(), *flags}))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(HIDE_FLAGS_ENV, None)
        else:
            os.environ[HIDE_FLAGS_ENV] = previous


@functools.cache
def _proc_cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_capability() -> str:
    """The vector instruction set torch's CPU kernels were dispatched to (e.g. ``AVX2``, ``AVX512``)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def cpu_int8_matmul() -> str:
    """How bitsandbytes multiplies int8 on this CPU: ``"int8 dot product"`` (fast),
    ``"int_mm without int8 dot product"`` (AVX-512 without VNNI/AMX: slow) or
    ``"float32"`` (it converts both sides and multiplies in float32)."""
    if cpu_capability() != "AVX512":  # what bitsandbytes itself tests before it picks torch._int_mm
        return "float32"
    if cpu_flags().intersection(INT8_DOT_FLAGS):
        return "int8 dot product"
    return "int_mm without int8 dot product"


def cpu_int8_dot() -> bool:
    """Whether this CPU has int8 dot-product instructions (what makes ``torch._int_mm`` fast)."""
    return bool(cpu_flags().intersection(INT8_DOT_FLAGS))


def w8a8_kernel(device_type: str) -> str:
    """How ``quantize w8a8`` layers multiply on ``device_type``: ``"int_mm"`` (``torch._int_mm``,
    int32 accumulation: a CPU with int8 dot products, or CUDA) or ``"float"`` (the int8 values
    multiplied in float32: ``torch._int_mm`` without int8 dot products ran ~35x slower than fp32)."""
    if device_type == "cuda" or (device_type == "cpu" and cpu_int8_dot()):
        return "int_mm"
    return "float"


def packed_cpu_kernels() -> tuple[str, ...]:
    """The packed weight-only CPU kernels this torch has (``"int8"``: ``aten._weight_int8pack_mm``,
    ``"int4"``: ``aten._weight_int4pack_mm_for_cpu``); both are fast with bfloat16 activations only."""
    import torch

    ops = torch.ops.aten
    found = []
    if hasattr(ops, "_weight_int8pack_mm"):
        found.append("int8")
    if hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu"):
        found.append("int4")
    return tuple(found)


def cuda_fp8_matmul(index: int = 0) -> bool:
    """Whether CUDA device ``index`` has fp8 tensor cores (compute capability 8.9+, not ROCm)."""
    import torch

    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index) >= (8, 9)


@functools.cache
def hqq_compiled_backend() -> bool:
    """Whether hqq's compiled kernels (the ``hqq_aten`` extension) are installed."""
    return importlib.util.find_spec("hqq_aten") is not None


def cpu_bf16_matmul() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (``avx512_bf16``, ``amx_bf16``)."""
    return bool(cpu_flags().intersection(BF16_FLAGS))


def describe_cpu() -> dict[str, Any]:
    """This CPU, as the benchmark pages record it (what the figures were measured on)."""
    flags = cpu_flags()
    return {"capability": cpu_capability(), "int8_dot": sorted(flags.intersection(INT8_DOT_FLAGS)),
            "int8_matmul": cpu_int8_matmul(), "bf16_dot": sorted(flags.intersection(BF16_FLAGS))}


def cpu_kind(cpu: dict[str, Any] | None = None) -> str:
    """The kind of CPU figures are filed under: how int8 multiplies, and whether bf16 does natively
    (``"int8 dot product + bf16"``); ``cpu`` as :func:`describe_cpu` gives it (default: this one).
    Records made before bf16 was recorded count as without it."""
    if cpu is None:
        return cpu_int8_matmul() + (" + bf16" if cpu_bf16_matmul() else "")
    return str(cpu.get("int8_matmul")) + (" + bf16" if cpu.get("bf16_dot") else "")


# --------------------------------------------------------------------------- measured figures


@functools.cache
def measured() -> dict[str, Any]:
    """The benchmark figures the notes quote, by the kind of CPU they were measured on:
    ``{cpu_kind(): {"cpu": describe_cpu(), "rows": {...}}}`` (``{}`` when the file is
    missing or unreadable).  A figure measured on one kind of CPU says little about another
    (bitsandbytes' int8 runs at 0.56x fp32 latency with VNNI and ~36x without)."""
    try:
        data = json.loads(MEASURED.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    if isinstance(data.get("cpu"), dict) and isinstance(data.get("rows"), dict):  # one CPU (older files)
        return {cpu_kind(data["cpu"]): {"cpu": data["cpu"], "rows": data["rows"]}}
    by_cpu = data.get("by_cpu")
    return {k: v for k, v in by_cpu.items() if isinstance(v, dict)} if isinstance(by_cpu, dict) else {}


class Quote(str):
    """A quoted figure's text, with the CPU it was measured on."""

    cpu: dict


def _figure(workload: str, comparison: str, name: str) -> tuple[float, dict] | None:
    """``(value, cpu)`` of a figure measured on this kind of CPU, or None: a figure from another kind
    is never quoted (fp8 native's fallback costs 1.98x fp32 on AVX2 and 9.2x on AVX-512 with bf16)."""
    kinds = measured()
    entry = (kinds.get(cpu_kind()) or {}) if kinds else {}
    row = (entry.get("rows") or {}).get(f"{workload} | {comparison}", {})
    value = row.get(name) if isinstance(row, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), entry.get("cpu") or {}
    return None


def cpu_text(cpu: dict) -> str:
    """A CPU as :func:`describe_cpu` records it, in words: ``"an AVX512 CPU (avx512_vnni, avx512_bf16)"``."""
    dot = ", ".join([*(cpu.get("int8_dot") or []), *(cpu.get("bf16_dot") or [])]) or "no VNNI/AMX"
    return f"an {cpu.get('capability', '?')} CPU ({dot})"


def source(cpu: dict) -> str:
    """Where the quoted figures come from, and the CPU they were measured on."""
    return f"benchmarks/RESULTS.md, measured on {cpu_text(cpu)}"


def measured_latency(workload: str, comparison: str) -> Quote | None:
    """``"0.84× fp32 latency (flux-medium, 'quantize int8' row)"``, measured on this kind of CPU, or None.
    The row must be one of :data:`CITED`, the one list of them (``benchmarks/report.py`` copies exactly
    those): a note quoting another is a ``ValueError``, so the list and the notes cannot drift apart."""
    if (workload, comparison) not in CITED:
        raise ValueError(f"({workload!r}, {comparison!r}) is not in capabilities.CITED: add it there, so that "
                         "benchmarks/report.py copies its figure into measured.json")
    found = _figure(workload, comparison, "latency_vs_original")
    if found is None:
        return None
    quote = Quote(f"{found[0]:.2f}× fp32 latency ({workload}, '{comparison}' row)")
    quote.cpu = found[1]
    return quote


def cited(text: str, *figures: Quote | None) -> str:
    """``text``, with the source of its figures when it quotes any (all of this kind of CPU)."""
    quoted = [f for f in figures if f]
    return f"{text} [{source(quoted[0].cpu)}]" if quoted else text


__all__ = ["cpu_int8_dot", "w8a8_kernel", "packed_cpu_kernels", "hidden_cpu_flags", "HIDE_FLAGS_ENV", "cpu_flags",
           "cpu_capability", "cpu_int8_matmul", "cuda_fp8_matmul", "hqq_compiled_backend", "cpu_bf16_matmul",
           "cpu_kind", "cpu_text", "describe_cpu", "measured", "measured_latency", "cited", "Quote", "CITED",
           "INT8_DOT_FLAGS", "BF16_FLAGS"]
