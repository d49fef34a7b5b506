"""Planning speed: ``transformdsl.plan`` on models of over 1,000 modules must take well under 100 ms,
for every kind of statement.

Models (random weights at the corpus' tiny widths, a few MB each; tests/zoo/ holds their configs):

- ``Flux.1 depth``: ``FluxTransformer2DModel`` with Flux.1's 19 double-stream and 38 single-stream
  blocks (1,275 modules), planned with the brief's four-statement script and each statement alone;
- ``Wan 40 layers``: the corpus' ``WanTransformer3DModel`` at Wan2.1-14B's depth, a model that
  *declares* modules (``_keep_in_fp32_modules``, ``_skip_layerwise_casting_patterns``): the
  ``declared_exclusions`` rows time what honouring those declarations costs;
- ``Llama 96 layers``: the corpus' ``LlamaForCausalLM`` at 96 layers (1,255 modules), where
  planning ``fuse qkv`` once took 2.8-4.8 s (issue 11, defect 10);
- the corpus' largest model by module count, at its tester size (:data:`CORPUS_LARGEST`).

Planning validates the script, takes one snapshot of the module tree and resolves every statement
against it; nothing is executed.  The baseline is the bare ``named_modules()`` walk that any planner
has to do.  Wall times grow with the load of a shared machine; the verdict uses CPU time.  One torch
thread by default (``--threads``): ``fuse bias_*`` runs a tiny probe forward per match while planning,
and OpenMP threads spinning on a busy 2-core machine made those probes 100x slower (10 s for one plan).

    .venv/bin/python benchmarks/bench_plan.py            # writes results/plan.md and results/plan.json
    .venv/bin/python benchmarks/bench_plan.py --profile  # and prints where the time goes (Flux script)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not an installed copy

from common import RESULTS, header, table, write  # noqa: E402

#: The brief's script, with quantize scoped to the single-stream blocks: as written in the brief
#: (`quantize int8 except norm` over the whole model) it conflicts with `fp8 native` on the
#: double-stream blocks, which is a planning error (one weight format per module).
SCRIPT = """\
fuse qkv in *Attention
quantize int8 in single_transformer_blocks.* except norm
fp8 native Linear in transformer_blocks.*
compile fullgraph=false
"""
#: One statement of every kind (each planned alone, default targets and exclusions).
STATEMENTS = ("fuse qkv", "quantize int8", "quantize nf4", "quantize hqq group_size=auto", "fp8 storage",
              "fp8 native", "compile", "compile regional in {blocks}", "fuse bias_act_dropout",
              "fuse bias_dropout_residual", "fuse bias_dropout_residual_layernorm")
#: The repeated blocks ``compile regional`` needs named, per model.
BLOCKS = {"Flux.1 depth": "transformer_blocks.*, single_transformer_blocks.*", "Wan 40 layers": "blocks.*",
          "Llama 96 layers": "model.layers.*"}
LAYERS = {"num_layers": 19, "num_single_layers": 38}
#: The corpus model with the most modules at its tester size (counted over tests/zoo/ on 2026-12-01).
CORPUS_LARGEST = "diffusers/UNetSpatioTemporalConditionModel"
BUDGET_MS = 100.0


def build_model():
    """Flux.1's depth at the built-in tiny Flux's widths (kept for callers of this module)."""
    import torch
    from diffusers import FluxTransformer2DModel

    from transformdsl.models import FLUX_CONFIG

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FluxTransformer2DModel(**{**FLUX_CONFIG, **LAYERS}).eval()


def _corpus(model_id: str, **deeper):
    """A corpus model, with its init kwargs / config overridden by ``deeper`` (more layers)."""
    import copy

    from tests.zoo import corpus

    entry = copy.deepcopy(corpus.entry(model_id))
    entry["init" if entry["library"] == "diffusers" else "config"].update(deeper)
    return corpus.build(entry)[0]


def models() -> dict[str, object]:
    return {
        "Flux.1 depth": build_model,
        "Wan 40 layers": lambda: _corpus("diffusers/WanTransformer3DModel", num_layers=40),
        "Llama 96 layers": lambda: _corpus("transformers/Llama", num_hidden_layers=96),
        f"{CORPUS_LARGEST.split('/', 1)[1]} (corpus' largest)": lambda: _corpus(CORPUS_LARGEST),
    }


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


def _row(model: str, modules: int, what: str, fn, repeats: int, note: str = "") -> dict:
    wall, cpu = timings(fn, repeats)
    return {"model": model, "modules": modules, "what": what, "median ms": round(statistics.median(wall), 2),
            "max ms": round(max(wall), 2), "CPU ms": round(statistics.median(cpu), 2), "note": note}


def _plan_row(model_name: str, model, modules: int, script: str, repeats: int) -> dict:
    import transformdsl
    from transformdsl.errors import ScriptError

    try:
        plan = transformdsl.plan(model, script)
    except ScriptError as exc:  # e.g. nothing of that kind in the model: planning still did its work
        note = "error: " + str(exc).splitlines()[0][:80]
    else:
        note = f"{sum(len(s.targets) for s in plan.steps)} module(s)"

    def fn():
        try:
            transformdsl.plan(model, script)
        except ScriptError:
            pass

    return _row(model_name, modules, f"`{script.strip().replace(chr(10), '; ')}`", fn, repeats, note)


def measure_model(name: str, model, repeats: int) -> list[dict]:
    """Every row of one model: the walk, the snapshot, the declarations, each statement planned."""
    from transformdsl.declarations import KNOWN, declared_exclusions
    from transformdsl.tree import ModuleTree
    from transformdsl.validate import check_text

    modules = sum(1 for _ in model.modules())
    tree = ModuleTree.of(model)
    found = declared_exclusions(tree, KNOWN)
    rows = [
        _row(name, modules, "`named_modules()` walk (baseline)", lambda: sum(1 for _ in model.named_modules()),
             repeats),
        _row(name, modules, "snapshot (`ModuleTree.of`)", lambda: ModuleTree.of(model), repeats),
        _row(name, modules, "`declared_exclusions` (every declaration, on the snapshot)",
             lambda: declared_exclusions(tree, KNOWN), repeats,
             f"{len(found)} declaration(s), {sum(len(p) for _, p in found)} module(s)"),
    ]
    if name == "Flux.1 depth":
        rows.append(_row(name, modules, "parse + validate the brief's script", lambda: check_text(SCRIPT), repeats))
        rows.append(_plan_row(name, model, modules, SCRIPT, repeats))
    for statement in STATEMENTS:
        statement = statement.format(blocks=BLOCKS.get(name, "down_blocks.*, up_blocks.*"))
        rows.append(_plan_row(name, model, modules, statement, repeats))
    if found:
        rows.append(_plan_row(name, model, modules, "fp8 storage default_except=false", repeats))
    return rows


def measure(repeats: int) -> list[dict]:
    rows = []
    for name, build in models().items():
        rows += measure_model(name, build(), repeats)
    return rows


#: Scripts whose planning once grew faster than statements x modules (issue 36): each repeated n times.
CURVE_SCRIPTS = {"quantize int8 (conflicting)": "quantize int8",
                 "attention native in transformer_blocks.0.attn (conflicting)":
                     "attention native in transformer_blocks.0.attn",
                 "quantize int8 in nothing{i} (matching nothing)": "quantize int8 in nothing{i}"}
CURVE_COUNTS = (1, 4, 16, 64, 256)
CURVE_MODULES = (1000, 2500, 5000, 10000)


def _cpu_plan(model, script: str) -> float:
    """CPU seconds of one plan (a ScriptError is an outcome: conflicts are what is measured)."""
    import transformdsl

    started = time.process_time()
    try:
        transformdsl.plan(model, script)
    except transformdsl.ScriptError:
        pass
    return time.process_time() - started


def curve() -> str:
    """Planning time against the number of statements (the built-in Flux) and of modules (a stack of
    ``Linear(16, 16)`` with ``quantize w8a8`` twice): the page ``results/plan_curve.md``."""
    import torch

    from transformdsl import models

    flux = models.tiny_flux()
    rows = []
    for name, line in CURVE_SCRIPTS.items():
        row = {"script (repeated n times), built-in Flux": f"`{name}`"}
        for n in CURVE_COUNTS:
            row[f"n={n}"] = f"{_cpu_plan(flux, chr(10).join(line.format(i=i) for i in range(n))) * 1000:.0f}"
        rows.append(row)
    sizes = {"modules": "`quantize w8a8` twice (conflicting)"}
    single = {"modules": "`quantize w8a8` once"}
    for count in CURVE_MODULES:
        stack = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(count)])
        sizes[str(count)] = f"{_cpu_plan(stack, 'quantize w8a8' + chr(10) + 'quantize w8a8') * 1000:.0f}"
        single[str(count)] = f"{_cpu_plan(stack, 'quantize w8a8') * 1000:.0f}"
    return (header("Planning against script length and model size") + "\n"
            "CPU ms of one `transformdsl.plan` (a conflict is a `ScriptError` whose hints are checked by planning "
            "edited scripts: those plans share one budget, a few times the plan's own work).  Before issue 36, "
            "32 repeated `quantize int8` took 8.3 s and 255 `attention` lines 85-93 s on the built-in Flux, and "
            "`quantize w8a8` twice over 10,000 linears 50.6 s.\n\n"
            + table(rows, ["script (repeated n times), built-in Flux"] + [f"n={n}" for n in CURVE_COUNTS]) + "\n\n"
            + table([single, sizes], ["modules"] + [str(c) for c in CURVE_MODULES]) + "\n\n"
            "Command: `.venv/bin/python benchmarks/bench_plan.py --curve`\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the probes some passes run while planning are tiny "
                             "matmuls, and OpenMP threads spinning on a shared machine would time the machine)")
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of planning")
    parser.add_argument("--curve", action="store_true", help="only the curve against script length and model "
                        "size (writes results/plan_curve.md)")
    args = parser.parse_args(argv)

    import torch

    import transformdsl

    torch.set_num_threads(args.threads)
    if args.curve:
        write("plan_curve.md", curve())
        return 0
    rows = measure(args.repeats)
    plans = [r for r in rows if r["what"].startswith("`") and not r["what"].startswith(("`named", "`declared"))]
    worst = max(plans, key=lambda r: r["CPU ms"])
    worst_wall = max(plans, key=lambda r: r["median ms"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary = {
        "budget_ms": BUDGET_MS,
        "models": sorted({(r["model"], r["modules"]) for r in rows}, key=lambda m: -m[1]),
        "worst_cpu": worst, "worst_wall": worst_wall, "met": worst["CPU ms"] < BUDGET_MS,
        "repeats": args.repeats, "threads": args.threads, "load": load, "measured_at": time.time(), "rows": rows,
    }
    (RESULTS / "plan.json").write_text(json.dumps(summary, indent=1) + "\n")

    text = (
        header("Planning speed") + "\n"
        "Every kind of statement planned alone (default targets and exclusions), and the brief's script, on "
        "models of over 1,000 modules and on the corpus' largest; median of "
        f"{args.repeats} runs after a warm-up, {torch.get_num_threads()} torch threads.  `declared_exclusions` "
        "is what honouring the models' own declarations (`_keep_in_fp32_modules`, "
        "`_skip_layerwise_casting_patterns`) costs on a snapshot; `fp8 storage default_except=false` plans "
        "without it.  The brief's script:\n\n```tfm\n" + SCRIPT + "```\n\n"
        + table(rows, ["model", "modules", "what", "median ms", "max ms", "CPU ms", "note"]) + "\n\n"
        f"Budget: {BUDGET_MS:.0f} ms per plan.  Slowest plan: **{worst['CPU ms']:.1f} ms of CPU** "
        f"({worst['what']} on {worst['model']}, {worst['modules']} modules; {worst['median ms']:.1f} ms wall); "
        f"slowest wall time {worst_wall['median ms']:.1f} ms ({worst_wall['what']} on {worst_wall['model']}).  "
        f"Load average during the run: {load:.1f} on {os.cpu_count()} cores (wall times grow with it; CPU "
        "times much less).\n\n"
        "Command: `.venv/bin/python benchmarks/bench_plan.py` (raw rows: `results/plan.json`)\n"
    )
    write("plan.md", text)

    if args.profile:
        model = build_model()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            transformdsl.plan(model, SCRIPT)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    return 0 if summary["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
