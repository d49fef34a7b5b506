"""Eager vs whole compile vs regional compile vs fused elementwise, side by side.

For each built-in model, each variant is built from the same seed, transformed, and
called once (which is when torch.compile compiles: the compile time); then all variants
of the model are timed in interleaved rounds (the steady latency, median over rounds), as
ratios to eager, with the largest difference from the eager output.  A second table compares the original
model, ``quantize int8`` and ``fuse qkv; quantize int8; compile fullgraph=false`` (rows
for passes that have not landed say so).

Compile times are cold-cache, warm-process: every variant starts from cleared dynamo and
inductor caches and an empty inductor cache directory, after one throwaway compile that
pays the once-per-process start-up, so no variant is charged for it or reuses another's
kernels.

Times are reported as CPU time (this process and the compilers it waits for) as well as
wall time: on a shared machine the wall clock mostly measures the other tenants, while
CPU time does not.  For CPU time to mean compute, the benchmark runs torch with one
thread (``--threads``; OpenMP threads spin while they wait, which CPU time would count)
and inductor compiles in this process (``TORCHINDUCTOR_COMPILE_THREADS=1``).

    .venv/bin/python benchmarks/bench_compile.py                # all models, ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_compile.py --models llama --min-run-time 0.5

Writes ``benchmarks/results/compile.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.utils.benchmark as benchmark  # noqa: E402
from common import RESULTS, header  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import models, registry  # noqa: E402
from transformdsl.extend import Transform  # noqa: E402

#: The blocks ``compile regional`` compiles, per model.
BLOCKS = {"unet": "BasicTransformerBlock", "sd3": "*TransformerBlock", "flux": "*TransformerBlock",
          "llama": "*DecoderLayer", "gpt2": "GPT2Block"}
VARIANTS = {
    "eager": None,
    "whole compile": "compile",
    "regional compile": "compile regional in {blocks}",
    "fused elementwise": "fuse bias_act_dropout",
}
COMBINATION = {
    "original": None,
    "quantize int8": "quantize int8",
    "fuse qkv + int8 + compile": "fuse qkv; quantize int8; compile fullgraph=false",
}
COMBINATION_MODELS = ("llama", "unet")


@dataclass
class Row:
    model: str
    variant: str
    script: str | None
    first_call_s: float = float("nan")
    first_call_cpu_s: float = float("nan")
    steady_s: float = float("nan")
    steady_cpu_s: float = float("nan")
    max_diff: float = float("nan")
    graphs: int = 0
    note: str = ""


def landed(script: str) -> str | None:
    """The first statement of ``script`` whose pass is still a stub, if any."""
    for statement in transformdsl.parse(script):
        cls = registry.get(statement.key)
        if cls is None or cls.apply is Transform.apply:
            return statement.key
    return None


def cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (gcc, for inductor)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def steady(call, min_run_time: float) -> tuple[float, float]:
    """(median wall seconds per call, CPU seconds per call) over about ``2 * min_run_time``."""
    # num_threads: Timer defaults to 1 thread, which changes global state and recompiles.
    timer = benchmark.Timer(stmt="call()", globals={"call": call}, num_threads=torch.get_num_threads())
    wall = timer.blocked_autorange(min_run_time=min_run_time).median
    calls, started, deadline = 0, cpu_seconds(), time.perf_counter() + min_run_time
    while calls < 3 or time.perf_counter() < deadline:
        call()
        calls += 1
    return wall, (cpu_seconds() - started) / calls


def warm_up_inductor() -> None:
    """Pay inductor's once-per-process start-up (imports, compiler probing) outside the timings."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        torch.compile(lambda x: torch.nn.functional.gelu(x) * 2)(torch.randn(8))
    torch._dynamo.reset()


def prepare(row: Row) -> tuple[Callable[[], object], torch.Tensor]:
    """Build and transform the model, make the first (compiling) call; the steady call and the output."""
    from torch._inductor.utils import fresh_cache

    # An empty inductor cache per variant: no variant reuses another's kernels.  Dynamo's caches
    # are per code object, so the variants of one model do not share graphs either.
    with fresh_cache():
        model = models.BUILTIN[row.model]()
        if row.script is not None:
            transformdsl.transform(model, row.script)
        args, kwargs = models.sample_inputs(model)

        def call():
            with torch.no_grad():
                return model(*args, **kwargs)

        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        started, cpu = time.perf_counter(), cpu_seconds()
        output = models.run(model)  # the same inputs, and the output tensor
        row.first_call_s, row.first_call_cpu_s = time.perf_counter() - started, cpu_seconds() - cpu
        row.graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    return call, output


def measure_group(name: str, variants: dict[str, str | None], min_run_time: float, rounds: int) -> list[Row]:
    """All variants of one model: compiled one by one (cold), then timed in interleaved rounds
    (eager, whole, regional, fused, eager, ...) so that a change in the machine's load hits
    every variant alike; each figure is the median over the rounds."""
    torch._dynamo.reset()  # kernels compiled for the previous model are not reused
    rows, calls, reference = [], [], None
    for variant, script in variants.items():
        row = Row(name, variant, script)
        rows.append(row)
        if script is not None and (missing := landed(script)):
            row.note = f"'{missing}' has not landed"
            continue
        call, output = prepare(row)
        if reference is None:
            reference = output
        else:
            row.max_diff = (output.float() - reference.float()).abs().max().item()
        calls.append((row, call))
    samples: dict[int, list[tuple[float, float]]] = {id(row): [] for row, _ in calls}
    for _ in range(rounds):
        for row, call in calls:
            samples[id(row)].append(steady(call, min_run_time / rounds))
    for row, _ in calls:
        row.steady_s = statistics.median(wall for wall, _ in samples[id(row)])
        row.steady_cpu_s = statistics.median(cpu for _, cpu in samples[id(row)])
        report(row)
    return rows


