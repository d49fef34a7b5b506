"""Calibration's activations in memory against an unlinked temporary file (``calibrate ... activations=``).

    .venv/bin/python benchmarks/bench_activations.py     # writes benchmarks/results/calibration_activations.md

A Llama built from a config whose hidden states are wide against its blocks (random float32 weights:
the figures are memory and time, not quality), calibrated by GPTQ (int8 weight-only) on N samples of
512 random token ids, each way in a fresh process: ``activations=memory`` (every sample's inputs to a
block, and the next block's, in memory), ``activations=disk`` (written to a temporary file and read
back memory-mapped).  The figure that matters is the peak of anonymous memory (``RssAnon``, sampled
every 5 ms above its value before the transform): what the system cannot take back.  Peak RSS
(``ru_maxrss``) also counts the file's pages while they are mapped and resident, which the kernel
drops under memory pressure (they are clean once written back).  The layers fitted are compared byte
for byte (SHA-256 of the state dict).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_model, header, table, write  # noqa: E402

CONFIG = dict(hidden_size=2048, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=16,
              num_key_value_heads=16, vocab_size=1024, max_position_embeddings=1024)

JOB = r"""
import hashlib, json, resource, sys, time, warnings
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
import transformdsl

config, samples, tokens, policy, work = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**config)).eval()
ids = torch.randint(0, config["vocab_size"], (samples, tokens), generator=torch.Generator().manual_seed(1))
save_file({"input_ids": ids}, f"{work}/ids-{samples}.safetensors")
import threading

def status():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) for l in f if l.startswith(("VmRSS", "RssAnon", "RssFile"))}

base, peaks, running = status(), {"RssAnon": 0, "RssFile": 0}, [True]

def watch():  # anonymous memory (what the system cannot drop) and mapped file pages, sampled
    while running[0]:
        now = status()
        for key in peaks:
            peaks[key] = max(peaks[key], now[key])
        time.sleep(0.005)

watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
rss = base["VmRSS"]
started = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    transformdsl.transform(model, f'calibrate "{work}/ids-{samples}.safetensors" samples={samples} activations={policy}\n'
                                  "quantize int8 weight_only=true method=gptq")
seconds = time.perf_counter() - started
running[0] = False
watcher.join()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
digest = hashlib.sha256()
for key, value in sorted(model.state_dict().items()):
    digest.update(key.encode() + value.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
print(json.dumps({"seconds": seconds, "peak_mb": (peak - rss) / 1024, "anon_mb": (peaks["RssAnon"] - base["RssAnon"]) / 1024,
                  "file_mb": (peaks["RssFile"] - base["RssFile"]) / 1024, "digest": digest.hexdigest()}))
"""


#: glibc's allocator raises its mmap threshold as large blocks are freed (up to 32 MiB), after which
#: freed activations stay in the heap, counted as the process's anonymous memory; a fixed threshold
#: returns them: the second way each figure is measured.
FIXED_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def run(samples: int, tokens: int, policy: str, work: Path, env: dict | None = None) -> dict:
    import os

    done = subprocess.run([sys.executable, "-c", JOB, json.dumps(CONFIG), str(samples), str(tokens), policy, str(work)],
                          capture_output=True, text=True, timeout=3600, cwd=ROOT, env={**os.environ, **(env or {})})
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    import tempfile

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="32,64", help="sample counts, comma-separated")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for samples, (allocator, env) in ((int(n), a) for n in args.samples.split(",") for a in
                                          (("glibc default", None), ("MALLOC_MMAP_THRESHOLD_=65536", FIXED_THRESHOLD))):
            results = {policy: run(samples, args.tokens, policy, Path(work), env) for policy in ("memory", "disk")}
            print(samples, allocator, results, flush=True)
            memory, disk = results["memory"], results["disk"]
            ok = "error" not in memory and "error" not in disk
            one_set = samples * args.tokens * CONFIG["hidden_size"] * 4 / 2**20
            rows.append({
                "samples x tokens": f"{samples} x {args.tokens}",
                "allocator": allocator,
                "one set of hidden states MiB": f"{one_set:,.0f}",
                "peak RssAnon MiB memory / disk": f"{memory['anon_mb']:,.0f} / {disk['anon_mb']:,.0f}" if ok else
                f"{memory.get('error', '')} {disk.get('error', '')}",
                "disk ÷ memory (RssAnon)": f"{disk['anon_mb'] / memory['anon_mb']:.2f}" if ok else "",
                "peak RSS MiB memory / disk (file pages counted)": f"{memory['peak_mb']:,.0f} / {disk['peak_mb']:,.0f}"
                if ok else "",
                "time s memory / disk": f"{memory['seconds']:.1f} / {disk['seconds']:.1f}" if ok else "",
                "disk ÷ memory (time)": f"{disk['seconds'] / memory['seconds']:.2f}" if ok else "",
                "same layers": str(memory.get("digest") == disk.get("digest")) if ok else "",
            })
    text = (header("Calibration's activations: memory against an unlinked temporary file") +
            f"\nCPU: {cpu_model()}, {torch.get_num_threads()} threads.  Command: `.venv/bin/python "
            f"benchmarks/bench_activations.py --samples {args.samples} --tokens {args.tokens}` "
            f"({time.time() - started:.0f} s).\n\n"
            f"Model: a Llama of {CONFIG['num_hidden_layers']} blocks, hidden {CONFIG['hidden_size']}, intermediate "
            f"{CONFIG['intermediate_size']}, random float32 weights (hidden states wide against the blocks, so the "
            "activations dominate); `quantize int8 weight_only=true method=gptq` on N samples of random token ids, "
            "each way in a fresh process.  Peaks above the process's memory before the transform: RssAnon (anonymous "
            "memory, sampled every 5 ms: what the system cannot take back) and RSS (ru_maxrss, which also counts the "
            "temporary file's pages while mapped and resident: clean pages the kernel drops under pressure); same "
            "layers: SHA-256 of the state dicts.  Each way twice: with glibc's default allocator, whose mmap threshold "
            "rises as large blocks are freed (freed activations then stay in its heap, counted as anonymous memory, in "
            "both ways), and with a fixed threshold (`MALLOC_MMAP_THRESHOLD_=65536`), which returns them.\n\n" + table(rows, list(rows[0])) + "\n")
    write("calibration_activations.md", text)


if __name__ == "__main__":
    main()
