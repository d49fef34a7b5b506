"""fp8 storage and fp8 native against bfloat16, side by side in one run, on the CPU.

    .venv/bin/python benchmarks/bench_fp8.py [--tokens 256] [--rounds 3]

Writes ``benchmarks/results/fp8.md``:

1. layers of realistic size (3072x3072 and 3072x12288, like FLUX.1's attention and MLP): bytes
   against bf16 (target 0.5x), output error against the bf16 layer, CPU latency;
2. the tiny UNet, SD3 and Flux and a Flux of realistic width (hidden 3072, one block of each
   kind): bytes of the whole model and of the fp8 layers, output error against the bf16
   model, CPU latency of one forward.

On a CPU fp8 is about memory only: there is no fp8 matmul, so storage pays an upcast per layer
per call and native layers either upcast too (the default) or run ``torch._scaled_mm``'s CPU
reference kernel (``cpu_mm``), which is not optimised.  Speed is measured on a GPU by
``benchmarks/gpu_fp8.py``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import header, table, write  # noqa: E402
from torch import nn  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import models  # noqa: E402
from transformdsl.transforms import fp8  # noqa: E402
from transformdsl.transforms.fp8.layers import FP8Linear, FP8Module  # noqa: E402

#: (in_features, out_features) of FLUX.1 projections: attention (q/k/v/out) and MLP up.
LAYERS = [(3072, 3072), (3072, 12288)]
#: Flux at FLUX.1 width (24 heads of 128) with one double and one single block.
FLUX_WIDE = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                 axes_dims_rope=(16, 56, 56), guidance_embeds=False)

#: The tiny models run in milliseconds: this many times more rounds than the rest.
TINY = 10

#: variant → (script or layer recipe, run native layers through the CPU _scaled_mm reference)
MODEL_VARIANTS = {
    "fp8 storage": ("fp8 storage", False),
    "fp8 storage dtype=e5m2": ("fp8 storage dtype=e5m2", False),
    "fp8 native (CPU: upcast fallback)": ("fp8 native", False),
    "fp8 native (cpu_mm reference)": ("fp8 native", True),
    "fp8 native scaling=row (cpu_mm)": ("fp8 native scaling=row", True),
    "fp8 native in blocks; fp8 storage (cpu_mm)": ("fp8 storage; fp8 native in *TransformerBlock", True),
}


def nbytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def interleaved(calls: dict[str, object], rounds: int) -> dict[str, tuple[float, float]]:
    """(min, median) seconds per call, timing the calls in turn in each round (after one warm-up
    round), so that load from other processes hits every variant alike."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    with torch.no_grad():
        for round_ in range(rounds + 1):
            for label, call in calls.items():
                start = time.perf_counter()
                call()
                if round_:
                    times[label].append(time.perf_counter() - start)
    return {label: (min(t), statistics.median(t)) for label, t in times.items()}


# --------------------------------------------------------------------------- layers


#: label → (FP8Linear.from_linear keyword arguments, run the CPU _scaled_mm reference)
LAYER_VARIANTS = {
    "fp8 storage (e4m3, row scales)": (dict(dtype=torch.float8_e4m3fn), False),
    "fp8 storage dtype=e5m2": (dict(dtype=torch.float8_e5m2), False),
    "fp8 native tensor (CPU: upcast fallback)": (dict(native=True, scaling="tensor"), False),
    "fp8 native tensor (cpu_mm reference)": (dict(native=True, scaling="tensor"), True),
    "fp8 native row (cpu_mm reference)": (dict(native=True, scaling="row"), True),
}


def _dtype(layer: nn.Module) -> torch.dtype:
    """The input dtype a layer is fed: its bias's (bf16, or fp32 for the fp32 baseline)."""
    return layer.bias.dtype


def _cpu_mm(call, enabled: bool):
    def run():
        with fp8.CPU_SCALED_MM.turned(enabled):
            return call()
    return run


def layer_rows(tokens: int, rounds: int) -> list[dict]:
    rows = []
    for k, n in LAYERS:
        torch.manual_seed(0)
        linear = nn.Linear(k, n).to(torch.bfloat16)
        x = torch.randn(tokens, k, dtype=torch.bfloat16)
        with torch.no_grad():
            ref = linear(x)
        layers = {"bf16 nn.Linear": (linear, False), "fp32 nn.Linear (for scale)": (copy.deepcopy(linear).float(), False)}
        for label, (recipe, cpu_mm) in LAYER_VARIANTS.items():
            recipe = dict(recipe)
            dtype = recipe.pop("dtype", torch.float8_e4m3fn)
            layers[label] = (FP8Linear.from_linear(linear, dtype, torch.bfloat16, **recipe), cpu_mm)
        calls = {label: _cpu_mm(lambda layer=layer, x=x: layer(x.to(_dtype(layer))), cpu_mm)
                 for label, (layer, cpu_mm) in layers.items()}
        seconds = interleaved(calls, rounds)
        base_bytes, base_s = nbytes(linear), seconds["bf16 nn.Linear"]
        for label, (layer, _) in layers.items():
            with torch.no_grad():
                error = rel_error(calls[label](), ref)
            rows.append(_layer_row(f"{k}x{n}", label, nbytes(layer), base_bytes, error, seconds[label], base_s))
    return rows