def ratio(value: float, base: float) -> str:
    return "—" if value != value or base != base or base == 0 else f"{value / base:.2f}"


def number(value: float, digits: int = 2, scale: float = 1.0) -> str:
    return "—" if value != value else f"{value * scale:.{digits}f}"


def compile_cpu(row: Row) -> float:
    """CPU seconds the first call spent beyond an ordinary call: compiling."""
    return row.first_call_cpu_s - row.steady_cpu_s


def render(rows: list[Row], combination: list[Row], started: float, load: tuple[float, ...]) -> str:
    lines = [
        header("Compile and elementwise fusion: eager, whole, regional, fused"),
        f"Load average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f} (the machine was shared); "
        f"total {time.time() - started:.0f} s; `benchmarks/bench_compile.py`.",
        "",
        "- *compile (CPU s)*: CPU time of the first call after `transform()` (when torch.compile compiles; cold "
        "caches, warm process) minus one steady call; *wall* is the same first call on the wall clock.",
        "- *steady (CPU ms)*: CPU time per call once compiled; *wall ms*: median wall time "
        "(`torch.utils.benchmark.Timer`).  Ratios use CPU time, which other tenants of the machine do not inflate.",
        "- *graphs*: graphs dynamo captured on the first call; *max diff*: largest difference from the eager output.",
        "",
        "| model | variant | compile (CPU s) | compile × whole | first call wall (s) | steady (CPU ms) "
        "| steady × eager | wall ms | graphs | max diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_model: dict[str, dict[str, Row]] = {}
    for row in rows:
        by_model.setdefault(row.model, {})[row.variant] = row
    for name, variants in by_model.items():
        eager, whole = variants.get("eager"), variants.get("whole compile")
        for row in variants.values():
            compiled = row.script is not None
            lines.append(
                f"| {name} | {row.variant} | {number(compile_cpu(row)) if compiled else '—'} | "
                f"{ratio(compile_cpu(row), compile_cpu(whole)) if 'compile' in (row.script or '') and whole else '—'} | "
                f"{row.first_call_s:.2f} | {row.steady_cpu_s * 1e3:.2f} | "
                f"{ratio(row.steady_cpu_s, eager.steady_cpu_s) if eager else '—'} | {row.steady_s * 1e3:.2f} | "
                f"{row.graphs} | {'—' if row.max_diff != row.max_diff else f'{row.max_diff:.1e}'} |")
    if combination:
        lines += ["", "## Quantization combined with compilation", "",
                  "| model | variant | script | compile (CPU s) | steady (CPU ms) | steady × original | wall ms "
                  "| max diff |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        originals = {r.model: r for r in combination if r.variant == "original"}
        for row in combination:
            if row.note:
                lines.append(f"| {row.model} | {row.variant} | `{row.script}` | {row.note} | | | | |")
                continue
            base = originals.get(row.model)
            lines.append(f"| {row.model} | {row.variant} | `{row.script or ''}` | "
                         f"{number(compile_cpu(row)) if row.script else '—'} | "
                         f"{row.steady_cpu_s * 1e3:.2f} | {ratio(row.steady_cpu_s, base.steady_cpu_s) if base else '—'} "
                         f"| {row.steady_s * 1e3:.2f} | {'—' if row.max_diff != row.max_diff else f'{row.max_diff:.1e}'} |")
    return "\n".join(lines) + "\n"


def report(row: Row) -> None:
    print(f"{row.model:6} {row.variant:26} compile {compile_cpu(row):7.2f} CPU s (first call {row.first_call_s:6.2f} s "
          f"wall)  steady {row.steady_cpu_s * 1e3:8.2f} CPU ms ({row.steady_s * 1e3:8.2f} wall)  graphs {row.graphs}  "
          f"diff {row.max_diff:.1e} {row.note}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(BLOCKS), help="comma-separated built-in names")
    parser.add_argument("--min-run-time", type=float, default=2.0,
                        help="seconds of steady timing per variant, split over the rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (medians are reported)")
    parser.add_argument("--tables", default="variants,combination",
                        help="which tables: variants (eager/whole/regional/fused), combination (with quantize)")
    parser.add_argument("--out", type=Path, default=RESULTS / "compile.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.models.split(",")
    started, load = time.time(), os.getloadavg()
    warm_up_inductor()
    tables = args.tables.split(",")
    rows: list[Row] = []
    for name in names if "variants" in tables else []:
        variants = {v: (s.format(blocks=BLOCKS[name]) if s else None) for v, s in VARIANTS.items()}
        rows += measure_group(name, variants, args.min_run_time, args.rounds)
    combination: list[Row] = []
    for name in [m for m in COMBINATION_MODELS if m in names] if "combination" in tables else []:
        combination += measure_group(name, COMBINATION, args.min_run_time, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(rows, combination, started, load))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
