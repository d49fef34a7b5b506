"""What ``fp8 storage``'s scales cost to apply: the plain cast against the scaled quantization.

    .venv/bin/python benchmarks/bench_fp8_scale.py [--rounds 5]

Writes ``benchmarks/results/fp8_scale.md``.  On the weights of one FLUX.1 double block (bf16:
four 3072x3072 projections, the 3072x12288 and 12288x3072 MLP), one torch thread, in one process:

- ``scale=none``: ``weight.to(float8_e4m3fn)``, diffusers' layerwise cast;
- the largest magnitude of each row, then the same plain cast: the lower bound of any per-row
  scaling (what the extra pass over each weight costs, with nothing divided);
- ``scale=row`` and ``scale=tensor``: :func:`transformdsl.transforms.fp8.numerics.quantize_weight`.

The ways run in turn, round after round (both see the same machine), the minimum of each kept;
ratios are against the plain cast.  This is the one-off cost of applying the script (reloading a
saved model reads the fp8 bytes and computes nothing); the whole apply, planning included, is in
RESULTS.md ("Issue 15's targets").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import header, table, write  # noqa: E402

from transformdsl.transforms.fp8 import numerics  # noqa: E402

SHAPES = [(3072, 3072)] * 4 + [(12288, 3072), (3072, 12288)]
FORMAT = torch.float8_e4m3fn


def weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    # kaiming-uniform magnitudes, as a freshly initialised nn.Linear (and most weights ~0.02)
    return [(torch.rand(out, inp) * 2 - 1).mul(inp ** -0.5).to(torch.bfloat16) for out, inp in SHAPES]


def amax_then_cast(weight: torch.Tensor) -> torch.Tensor:
    """The rows' largest magnitudes (block by block, as quantize does), then the plain cast."""
    rows = weight.reshape(weight.shape[0], -1)
    step = max(1, numerics._CHUNK_ELEMENTS // rows.shape[1])
    values = torch.empty(rows.shape, dtype=FORMAT)
    for start in range(0, rows.shape[0], step):
        numerics._amax_rows(rows[start:start + step])
        values[start:start + step].copy_(rows[start:start + step])
    return values


WAYS = {
    "scale=none (plain cast, as diffusers)": lambda w: w.to(FORMAT),
    "largest magnitude per row, then the plain cast": amax_then_cast,
    "scale=row": lambda w: numerics.quantize_weight(w, FORMAT, (1,), "row"),
    "scale=tensor": lambda w: numerics.quantize_weight(w, FORMAT, (1,), "tensor"),
}


def measure(rounds: int) -> dict[str, float]:
    tensors = weights()
    best = {name: float("inf") for name in WAYS}
    for _ in range(rounds):
        for name, way in WAYS.items():
            start = time.perf_counter()
            out = [way(w) for w in tensors]
            best[name] = min(best[name], time.perf_counter() - start)
            del out
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    best = measure(args.rounds)
    plain = best["scale=none (plain cast, as diffusers)"]
    elements = sum(a * b for a, b in SHAPES)
    rows = [{"way": name, "ms": f"{seconds * 1e3:.1f}", "÷ plain cast": f"{seconds / plain:.2f}×"}
            for name, seconds in best.items()]
    write("fp8_scale.md", "\n".join([
        header("fp8 storage: what the scales cost to apply"), "",
        f"Command: `.venv/bin/python benchmarks/bench_fp8_scale.py --rounds {args.rounds}` "
        f"({len(SHAPES)} bf16 weights of one FLUX.1 double block, {elements / 1e6:.0f} M values, 1 torch thread; "
        "the ways in turn, round after round, the minimum kept).", "",
        table(rows, ["way", "ms", "÷ plain cast"]), "",
        "The cast to float8 is most of the time either way; a scale adds one pass over each weight for its "
        "largest magnitudes and a division before that cast.", ""]))

if __name__ == "__main__":
    main()
