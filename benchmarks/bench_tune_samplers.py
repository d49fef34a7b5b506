"""Why tune's search is its own knapsack and not one of optuna's samplers: the same budget, the same
modes, the same model and data, given the same wall time.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tune_samplers.py [--max-kl 0.05] [--times 4]

On the trained LM of the tests (``tests/trained/``, float32, 8 windows of 128 tokens, the last 2 held
out as tune holds them out), in one process:

1. ``transformdsl.tune(goal="size", max_kl=...)`` (its per-layer pass, the knapsack, its whole-model
   checks), timed: ``T`` seconds;
2. for each of optuna's TPE (with constraints), NSGA-II (with constraints) and random samplers, a study
   of ``--times`` x ``T`` seconds whose trial chooses, for every layer tune measured, float or one of the
   modes tune measured on it (the same search space tune's knapsack chooses in), applies that choice
   as a script (``tune.script.write``: the script tune would write), and measures what tune's
   verification measures: KL on the held-out rows (worst row) and the saved bytes; minimise the saved
   size subject to KL <= the bound.

Every pick (tune's and each sampler's best within the bound, at ``T`` and at ``times x T``) is
re-measured by this script's own code, so the columns compare like with like.  Writes
``benchmarks/results/tune_samplers.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import RESULTS, header, table, write  # noqa: E402

import transformdsl  # noqa: E402
from tests import trained  # noqa: E402
from transformdsl.tune import script as script_writer  # noqa: E402
from transformdsl.tune.measure import cpu_name, saved_bytes  # noqa: E402
from transformdsl.verification import measure  # noqa: E402

FLOAT = "float"


def kl_of(model, reference, rows) -> float:
    with torch.no_grad():
        return max(measure("kl", r, model(x).logits) for r, x in zip(reference, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-kl", type=float, default=0.05)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--times", type=float, default=4.0, help="each sampler's wall time, in units of tune's")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.time()
    base = trained.load_model()
    rows = [trained.text_inputs(args.tokens, offset=i * args.tokens)[0][0] for i in range(args.rows)]
    held, fit = rows[-max(1, len(rows) // 4):], rows[:-max(1, len(rows) // 4)]
    with torch.no_grad():
        reference = [base(x).logits for x in held]
    float_bytes = saved_bytes(base)

    t0 = time.perf_counter()
    result = transformdsl.tune(base, max_kl=args.max_kl, goal="size", calibration=rows, rounds=1)
    tune_seconds = time.perf_counter() - t0
    print(f"tune: {tune_seconds:.0f} s, {result.chosen.summary() if result.chosen else '-'}", flush=True)

    # The search space tune's knapsack chose in: per layer, float or a mode measured on it.
    universes: dict[str, list[str]] = {}
    for candidate in result.uniform:
        for path, mode in candidate.chosen.items():
            universes.setdefault(mode, []).append(path)
    layers = sorted({p for paths in universes.values() for p in paths})
    choices = {p: [FLOAT] + sorted(m for m, paths in universes.items() if p in paths) for p in layers}
    calibrated = {m for m in universes if "method=" in m and "method=rtn" not in m}

    def measured(chosen: dict[str, str]) -> dict:
        text = script_writer.write(base, chosen, universes, [])
        model = copy.deepcopy(base)
        kwargs = {"calibration": fit} if any(m in calibrated for m in chosen.values()) else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if chosen:
                transformdsl.transform(model, text, **kwargs)
        return {"kl": kl_of(model, reference, held), "size": saved_bytes(model) / float_bytes, "script": text}

    tune_pick = measured(result.chosen.chosen if result.chosen else {})
    print("tune's pick re-measured:", {k: v for k, v in tune_pick.items() if k != "script"}, flush=True)

    samplers = {
        "TPE (constraints, multivariate)": lambda c: optuna.samplers.TPESampler(
            seed=args.seed, constraints_func=c, multivariate=True),
        "NSGA-II (constraints)": lambda c: optuna.samplers.NSGAIISampler(seed=args.seed, constraints_func=c),
        "random": lambda c: optuna.samplers.RandomSampler(seed=args.seed),
    }
    rows_out, runs = [], {}
    for name, make in samplers.items():
        def constraint(trial):
            return [trial.user_attrs["kl"] - args.max_kl]

        study = optuna.create_study(direction="minimize", sampler=make(constraint))
        log: list[dict] = []
        begin = time.perf_counter()

        def objective(trial, log=log, begin=begin):
            chosen = {p: trial.suggest_categorical(p, choices[p]) for p in layers}
            chosen = {p: m for p, m in chosen.items() if m != FLOAT}
            figures = measured(chosen)
            trial.set_user_attr("kl", figures["kl"])
            log.append({"t": time.perf_counter() - begin, "kl": figures["kl"], "size": figures["size"],
                        "chosen": chosen})
            return figures["size"]

        study.optimize(objective, timeout=args.times * tune_seconds, gc_after_trial=False)

        def best_by(limit: float, log=log):
            ok = [e for e in log if e["t"] <= limit and e["kl"] <= args.max_kl]
            return min(ok, key=lambda e: e["size"]) if ok else None

        at_t, at_end = best_by(tune_seconds), best_by(float("inf"))
        runs[name] = {"trials": len(log), "trials at T": sum(1 for e in log if e["t"] <= tune_seconds),
                      "within bound": sum(1 for e in log if e["kl"] <= args.max_kl),
                      "best at T": at_t and {k: at_t[k] for k in ("kl", "size")},
                      "best": at_end and {k: at_end[k] for k in ("kl", "size")}}
        print(name, runs[name], flush=True)
        again = measured(at_end["chosen"]) if at_end else None  # re-measured, as tune's pick is
        rows_out.append({
            "search": f"optuna {name}",
            "trials (at T / in all)": f"{runs[name]['trials at T']} / {runs[name]['trials']}",
            "within the bound": runs[name]["within bound"],
            "best size at T": f"{at_t['size']:.3f}×" if at_t else "none within the bound",
            f"best size at {args.times:g}T (KL)": f"{again['size']:.3f}× ({again['kl']:.4f})" if again else
            "none within the bound",
            "÷ tune's": f"{again['size'] / tune_pick['size']:.2f}×" if again else "-",
        })
    rows_out.insert(0, {"search": "tune (per-layer pass + knapsack)",
                        "trials (at T / in all)": f"{result.evaluations} whole-model evaluation(s) after "
                                                  f"{len(result.modes)} modes × {result.layers} layers one at a time",
                        "within the bound": "-", "best size at T": f"{tune_pick['size']:.3f}×",
                        f"best size at {args.times:g}T (KL)": f"{tune_pick['size']:.3f}× ({tune_pick['kl']:.4f})",
                        "÷ tune's": "1.00×"})
    command = ("PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tune_samplers.py "
               f"--max-kl {args.max_kl} --rows {args.rows} --tokens {args.tokens} --times {args.times:g}")
    text = (header("tune's knapsack against optuna's samplers (trained LM, goal size)") +
            f"\nCPU: {cpu_name()}.  Command: `{command}` ({time.time() - started:.0f} s; optuna "
            f"{optuna.__version__}, seed {args.seed}).\n\n"
            f"Budget: KL <= {args.max_kl} on the held-out rows (the last {len(held)} of {args.rows} windows of "
            f"{args.tokens} tokens, worst row); goal: the smallest saved size (tensor files ÷ the float model's). "
            f"T = tune's wall time here, {tune_seconds:.0f} s.  Each sampler searched the space tune's knapsack "
            f"searches ({len(layers)} layers, each float or one of the {len(universes)} modes tune measured on "
            "it: "
            f"{sum(len(c) for c in choices.values())} choices in all), each trial a whole script applied and "
            "measured (KL and saved bytes), for "
            f"{args.times:g}T.  Picks re-measured by this script.\n\n"
            + table(rows_out, list(rows_out[0])) + "\n\n### tune's script\n\n```\n" + tune_pick["script"] + "```\n")
    write("tune_samplers.md", text)
    (RESULTS / "tune_samplers.json").write_text(json.dumps(
        {"tune_seconds": tune_seconds, "tune": {k: tune_pick[k] for k in ("kl", "size")}, "samplers": runs},
        indent=1))


if __name__ == "__main__":
    main()
