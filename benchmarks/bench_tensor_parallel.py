"""Tensor-parallel loading on this CPU: TP=2 logits error and per-token latency TP=2 ÷ TP=1.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--tokens 16] [--rounds 3]

Writes ``benchmarks/results/tensor_parallel.md``.  A Llama of a medium shape (:data:`SHAPE`: hidden
1024, MLP 2816, 4 layers, 16 heads of 64, 4 key/value heads; ~53 M parameters, random weights),
saved float32 and after ``fuse qkv; quantize int8 weight_only=true``, loaded by ``torchrun
--nproc-per-node 2`` (gloo, loopback, one torch thread per rank) with ``tp_plan="auto"``:

- **error**: the sharded model's logits on a 32-token prompt against the same save loaded whole in one
  process (max abs difference, and RMS difference ÷ RMS of the logits);
- **latency**: seconds per token of greedy decoding (``generate``, KV cache, :data:`TOKENS` tokens after
  a warm-up), TP=2 (both ranks) against TP=1 (rank 0 alone, the other rank waiting at a barrier) with one
  thread and with two threads (the same two cores TP=2 uses), in turn, round after round, median kept.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2)
SCRIPTS = ["", "fuse qkv; quantize int8 weight_only=true"]
TOKENS = 16
PROMPT = 32


def worker(spec: dict) -> None:
    """One rank: measure every save of ``spec``; rank 0 writes the figures."""
    import torch

    import transformdsl

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    prompt = torch.randint(3, SHAPE["vocab_size"], (1, PROMPT))
    rows = []
    for directory, script in zip(spec["dirs"], SCRIPTS):
        sharded = transformdsl.load(directory, tp_plan="auto")
        whole = transformdsl.load(directory)
        with torch.no_grad():
            tp, one = sharded(prompt).logits.float(), whole(prompt).logits.float()
        diff = tp - one
        times: dict[str, list[float]] = {"tp2": [], "tp1": [], "tp1x2": []}
        for _ in range(spec["rounds"]):
            times["tp2"].append(_per_token(sharded, prompt, spec["tokens"]))
            for name, threads in (("tp1", 1), ("tp1x2", 2)):
                if rank == 0:
                    torch.set_num_threads(threads)
                    times[name].append(_per_token(whole, prompt, spec["tokens"]))
                    torch.set_num_threads(1)
                torch.distributed.barrier()
        rows.append({"script": script or "(float32)", "max_abs": diff.abs().max().item(),
                     "rel_rms": (diff.pow(2).mean().sqrt() / one.pow(2).mean().sqrt()).item(),
                     **{name: statistics.median(values) for name, values in times.items() if values}})
        torch.distributed.barrier()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(rows))


def _per_token(model, prompt, tokens: int) -> float:
    import torch

    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        started = time.perf_counter()
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return (time.perf_counter() - started) / tokens


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import header, table, write

    import transformdsl

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for i, script in enumerate(SCRIPTS):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
            if script:
                transformdsl.transform(model, script)
            transformdsl.save(model, Path(tmp) / f"s{i}")
            dirs.append(str(Path(tmp) / f"s{i}"))
        out = Path(tmp) / "rows.json"
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"dirs": dirs, "tokens": args.tokens, "rounds": args.rounds, "out": str(out)}))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        started = time.time()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                        f"--master-port={port}", __file__, "--worker", str(spec)], env=env, check=True, timeout=1800)
        rows = json.loads(out.read_text())
    load_after = os.getloadavg()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    for row in rows:
        row["max abs Δ logits"] = f"{row.pop('max_abs'):.2e}"
        row["RMS Δ ÷ RMS"] = f"{row.pop('rel_rms'):.2e}"
        tp2, tp1, tp1x2 = row.pop("tp2"), row.pop("tp1"), row.pop("tp1x2")
        row.update({"TP=2 ms/token": f"{tp2 * 1e3:.1f}", "TP=1 ms/token (1 thread)": f"{tp1 * 1e3:.1f}",
                    "TP=1 ms/token (2 threads)": f"{tp1x2 * 1e3:.1f}", "TP=2 ÷ TP=1 (1 thread)": f"{tp2 / tp1:.2f}×",
                    "TP=2 ÷ TP=1 (2 threads)": f"{tp2 / tp1x2:.2f}×"})
    columns = ["script", "max abs Δ logits", "RMS Δ ÷ RMS", "TP=2 ms/token", "TP=1 ms/token (1 thread)",
               "TP=1 ms/token (2 threads)", "TP=2 ÷ TP=1 (1 thread)", "TP=2 ÷ TP=1 (2 threads)"]
    text = (header("Tensor-parallel loading on a CPU: TP=2 against one process", started, threads=1)
            + f"\nCommand: `.venv/bin/python benchmarks/bench_tensor_parallel.py --tokens {args.tokens} --rounds "
            f"{args.rounds}`; CPU: {cpu}; torchrun --nproc-per-node 2, gloo over loopback, one torch thread per rank; "
            f"a Llama of hidden 1024, MLP 2816, 4 layers, 16 heads (4 key/value), vocabulary 4096 (~53 M parameters); "
            f"latency: greedy decoding of {args.tokens} tokens after a {PROMPT}-token prompt, median of "
            f"{args.rounds} rounds.  Load average (1/5/15 min) {'/'.join(f'{v:.1f}' for v in load_before)} before, "
            f"{'/'.join(f'{v:.1f}' for v in load_after)} after: the machine is shared, so the times are noisy; "
            "the ratios come from runs made in turn.\n\n"
            + table(rows, columns) + "\n")
    write("tensor_parallel.md", text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(Path(sys.argv[2]).read_text()))
    else:
        main()
