"""Why we wrote our own decode kernels: quantized layers fed one and eight rows, ours against aten's.

    .venv/bin/python benchmarks/bench_decode_kernels.py [--threads 1 2] [--layers q5_0 q6_k ...]

For ``quantize int8 weight_only=true``, ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q4_k``, ``q5_k``, ``q6_k`` and
``int4`` (bfloat16 compute) layers, the time of a decode-sized call (1 and 8 rows) through every layer of a model,
in the model's order, on:

- **ours**: :mod:`transformdsl.transforms.quantize.kernels` (``rows.c``, compiled here): the stored
  bytes read as they are, float32 activations;
- **aten**: the layer's earlier path, aten's packed kernel (``_weight_int8pack_mm`` for int8,
  ``_weight_int4pack_mm_for_cpu`` for q8_0, q5_0 and q5_1 (two 4-bit halves), q4_0, q4_1, q4_k and int4), bfloat16
  activations and scales (``q6_k`` has none: its groups of 16 inputs have no packed form; nor ``q5_k``: its 5-bit
  values would take two packed copies);
- **float32**: ``F.linear`` with the float32 weight (what the quantization replaces);
- **floor**: ``torch.sum`` over a float32 tensor of as many bytes as the layers store, on the same threads,
  right after ours: the rate this machine reads memory at (the bound a decode kernel can reach).

``q8_0``/``q4_0``/``int4`` with ``activations=int8`` (llama.cpp's arithmetic: the input rounded to int8 blocks,
integer products; benchmarks/results/int8_activations.md) have no aten counterpart: their aten columns are empty
(int4's float-activation row beside them is what they replace).

Two weight sets: SmolLM2-135M's 30 blocks (the serving benchmark's model: q/k/v/o/gate/up/down, 106 M
weights) and four Llama-7B-wide blocks (4096/11008, 809 M weights: past this CPU's caches); ``q4_k``, ``q5_k`` and ``q6_k``
on the second only (their super-blocks are 256 inputs: SmolLM2's 576-wide layers have none; all hold random
valid super-blocks, as the kernels' speed does not depend on the values).  Rate =
stored bytes (weights and scales) ÷ time; all measured in one process, one after another.  An int4
layer beside aten's packed kernel takes ours for 1-2 rows only: its 8-row "ours" is aten's kernel again
(with ``activations=int8``, ours up to 8 rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import cpu_model, header, table, write  # noqa: E402
from transformdsl.transforms.quantize import kernels  # noqa: E402
from transformdsl.transforms.quantize.gguf_blocks import (  # noqa: E402
    Q4_0Linear,
    Q4_1Linear,
    Q4_KLinear,
    Q5_0Linear,
    Q5_1Linear,
    Q5_KLinear,
    Q6_KLinear,
    Q8_0Linear,
)
from transformdsl.transforms.quantize.int4 import Int4WeightOnlyLinear  # noqa: E402
from transformdsl.transforms.quantize.int8_weight_only import Int8WeightOnlyLinear  # noqa: E402


def _int8_activations(build):
    def built(weight, bias):
        layer = build(weight, bias)
        layer.activations = "int8"
        return layer
    return built


def _random_q4_k(weight, bias):
    """A Q4_K layer of ``weight``'s shape holding random valid super-blocks: the kernels' speed does not depend
    on the values, and ggml's reference quantizer takes about 0.25 µs a weight (200 s for the 7B-wide set)."""
    rows, cols = weight.shape
    generator = torch.Generator().manual_seed(rows * cols)
    values = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(rows, cols // 256, 2, generator=generator) * 1e-3).half()
    sub = torch.randint(0, 256, (rows, cols // 256, 12), dtype=torch.uint8, generator=generator)
    return Q4_KLinear(values, scale, sub, bias)


def _random_q5_k(weight, bias):
    """A Q5_K layer of ``weight``'s shape holding random valid super-blocks (as :func:`_random_q4_k`, plus random
    fifth bits)."""
    rows, cols = weight.shape
    generator = torch.Generator().manual_seed(rows * cols)
    values = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(rows, cols // 256, 2, generator=generator) * 1e-3).half()
    sub = torch.randint(0, 256, (rows, cols // 256, 12), dtype=torch.uint8, generator=generator)
    high = torch.randint(0, 256, (rows, cols // 8), dtype=torch.uint8, generator=generator)
    return Q5_KLinear(values, scale, sub, high, bias)


def _random_q6_k(weight, bias):
    """A Q6_K layer of ``weight``'s shape holding random valid super-blocks (as :func:`_random_q4_k`)."""
    rows, cols = weight.shape
    generator = torch.Generator().manual_seed(rows * cols)
    low = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    high = torch.randint(0, 256, (rows, cols // 4), dtype=torch.uint8, generator=generator)
    sub = torch.randint(-128, 128, (rows, cols // 256, 16), dtype=torch.int8, generator=generator)
    scale = (torch.rand(rows, cols // 256, generator=generator) * 1e-3).half()
    return Q6_KLinear(low, scale, high, sub, bias)


LAYERS = {"int8 weight-only": Int8WeightOnlyLinear.build, "q8_0": Q8_0Linear.build, "q4_0": Q4_0Linear.build,
          "q4_1": Q4_1Linear.build, "q5_0": Q5_0Linear.build, "q5_1": Q5_1Linear.build, "q4_k": _random_q4_k,
          "q5_k": _random_q5_k,
          "q6_k": _random_q6_k,
          "int4 group_size=64": lambda weight, bias: Int4WeightOnlyLinear.build(weight, bias, 64),
          # llama.cpp's arithmetic (no aten counterpart: its "aten" columns stay empty)
          "q8_0 activations=int8": _int8_activations(Q8_0Linear.build),
          "q4_0 activations=int8": _int8_activations(Q4_0Linear.build),
          "q5_0 activations=int8": _int8_activations(Q5_0Linear.build),
          "int4 group_size=64 activations=int8":
              lambda weight, bias: Int4WeightOnlyLinear.build(weight, bias, 64, activations="int8")}
SETS = {
    "SmolLM2-135M, 30 blocks": [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
                                (576, 1536)] * 30,
    "Llama-7B width, 4 blocks": [(4096, 4096)] * 4 * 4 + [(11008, 4096), (11008, 4096), (4096, 11008)] * 4,
}


def stored_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for name, t in layer.state_dict().items() if name != "bias")


def best_time(fn, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def use_aten(layer) -> None:
    """The layer's path before our kernels: aten's packed kernel (its packed copy made here)."""
    layer.row_kernel = False
    if hasattr(layer, "_packed"):  # q8_0/q4_0 keep none beside our kernel
        layer._packed.parts = layer.pack()


def measure(shapes, kind: str, rows: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    layers = [LAYERS[kind](torch.randn(*shape, generator=generator), None) for shape in shapes]
    assert all(layer.row_kernel for layer in layers)
    inputs = {k: torch.randn(rows, k, generator=generator) for k in {s[1] for s in shapes}}
    nbytes = sum(stored_bytes(layer) for layer in layers)

    def run():
        for layer in layers:
            layer(inputs[layer.in_features])

    # the memory floor: reading as many bytes as the layers store, the fastest way torch reads (a sum), on the
    # same threads, right after ours; the layers' bytes and these are both past the caches for the 7B set
    floor_bytes = torch.ones(nbytes // 4)
    with torch.inference_mode():
        ours = best_time(run)
        floor = best_time(floor_bytes.sum)
        del floor_bytes
        int8 = "activations=int8" in kind or kind in ("q5_k", "q6_k")  # (no aten counterpart)
        for layer in layers:
            use_aten(layer)
        aten = None if int8 else best_time(run)
        floats = [layer.dequantize() for layer in layers]
        layers.clear()
        fp32 = best_time(lambda: [F.linear(inputs[w.shape[1]], w) for w in floats])
    return {"ours ms": f"{ours * 1e3:.2f}", "ours GB/s": f"{nbytes / ours / 1e9:.1f}",
            "aten ms": "" if aten is None else f"{aten * 1e3:.2f}",
            "aten GB/s": "" if aten is None else f"{nbytes / aten / 1e9:.1f}",
            "float32 ms": f"{fp32 * 1e3:.2f}", "ours ÷ aten": "" if aten is None else f"{ours / aten:.2f}×",
            "ours ÷ float32": f"{ours / fp32:.2f}×", "floor GB/s": f"{nbytes / floor / 1e9:.1f}",
            "ours ÷ floor": f"{ours / floor:.2f}×"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", nargs="+", choices=list(LAYERS), default=list(LAYERS),
                        help="the layer kinds to measure (default: all)")
    parser.add_argument("--out", default="decode_kernels.md")
    args = parser.parse_args()
    if not kernels.available():
        sys.exit(f"our decode kernels are not built here: {kernels.status()}")
    started = time.time()
    rows_out = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for set_name, shapes in SETS.items():
            for kind in args.layers:
                if kind in ("q4_k", "q5_k", "q6_k") and any(shape[1] % 256 for shape in shapes):
                    continue  # K-quant super-blocks are 256 inputs: SmolLM2's 576-wide layers have none
                for rows in (1, 8):
                    row = {"threads": threads, "weights": set_name, "layer": kind, "rows": rows}
                    row.update(measure(shapes, kind, rows))
                    print(row, flush=True)
                    rows_out.append(row)
    command = ("`.venv/bin/python benchmarks/bench_decode_kernels.py --threads " + " ".join(map(str, args.threads))
               + ("" if args.layers == list(LAYERS) else " --layers " + " ".join(f"'{k}'" for k in args.layers))
               + (f" --out {args.out}" if args.out != "decode_kernels.md" else "") + "`")
    text = header("Decode kernels: quantized layers fed a few rows, ours against aten's packed kernels", started,
                  threads=args.threads[0])
    text += (f"\nCPU: {cpu_model()}; our kernels: {kernels.status()}. Command: {command}.\n\n"
             + __doc__.split("\n\n", 2)[2].strip() + "\n\n"
             + table(rows_out, ["threads", "weights", "layer", "rows", "ours ms", "ours GB/s", "aten ms", "aten GB/s",
                                "float32 ms", "ours ÷ aten", "ours ÷ float32", "floor GB/s", "ours ÷ floor"]) + "\n")
    write(args.out, text)


if __name__ == "__main__":
    main()
