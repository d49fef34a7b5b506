"""``transformdsl tune`` against the best uniform script (one mode on every layer), on the trained LM.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_tune.py [--max-kl 0.05] [--rows 8] [--tokens 128]

Writes ``benchmarks/results/tune.md``, ``tune.json`` and the plots ``tune_size.png``/``tune_latency.png``.
The model is tests/trained/ (a small Llama trained here on Python's docs, byte-level) in float32;
the calibration data is ``--rows`` windows of ``--tokens`` held-out tokens, of which tune holds out
the last quarter to measure on.  Then, in this one process:

- ``tune(goal="size")`` and ``tune(goal="latency")`` with every mode the registry declares;
- every uniform script (each mode alone, default exclusions), applied with ``transformdsl.transform``
  and measured by this script's own code: KL on the same held-out rows (worst row), the bytes of the
  saved tensor files, and the latency against the float model, calls in turn (median of the rounds);
- tune's picks re-measured by the same code, so ``ours ÷ best uniform`` compares like with like.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import RESULTS, header, table, write  # noqa: E402

import transformdsl  # noqa: E402
from tests import trained  # noqa: E402
from transformdsl.tune.candidates import declared_modes  # noqa: E402
from transformdsl.tune.measure import cpu_name, saved_bytes  # noqa: E402
from transformdsl.verification import measure  # noqa: E402


def statements(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def kl_of(model, reference, rows) -> float:
    with torch.no_grad():
        return max(measure("kl", r, model(x).logits) for r, x in zip(reference, rows))


def latency(base, model, rows, rounds: int) -> float:
    def run(m):
        started = time.perf_counter()
        with torch.no_grad():
            for x in rows:
                m(x)
        return time.perf_counter() - started

    run(base), run(model)
    ratios = []
    for _ in range(rounds):
        before, after = run(base), run(model)
        ratios.append(after / before)
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-kl", type=float, default=0.05)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    started = time.time()
    base = trained.load_model()
    rows = [trained.text_inputs(args.tokens, offset=i * args.tokens)[0][0] for i in range(args.rows)]
    held = rows[-max(1, len(rows) // 4):]
    with torch.no_grad():
        reference = [base(x).logits for x in held]
    float_bytes = saved_bytes(base)

    def measured(script: str) -> dict:
        model = trained.load_model()
        if statements(script):
            transformdsl.transform(model, script, strict=True)  # a script that changes nothing is refused
        return {"kl": kl_of(model, reference, held), "size": saved_bytes(model) / float_bytes,
                "latency": latency(base, model, held, args.rounds)}

    results = {}
    for goal in ("size", "latency"):
        t0 = time.time()
        result = transformdsl.tune(base, max_kl=args.max_kl, goal=goal, calibration=rows, rounds=args.rounds)
        results[goal] = {"result": result, "seconds": time.time() - t0}
        result.plot(RESULTS / f"tune_{goal}.png")
    uniform = {}
    for mode in declared_modes():
        try:
            uniform[mode.text] = measured(mode.text)
        except Exception as exc:  # a mode that does not plan on this model
            uniform[mode.text] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    ok = {m: u for m, u in uniform.items() if "kl" in u and u["kl"] <= args.max_kl}
    best_size = min(ok.items(), key=lambda kv: kv[1]["size"]) if ok else None
    best_latency = min(ok.items(), key=lambda kv: kv[1]["latency"]) if ok else None
    picks = {goal: measured(results[goal]["result"].script) for goal in results}

    rows_out = []
    for goal, best, key in (("size", best_size, "size"), ("latency", best_latency, "latency")):
        result, pick = results[goal]["result"], picks[goal]
        rows_out.append({
            "goal": goal,
            "tune's pick": (result.chosen.summary() if result.chosen and result.chosen.chosen else
                            "no statement (the float model)") if result.chosen else "-",
            "KL (re-measured)": f"{pick['kl']:.4f}",
            "goal's figure (re-measured)": f"{key} {pick[key]:.3f}×",
            "best uniform within the bound": f"`{best[0]}`: KL {best[1]['kl']:.4f}, {key} {best[1][key]:.3f}x"
            if best else "none",
            "ours ÷ best uniform": f"{pick[key] / best[1][key]:.2f}×" if best else "-",
            "whole-model evaluations": result.evaluations,
            "tune time": f"{results[goal]['seconds']:.0f} s",
        })
    columns = list(rows_out[0])
    uniform_rows = [{"script": f"`{m}`", "KL": f"{u['kl']:.4g}" if "kl" in u else u["error"],
                     "size ×": f"{u['size']:.3f}" if "size" in u else "", "latency ×": f"{u['latency']:.2f}"
                     if "latency" in u else "", "within the bound": ("yes" if u.get("kl", 1e9) <= args.max_kl else "no")}
                    for m, u in uniform.items()]
    text = (header("tune against the best uniform script (trained LM)") +
            f"\nCPU: {cpu_name()}.  Command: `PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python "
            f"benchmarks/bench_tune.py --max-kl {args.max_kl} --rows {args.rows} --tokens {args.tokens}` "
            f"({time.time() - started:.0f} s).\n\n"
            f"Budget: KL <= {args.max_kl} on the held-out rows (the last {len(held)} of {args.rows} windows of "
            f"{args.tokens} tokens); every figure re-measured by this script on the same rows: sizes are the saved "
            "tensor files ÷ the float model's; latency the median ratio of calls in turn with the float model, "
            f"{args.rounds} rounds, one process (timing noise on a shared machine: ±20%).\n\n"
            + table(rows_out, columns) + "\n\n### Every uniform script\n\n"
            + table(uniform_rows, ["script", "KL", "size ×", "latency ×", "within the bound"]) + "\n\n"
            + "### tune's scripts\n\n" + "\n".join(f"goal {g}:\n\n```\n{results[g]['result'].script}```\n"
                                                   for g in results)
            + "\n### tune's Pareto table (goal size)\n\n```\n" + results["size"]["result"].table() + "\n```\n")
    write("tune.md", text)
    (RESULTS / "tune.json").write_text(json.dumps({"rows": rows_out, "uniform": uniform}, indent=1))


if __name__ == "__main__":
    main()
