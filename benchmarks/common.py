"""Shared helpers for the benchmark scripts: timing, machine header, markdown tables."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds, warm-up runs excluded."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def header(title: str, measured_at: float | None = None, threads: int | None = None) -> str:
    """Title, when and where it was measured (``measured_at``: a Unix time, default now; ``threads``:
    the torch threads the measurements used, default this process's), library versions."""
    import torch

    versions = []
    for name in ("torch", "diffusers", "transformers", "safetensors", "bitsandbytes", "hqq"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(measured_at))
    return (f"# {title}\n\nMeasured {when} on {cpu}, "
            f"{os.cpu_count()} cores, {threads or torch.get_num_threads()} torch threads; {', '.join(versions)}.\n"
            "Every figure below is written by the script that measured it.\n")


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), or what :mod:`platform` says where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def write(name: str, text: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    print(text)
    print(f"\nwritten to {path}")
    return path
