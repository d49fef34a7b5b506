"""Planning speed: ``transformdsl.plan`` on a model of over 1,000 modules must take well under 100 ms.

The model is a ``FluxTransformer2DModel`` with Flux.1's depth (19 double-stream and 38
single-stream blocks) and the tiny built-in's widths (random weights, a few MB).  Planning
validates the script, takes one snapshot of the module tree and resolves every statement
against it; nothing is executed.  The baseline is the bare ``named_modules()`` walk that any
planner has to do.

    .venv/bin/python benchmarks/bench_plan.py            # writes benchmarks/results/plan.md
    .venv/bin/python benchmarks/bench_plan.py --profile  # and prints where the time goes
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not an installed copy

from common import header, table, write  # noqa: E402

#: The brief's script, with quantize scoped to the single-stream blocks: as written in the brief
#: (`quantize int8 except norm` over the whole model) it conflicts with `fp8 native` on the
#: double-stream blocks, which is a planning error (one weight format per module).
SCRIPT = """\
fuse qkv in *Attention
quantize int8 in single_transformer_blocks.* except norm
fp8 native Linear in transformer_blocks.*
compile fullgraph=false
"""
LAYERS = {"num_layers": 19, "num_single_layers": 38}
BUDGET_MS = 100.0


def build_model():
    import torch
    from diffusers import FluxTransformer2DModel

    from transformdsl.models import FLUX_CONFIG

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FluxTransformer2DModel(**{**FLUX_CONFIG, **LAYERS}).eval()


def timings(fn, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU milliseconds of each run (CPU time leaves out waiting for a busy machine's cores)."""
    fn()  # warm-up (imports, lru caches)
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        cpu.append((time.process_time() - start_cpu) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of planning")
    args = parser.parse_args(argv)

    import torch

    import transformdsl
    from transformdsl.tree import ModuleTree
    from transformdsl.validate import check_text

    model = build_model()
    modules = sum(1 for _ in model.modules())
    parameters = sum(p.numel() for p in model.parameters())
    plan = transformdsl.plan(model, SCRIPT)
    validated = check_text(SCRIPT)
    no_qkv = check_text(SCRIPT.replace("fuse qkv in *Attention\n", ""))

    rows = []
    measured = {
        "`named_modules()` walk (baseline)": lambda: sum(1 for _ in model.named_modules()),
        "parse + validate the script": lambda: check_text(SCRIPT),
        "snapshot (`ModuleTree.of`)": lambda: ModuleTree.of(model),
        "**plan(model, script)** (all of the above, resolved)": lambda: transformdsl.plan(model, SCRIPT),
        "plan(model, validated script)": lambda: transformdsl.plan(model, validated),
        "plan without the `fuse qkv` line (its pass's planning hooks)": lambda: transformdsl.plan(model, no_qkv),
    }
    medians, cpu_medians = {}, {}
    for what, fn in measured.items():
        wall, cpu = timings(fn, args.repeats)
        medians[what], cpu_medians[what] = statistics.median(wall), statistics.median(cpu)
        rows.append({"what": what, "median ms": f"{medians[what]:.2f}", "min ms": f"{min(wall):.2f}",
                     "max ms": f"{max(wall):.2f}", "CPU ms (median)": f"{cpu_medians[what]:.2f}"})
    walk = medians["`named_modules()` walk (baseline)"]
    for row, what in zip(rows, measured):
        row["× walk"] = f"{medians[what] / walk:.1f}"
    full = medians["**plan(model, script)** (all of the above, resolved)"]
    full_cpu = cpu_medians["**plan(model, script)** (all of the above, resolved)"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    steps = "\n".join(f"- line {s.statement.line} `{s.text(plan.script.source)}`: {len(s.targets)} module(s)"
                      + (f", {len(s.overridden)} left to another line" if s.overridden else "")
                      for s in plan.steps)
    text = (
        header("Planning speed") + "\n"
        f"Model: `FluxTransformer2DModel` with Flux.1's depth ({LAYERS['num_layers']} double-stream, "
        f"{LAYERS['num_single_layers']} single-stream blocks) and the tiny built-in's widths: "
        f"**{modules} modules**, {parameters / 1e6:.1f} M parameters.  Median of {args.repeats} runs after a "
        f"warm-up, {torch.get_num_threads()} torch threads.\n\n"
        "Script:\n\n```tfm\n" + SCRIPT + "```\n\n"
        "Plan (what was resolved):\n\n" + steps + "\n\n"
        + table(rows, ["what", "median ms", "min ms", "max ms", "CPU ms (median)", "× walk"]) + "\n\n"
        f"Budget: {BUDGET_MS:.0f} ms; planning took **{full:.1f} ms** wall ({full / BUDGET_MS:.0%} of it; "
        f"{full_cpu:.1f} ms of CPU), {full / walk:.0f}× the bare walk.  Load average during the run: "
        f"{load:.1f} on {os.cpu_count()} cores (wall times grow with it; CPU times much less).\n\n"
        "Command: `.venv/bin/python benchmarks/bench_plan.py`\n"
    )
    write("plan.md", text)

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            transformdsl.plan(model, SCRIPT)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    return 0 if full < BUDGET_MS else 1


if __name__ == "__main__":
    raise SystemExit(main())
