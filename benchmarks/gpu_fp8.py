"""fp8 native against bf16 matmul and against fp8 storage-with-upcast, on a CUDA GPU.

    .venv/bin/python benchmarks/gpu_fp8.py [--tokens 4096] [--iters 50] [--no-compile]

Realistic layer sizes (FLUX.1: 3072x3072 attention projections, 3072x12288 MLP up, 12288x3072 MLP
down), a batch of 4096 tokens, bf16 activations.  Per layer, side by side:

- ``bf16``: ``nn.Linear`` in bfloat16 (cuBLAS), the baseline;
- ``storage``: :class:`FP8Linear` upcasting its e4m3 weight to bf16 at every call, eager and compiled;
- ``native tensor`` / ``native row``: :class:`FP8Linear` quantizing the activations dynamically then
  ``torch._scaled_mm`` (tensor-wise or row-wise scales), eager and compiled (compile fuses the
  activation quantization into one kernel);
- ``_scaled_mm only``: the kernel alone on pre-quantized operands (the ceiling for native).

Timing: CUDA events around each call, after warm-up (compilation included in warm-up), median of
``--iters`` calls.  Every native layer is built with ``strict=True``, so a silent upcast fallback
is impossible: it would raise.  Operands are checked against the CUDA rules before timing.
Without CUDA (or with a GPU below compute capability 8.9) the script says so and exits 0.
Writes ``benchmarks/results/fp8-gpu.md``.  About 2-4 minutes on an H100 (most of it compiling).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import header, table, write  # noqa: E402
from torch import nn  # noqa: E402

from transformdsl.transforms import fp8  # noqa: E402
from transformdsl.transforms.fp8 import cuda as fp8_cuda  # noqa: E402
from transformdsl.transforms.fp8 import numerics  # noqa: E402
from transformdsl.transforms.fp8.layers import FP8Linear  # noqa: E402

#: (in_features, out_features)
LAYERS = [(3072, 3072), (3072, 12288), (12288, 3072)]
#: "cuda", or "cpu" for ``--cpu-dry-run`` (checks this script's logic on small sizes, no GPU figures).
DEVICE = "cuda"
E4M3 = torch.float8_e4m3fn


def cuda_time(fn, iters: int, warmup: int) -> float:
    """Median seconds of ``fn()`` measured with CUDA events, after ``warmup`` calls."""
    if DEVICE == "cpu":  # --cpu-dry-run: wall clock
        for _ in range(warmup):
            fn()
        return statistics.median(_wall(fn) for _ in range(iters))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def kernel_only(layer: FP8Linear, x: torch.Tensor):
    """``torch._scaled_mm`` alone on operands prepared once, checked against the CUDA rules."""
    a8, scale_a = numerics.quantize_activation(x.reshape(-1, layer.in_features), layer.scaling)
    b, scale_b = layer.weight.t(), layer.weight_scale.t()
    bias = layer.bias.to(torch.bfloat16) if layer.bias is not None else None
    problems = fp8_cuda.cuda_scaled_mm_problems(a8, b, scale_a, scale_b, bias, torch.bfloat16)
    if problems:
        raise SystemExit(f"operands the kernel would reject: {problems}")
    return lambda: torch._scaled_mm(a8, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=torch.bfloat16)


def bench_layer(k: int, n: int, tokens: int, iters: int, compile_: bool) -> list[dict]:
    torch.manual_seed(0)
    linear = nn.Linear(k, n, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device=DEVICE, dtype=torch.bfloat16)
    flops = 2 * tokens * k * n
    with torch.no_grad():
        ref = linear(x)
    variants: list[tuple[str, nn.Module | None, object]] = [("bf16 nn.Linear", linear, None)]
    storage = FP8Linear.from_linear(linear, E4M3, torch.bfloat16)
    tensor = FP8Linear.from_linear(linear, E4M3, torch.bfloat16, native=True, scaling="tensor", strict=True)
    row = FP8Linear.from_linear(linear, E4M3, torch.bfloat16, native=True, scaling="row", strict=True)
    for label, layer in (("fp8 storage (upcast)", storage), ("fp8 native tensor", tensor), ("fp8 native row", row)):
        variants.append((f"{label}, eager", layer, None))
        if compile_:
            variants.append((f"{label}, compiled", torch.compile(layer, fullgraph=True, dynamic=False), layer))
    rows = []
    base = None
    with torch.no_grad():
        for label, module, inner in variants:
            seconds = cuda_time(lambda module=module: module(x), iters, warmup=5)
            base = base or seconds
            out = module(x)
            rows.append(_row(k, n, label, weight_bytes(inner or module), weight_bytes(linear), rel_error(out, ref),
                             seconds, base, flops))
        for label, layer in (("_scaled_mm only, tensor", tensor), ("_scaled_mm only, row", row)):
            call = kernel_only(layer, x)
            seconds = cuda_time(call, iters, warmup=5)
            rows.append(_row(k, n, label, weight_bytes(layer), weight_bytes(linear), rel_error(call(), ref),
                             seconds, base, flops))
    return rows


def _row(k, n, label, size, base_size, error, seconds, base, flops) -> dict:
    return {"layer (in x out)": f"{k}x{n}", "variant": label, "weight MiB": f"{size / 2**20:.1f}",
            "bytes vs bf16": f"{size / base_size:.3f}", "rel. error vs bf16": f"{error:.4f}",
            "ms": f"{seconds * 1e3:.3f}", "TFLOP/s": f"{flops / seconds / 1e12:.0f}",
            "speed-up vs bf16": f"{base / seconds:.2f}x"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the same code on the CPU (small sizes, _scaled_mm CPU reference), write nothing")
    args = parser.parse_args()
    if args.cpu_dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print("gpu_fp8: no CUDA device; nothing measured (run it on a GPU machine)")
        return 0
    capability = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if capability < (8, 9):
        print(f"gpu_fp8: {name} (compute capability {capability[0]}.{capability[1]}) has no fp8 matmul "
              "(needs 8.9+); fp8 native would only upcast there")
        return 0
    rows = []
    for k, n in LAYERS:
        layer_rows = bench_layer(k, n, args.tokens, args.iters, args.compile)
        print(table(layer_rows, list(layer_rows[0])) + "\n", flush=True)
        rows += layer_rows
    text = header(f"fp8 native vs bf16 and fp8 storage on {name}") + f"""
GPU: {name}, compute capability {capability[0]}.{capability[1]}, CUDA {torch.version.cuda}.
{args.tokens} tokens of bf16 activations; median of {args.iters} calls timed with CUDA events after 5 warm-up
calls (compilation happens in the warm-up).  "compiled" is `torch.compile(fullgraph=True, dynamic=False)`
of the single layer.  Native rows include the dynamic activation quantization (amax, scale, cast) unless
marked "_scaled_mm only".  Relative error is against the bf16 layer's output.

{table(rows, list(rows[0]))}

Command: `.venv/bin/python benchmarks/gpu_fp8.py --tokens {args.tokens} --iters {args.iters}`
"""
    write("fp8-gpu.md", text)
    return 0


def dry_run(args) -> int:
    """The whole measurement path on the CPU with small layers: catches a broken script before GPU time."""
    global DEVICE, LAYERS
    DEVICE, LAYERS = "cpu", [(64, 64), (64, 256)]
    with fp8.CPU_SCALED_MM.turned(True):
        for k, n in LAYERS:
            rows = bench_layer(k, n, 32, 2, args.compile)
            print(table(rows, list(rows[0])) + "\n")
    print("gpu_fp8: CPU dry run done (figures above are meaningless; nothing written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