def _layer_row(shape, label, size, base, error, seconds, base_s) -> dict:
    return {"layer (in x out)": shape, "variant": label, "MiB": f"{size / 2**20:.2f}",
            "bytes vs bf16": f"{size / base:.3f}", "rel. error vs bf16": f"{error:.4f}", **_times(seconds, base_s)}


def _times(seconds: tuple[float, float], base: tuple[float, float]) -> dict:
    return {"CPU ms (min)": f"{seconds[0] * 1e3:.1f}", "CPU ms (median)": f"{seconds[1] * 1e3:.1f}",
            "CPU time vs bf16 (min)": f"{seconds[0] / base[0]:.2f}x"}


# --------------------------------------------------------------------------- models


def model_rows(rounds: int) -> list[dict]:
    from diffusers import FluxTransformer2DModel

    def flux_wide():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return FluxTransformer2DModel(**FLUX_WIDE).eval()

    # The tiny models run in milliseconds: many rounds; the wide Flux takes seconds per forward.
    builders = {"unet": (models.tiny_unet, rounds * TINY), "sd3": (models.tiny_sd3, rounds * TINY),
                "flux": (models.tiny_flux, rounds * TINY), "flux (3072 wide)": (flux_wide, rounds)}
    rows = []
    for name, (build, model_rounds) in builders.items():
        base = build().to(torch.bfloat16)
        ref = models.run(base)
        variants = {"bf16": (base, False, None)}
        for label, (script, cpu_mm) in MODEL_VARIANTS.items():
            model = copy.deepcopy(base)
            p = transformdsl.plan(model, script)
            transformdsl.transform(model, p)
            variants[label] = (model, cpu_mm, sum(s.bytes for s in p.steps))
        calls = {label: _cpu_mm(lambda model=model: models.run(model), cpu_mm)
                 for label, (model, cpu_mm, _) in variants.items()}
        seconds = interleaved(calls, model_rounds)
        base_bytes, base_s = nbytes(base), seconds["bf16"]
        for label, (model, _, converted) in variants.items():
            error = rel_error(calls[label](), ref)
            after = sum(nbytes(m) for m in model.modules() if isinstance(m, FP8Module))
            size = nbytes(model)
            rows.append({"model": name, "variant": label, "model MiB": f"{size / 2**20:.2f}",
                         "model bytes vs bf16": f"{size / base_bytes:.3f}",
                         "fp8 layers' bytes vs bf16": f"{after / converted:.3f}" if converted else "",
                         "rel. error vs bf16": f"{error:.4f}", **_times(seconds[label], base_s)})
        del variants, calls, base
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per layer call (CPU: keep it small)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (x10 for the tiny models)")
    args = parser.parse_args()

    layers = layer_rows(args.tokens, args.rounds)
    model_table = model_rows(args.rounds)
    text = header("fp8 storage and fp8 native on the CPU") + f"""
Relative error is `|y - y_bf16| / |y_bf16|` (L2, whole output) against the same layer or model in
bfloat16.  Latency: {args.rounds} rounds ({args.rounds * TINY} for the tiny models) after a warm-up round; in each
round every variant runs once, in turn.  This machine's 2 cores are shared with other work, so the
minimum (the least disturbed run) is the figure to compare; the median shows the spread.

**What the CPU says about fp8**: there is no fp8 matmul, so `fp8 storage` (and `fp8 native` in its
default CPU fallback) upcasts each weight at every call before the same bf16 matmul: it saves half the
weight memory and costs an extra pass over the weight, i.e. it is *slower* than bf16 by that pass.
`cpu_mm` rows run `torch._scaled_mm`'s CPU reference kernel, which computes in float32: on a CPU
without bf16 matrix instructions (this one) bf16 matmul is slower than float32 (see the fp32 row),
so those rows can beat bf16 here.  That is a property of this CPU, not of fp8; the GPU comparison is
`benchmarks/gpu_fp8.py`.

## Layers of FLUX.1 size, {args.tokens} tokens

{table(layers, list(layers[0]))}

Bytes include the float32 scales (one per output row, or one per tensor) and the bf16 bias.

## Models (bf16, one forward on the built-in sample inputs)

{table(model_table, list(model_table[0]))}

The tiny models' forwards take milliseconds, mostly Python overhead: their latency ratios are noise
on a shared machine and say nothing about fp8; the layers and the 3072-wide Flux are the figures to read.
"fp8 layers' bytes" compares the layers the script converted with the same layers in bf16; the tiny
models' layers are 32-64 wide, so their float32 per-row scales weigh more than at FLUX.1 width.
UNet storage errors are the largest: `fp8 storage` also converts its convolutions (`fp8 native` only
converts Linear layers).

Command: `.venv/bin/python benchmarks/bench_fp8.py --tokens {args.tokens} --rounds {args.rounds}`
"""
    write("fp8.md", text)


if __name__ == "__main__":
    main()
