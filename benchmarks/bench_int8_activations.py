"""Int8 activations (llama.cpp's arithmetic) against our float32-activation decode kernels, one thread.

    .venv/bin/python benchmarks/bench_int8_activations.py [--repeats 15] [--out int8_activations.md]

For GGUF Q8_0, Q4_0 and Q4_1 weights (random, quantized with gguf_blocks' helpers), the time of a decode-sized
call (1 and 8 rows) through every layer of a model, in the model's order:

- **float x**: ``q8_0_rows`` / ``q4_0_rows`` / ``q4_1_rows`` (rows.c), float32 activations;
- **int8 x**: ``quantize_q8_rows`` (each layer rounds its input to Q8_0 blocks, as llama.cpp does per
  matmul) then ``q8_0_q8_rows`` / ``q4_0_q8_rows`` / ``q4_1_q8_rows``: integer dot products per block.

Both call the C functions directly with buffers allocated beforehand (the same Python overhead for both
but for int8 x's second call).  The two alternate in one process, ``repeats`` times; medians.  Rate = stored
bytes (weights and float16 scales) ÷ time.  Rel. diff: the largest over the distinct layers of
||int8 x's output - float x's|| / ||float x's|| (what rounding the activations to int8 changes; random
weights and inputs).  What `quantize q8_0|q4_0|q4_1 activations=int8` layers call (spec.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import cpu_model, header, table, write  # noqa: E402
from transformdsl.transforms.quantize import kernels  # noqa: E402
from transformdsl.transforms.quantize.gguf_blocks import quantize_q4_0, quantize_q4_1, quantize_q8_0  # noqa: E402

SETS = {
    "SmolLM2-135M, 30 blocks": [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
                                (576, 1536)] * 30,
    "Llama-7B width, 4 blocks": [(4096, 4096)] * 4 * 4 + [(11008, 4096), (11008, 4096), (4096, 11008)] * 4,
}
QUANTIZE = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "q4_1": quantize_q4_1}


def weights(shapes, kind: str):
    """One quantized weight per distinct shape, each layer its own copy (so that nothing stays cached)."""
    generator = torch.Generator().manual_seed(0)
    made = {shape: QUANTIZE[kind](torch.randn(*shape, generator=generator)) for shape in set(shapes)}
    return [(made[shape][0].clone(), made[shape][1].clone()) for shape in shapes]


def measure(shapes, kind: str, rows: int, repeats: int) -> dict:
    layers = weights(shapes, kind)
    nbytes = sum(w.numel() * w.element_size() + s.numel() * s.element_size() for w, s in layers)
    generator = torch.Generator().manual_seed(1)
    widths = sorted({k for _, k in shapes})
    x = {k: torch.randn(rows, k, generator=generator) for k in widths}
    qx = {k: torch.empty(rows, k, dtype=torch.int8) for k in widths}
    dx = {k: torch.empty(rows, k // 32) for k in widths}
    sx = {k: torch.empty(rows, k // 32) for k in widths}
    outs = [torch.empty(rows, n) for n, _ in shapes]
    library = kernels._library()
    old, new, quantize = (getattr(library, f"{kind}_rows"), getattr(library, f"{kind}_q8_rows"),
                          library.quantize_q8_rows)
    scratch = torch.empty(rows * max(widths) // 2)  # q4_1_rows' pairwise sums
    calls_old, calls_new = [], []
    for (w, s), (n, k), out in zip(layers, shapes, outs):
        if kind == "q4_1":
            calls_old.append((old, (x[k].data_ptr(), w.data_ptr(), s.data_ptr(), scratch.data_ptr(), None,
                                    out.data_ptr(), rows, n, k, 1)))
            args = (qx[k].data_ptr(), dx[k].data_ptr(), sx[k].data_ptr())
        else:
            calls_old.append((old, (x[k].data_ptr(), w.data_ptr(), s.data_ptr(), None, out.data_ptr(), rows, n, k, 1)))
            args = (qx[k].data_ptr(), dx[k].data_ptr())
        calls_new.append(((quantize, (x[k].data_ptr(), qx[k].data_ptr(), dx[k].data_ptr(),
                                      sx[k].data_ptr() if kind == "q4_1" else None, rows, k)),
                          (new, (*args, w.data_ptr(), s.data_ptr(), None, out.data_ptr(), rows, n, k, 1))))

    def run_old():
        for fn, args in calls_old:
            fn(*args)

    def run_new():
        for (qfn, qargs), (fn, args) in calls_new:
            qfn(*qargs)
            fn(*args)

    def run_quantize_only():
        for (qfn, qargs), _ in calls_new:
            qfn(*qargs)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    run_old(), run_new()
    times_old, times_new, times_q = [], [], []
    for _ in range(repeats):  # alternated: this machine's memory bandwidth drifts
        times_old.append(timed(run_old))
        times_new.append(timed(run_new))
        times_q.append(timed(run_quantize_only))
    t_old, t_new, t_q = (statistics.median(t) for t in (times_old, times_new, times_q))
    # what rounding x to int8 changes: each distinct layer's output, ||int8 x - float x|| / ||float x||
    differences = []
    for index in sorted({shapes.index(shape) for shape in shapes}):
        (fn, args), ((qfn, qargs), (nfn, nargs)) = calls_old[index], calls_new[index]
        fn(*args)
        before = outs[index].clone()
        qfn(*qargs), nfn(*nargs)
        differences.append(((outs[index] - before).norm() / before.norm()).item())
    return {"float x ms": f"{t_old * 1e3:.2f}", "float x GB/s": f"{nbytes / t_old / 1e9:.1f}",
            "int8 x ms": f"{t_new * 1e3:.2f}", "int8 x GB/s": f"{nbytes / t_new / 1e9:.1f}",
            "of which quantize ms": f"{t_q * 1e3:.3f}", "rel. diff": f"{max(differences):.1e}", "int8 ÷ float": f"{t_new / t_old:.2f}×",
            "speedup": f"{t_old / t_new:.2f}×"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kinds", nargs="+", default=["q4_0", "q8_0", "q4_1"])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--out", default=None, help="write the table to benchmarks/results/<out>")
    args = parser.parse_args()
    if not kernels.available():
        sys.exit(f"our decode kernels are not built here: {kernels.status()}")
    torch.set_num_threads(1)
    started = time.time()
    rows_out = []
    with torch.inference_mode():
        for set_name in args.sets:
            for kind in args.kinds:
                for rows in (1, 8):
                    row = {"weights": set_name, "layer": kind, "rows": rows}
                    row.update(measure(SETS[set_name], kind, rows, args.repeats))
                    print(row, flush=True)
                    rows_out.append(row)
    columns = ["weights", "layer", "rows", "float x ms", "float x GB/s", "int8 x ms", "int8 x GB/s",
               "of which quantize ms", "int8 ÷ float", "speedup", "rel. diff"]
    text = (header("Int8 activations (llama.cpp's arithmetic) against float32 activations, our decode kernels",
                   started, threads=1)
            + f"\nCPU: {cpu_model()}; our kernels: {kernels.status()}.\n\n" + __doc__.split("\n\n", 2)[2].strip()
            + "\n\n" + table(rows_out, columns) + "\n")
    if args.out:
        write(args.out, text)
    else:
        print(table(rows_out, columns))


if __name__ == "__main__":
    main()
