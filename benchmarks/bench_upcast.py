"""The per-call upcast of a compressed weight at realistic width: whole, or block by block.

    .venv/bin/python benchmarks/bench_upcast.py [--rounds 6]

Writes ``benchmarks/results/upcast.md``.  Layers of FLUX.1's width (3072, its MLP's 12288, and
768), 48 tokens (the benchmark models' count), one torch thread:

- ``quantize int8 weight_only=true`` (float32 and bfloat16 models): the layer casting its whole
  int8 weight per call, and casting it a block of rows at a time through one buffer (what it does
  past ``_blocked.BLOCKED_BYTES``);
- ``fp8 storage`` (bfloat16, e4m3, per-row scales): torch's float8 conversion of the whole weight,
  and the layer as it runs now (e4m3 decoded through its bits, block by block past
  ``layers.BLOCKED_FROM``);

each against the float layer it replaced.  The ways run in turn, round after round, the minimum
of each kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import header, table, write  # noqa: E402

from transformdsl.transforms.common import blocked as _blocked  # noqa: E402
from transformdsl.transforms.fp8 import layers as fp8_layers  # noqa: E402
from transformdsl.transforms.fp8 import numerics as fp8_numerics  # noqa: E402
from transformdsl.transforms.quantize import int8_weight_only as w8  # noqa: E402

SHAPES = [(3072, 768), (3072, 3072), (12288, 3072), (3072, 12288)]
TOKENS = 48
NEVER = 1 << 62


def _time(call, settings: dict, best: dict, name: str) -> None:
    saved = {(module, attr): getattr(module, attr) for module, attr in settings}
    for (module, attr), value in settings.items():
        setattr(module, attr, value)
    try:
        start = time.perf_counter()
        call()
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)


def measure(rounds: int) -> list[dict]:
    rows = []
    cases = [("int8 weight-only", dtype) for dtype in (torch.float32, torch.bfloat16)] + [("fp8 storage", torch.bfloat16)]
    for kind, dtype in cases:
        for out_features, in_features in SHAPES:
            torch.manual_seed(0)
            linear = torch.nn.Linear(in_features, out_features).to(dtype)
            if kind == "int8 weight-only":
                layer = w8.Int8WeightOnlyLinear.build(linear.weight.detach(), linear.bias.detach())
                ways = {"whole": {(_blocked, "BLOCKED_BYTES"): NEVER}, "now": {}}
            else:
                layer = fp8_layers.FP8Linear.from_linear(linear, torch.float8_e4m3fn, torch.bfloat16)
                ways = {"whole": {(fp8_layers, "BLOCKED_FROM"): NEVER, (fp8_numerics, "_DECODE_MIN"): NEVER}, "now": {}}
            x = torch.randn(1, TOKENS, in_features, dtype=dtype)
            best: dict[str, float] = {}
            with torch.no_grad():
                for _ in range(rounds):
                    for name, settings in ways.items():
                        _time(lambda m=layer, x=x: m(x), settings, best, name)
                    _time(lambda m=linear, x=x: m(x), {}, best, "float")
            rows.append({"kind": kind, "dtype": str(dtype).removeprefix("torch."),
                         "shape": (out_features, in_features), **best})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.rounds)
    columns = ["layer", "dtype", "weight (out × in)", "whole ms", "now ms", "float layer ms", "whole ÷ float",
               "now ÷ float"]
    cells = [dict(zip(columns, (r["kind"], r["dtype"], f"{r['shape'][0]} × {r['shape'][1]}", f"{r['whole'] * 1e3:.1f}",
                                f"{r['now'] * 1e3:.1f}", f"{r['float'] * 1e3:.1f}", f"{r['whole'] / r['float']:.2f}×",
                                f"{r['now'] / r['float']:.2f}×"))) for r in rows]
    write("upcast.md", "\n".join([
        header("The per-call upcast of compressed weights: whole or block by block"), "",
        f"Command: `.venv/bin/python benchmarks/bench_upcast.py --rounds {args.rounds}` ({TOKENS} tokens, "
        "1 torch thread; the ways in turn, round after round, the minimum kept).  *whole*: int8 cast as one "
        "float copy of the weight, fp8 through torch's float8 conversion of the whole weight; *now*: what "
        "the layer does.", "",
        table(cells, columns), "",
        "A float copy of a whole weight over 32 MiB is a fresh mapping of memory at every call (glibc maps "
        "such allocations and unmaps them when freed), faulted in page by page; block by block, one buffer "
        "that stays in cache is cast into and multiplied at once.  torch's float8 conversion into bfloat16 "
        "takes ~3 ns a value on this CPU; `fp8 storage` decodes e4m3 through its bits, to the same values.", ""]))

if __name__ == "__main__":
    main()
