"""Weight-only int8 at realistic width: the cast of the whole weight against the cast block by block.

    .venv/bin/python benchmarks/bench_int8_blocks.py [--rounds 6]

Writes ``benchmarks/results/int8_blocks.md``.  One layer of FLUX.1's width (3072, and its MLP's
12288) quantized with ``quantize int8 weight_only=true``, 48 tokens (the benchmark models' count),
one torch thread, float32 and bfloat16: the layer casting its whole int8 weight per call (a float
copy of 38-150 MB, a fresh mapping each time), the same layer casting it a block of rows at a time
through one buffer (what it does past ``BLOCKED_BYTES``), and the float layer it replaced.  The
ways run in turn, round after round, the minimum of each kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import header  # noqa: E402

from transformdsl.passes import _int8_weight_only as w8  # noqa: E402

SHAPES = [(3072, 3072), (12288, 3072), (3072, 12288)]
TOKENS = 48


def measure(rounds: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for out_features, in_features in SHAPES:
            torch.manual_seed(0)
            linear = torch.nn.Linear(in_features, out_features).to(dtype)
            layer = w8.Int8WeightOnlyLinear.build(linear.weight.detach(), linear.bias.detach())
            x = torch.randn(1, TOKENS, in_features, dtype=dtype)
            threshold = w8.BLOCKED_BYTES
            ways = {"whole weight cast": (layer, 1 << 62), "block by block": (layer, threshold),
                    "float layer": (linear, threshold)}
            best = dict.fromkeys(ways, float("inf"))
            with torch.no_grad():
                for _ in range(rounds):
                    for name, (module, blocked_from) in ways.items():
                        w8.BLOCKED_BYTES = blocked_from
                        start = time.perf_counter()
                        module(x)
                        best[name] = min(best[name], time.perf_counter() - start)
            w8.BLOCKED_BYTES = threshold
            rows.append({"dtype": str(dtype).removeprefix("torch."), "shape": (out_features, in_features), **best})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.rounds)
    lines = [header("Weight-only int8: the per-call cast, whole or block by block"), "",
             f"Command: `.venv/bin/python benchmarks/bench_int8_blocks.py --rounds {args.rounds}` ({TOKENS} tokens, "
             "1 torch thread; the ways in turn, round after round, the minimum kept).", "",
             "| dtype | weight (out × in) | whole weight cast ms | block by block ms | float layer ms | "
             "whole ÷ float | blocks ÷ float |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        whole, blocks, plain = r["whole weight cast"], r["block by block"], r["float layer"]
        lines.append(f"| {r['dtype']} | {r['shape'][0]} × {r['shape'][1]} | {whole * 1e3:.1f} | {blocks * 1e3:.1f} | "
                     f"{plain * 1e3:.1f} | {whole / plain:.2f}× | {blocks / plain:.2f}× |")
    lines += ["", "A float copy of a whole weight this size is a fresh mapping of memory at every call (glibc maps "
              "allocations over 32 MiB and unmaps them when freed), faulted in page by page; block by block, one "
              "buffer that stays in cache is cast into and multiplied at once.", ""]
    out = Path(__file__).resolve().parent / "results" / "int8_blocks.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
