"""How long ``tune`` takes on the built-in Llama and Flux with every mode the registry declares.

    .venv/bin/python benchmarks/bench_tune_builtins.py     # writes benchmarks/results/tune_builtins.md

The built-in models are the real transformers/diffusers classes from small configs with random
weights, so the figures are the search's cost (per-layer pass, knapsack, whole-model evaluations),
not what a trained model would pick: the budget is the relative RMS of the output (``max_rms``) on
the model's own sample inputs, as ``transformdsl tune --model llama --max-rms 0.05`` runs it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import cpu_model, header, table, write  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import models  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rms", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    started = time.time()
    for name, build in (("llama", models.tiny_llama), ("flux", models.tiny_flux)):
        for goal in ("size", "latency"):
            model = build()
            t0 = time.perf_counter()
            result = transformdsl.tune(model, max_rms=args.max_rms, goal=goal, rounds=args.rounds)
            seconds = time.perf_counter() - t0
            print(name, goal, f"{seconds:.0f} s", result, flush=True)
            chosen = result.chosen
            rows.append({
                "model": f"built-in {name}", "goal": goal,
                "modes x layers": f"{len(result.modes)} x {result.layers} ({len(result.pruned)} pruned)",
                "whole-model evaluations": result.evaluations,
                "pick": chosen.summary() if chosen is not None else "-",
                "rms (measured)": f"{result.value:.4f}" if result.value is not None else "-",
                "size ×": f"{result.size_ratio:.3f}" if result.size_ratio is not None else "-",
                "latency ×": result.latency.text() if result.latency is not None else "-",
                "tune time": f"{seconds:.0f} s",
            })
    text = (header("tune on the built-in models: its cost") +
            f"\nCPU: {cpu_model()}, {torch.get_num_threads()} torch threads.  Command: `.venv/bin/python "
            f"benchmarks/bench_tune_builtins.py --max-rms {args.max_rms} --rounds {args.rounds}` "
            f"({time.time() - started:.0f} s in all, imports excluded).\n\n"
            "Every mode the registry declares (the planner prunes what does not apply), budget relative RMS "
            f"<= {args.max_rms} on the model's own sample inputs (random weights and inputs: the figures are the "
            "search's cost, not a recommendation); with goal latency, tune also tries `fuse qkv` and `compile` on "
            "its pick.\n\n" + table(rows, list(rows[0])) + "\n")
    write("tune_builtins.md", text)


if __name__ == "__main__":
    main()
