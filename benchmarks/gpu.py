"""The GPU section of RESULTS.md: fp8 native, int8/4-bit and compile against bf16, ours against by hand.

    python benchmarks/gpu.py                     # one CUDA GPU (H100/H200 class), a few minutes
    python benchmarks/gpu.py --device cpu --tiny # the same code path on the tiny Flux, seconds (a check)

Without CUDA (and without ``--device cpu``) it prints why and exits 0, writing nothing.  On a GPU
it writes ``benchmarks/results/gpu.md`` (and ``gpu.json``); ``benchmarks/run.py`` puts that page
into RESULTS.md.  One process, jobs one after the other on one device: weights are read from
the saved bf16 model for every job, the GPU's memory counters are reset in between.

Model: a Flux transformer at FLUX.1's width (3072) with 2 double and 4 single blocks (about
1.3 B parameters), batch 1, 1024 image + 256 text tokens (a 1024x1024 image's latent).
Latency: CUDA events, median of ``--repeats`` calls after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import baselines as hand  # noqa: E402
import torch  # noqa: E402
import workloads  # noqa: E402
from common import header, table  # noqa: E402
from measure import relative_error, weight_bytes  # noqa: E402

GPU_FLUX = workloads.Workload("flux", "gpu", workloads.flux_config(heads=24, double=2, single=4))
IMAGE_TOKENS, TEXT_TOKENS = 1024, 256


@dataclass(frozen=True)
class GpuJob:
    """One row: our script and/or a by-hand function, on a fresh bf16 copy of the model."""

    name: str
    ours: str | None = None
    by_hand: object = None  # Callable[[nn.Module], nn.Module]
    label: str = ""


def _torchao_fp8(granularity: str):
    def convert(model):
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if granularity == "row"
                                                           else PerTensor())
        quantize_(model, config, filter_fn=lambda m, fqn: type(m) is torch.nn.Linear and not hand.fp8_skip(fqn))
        return model

    convert.__name__ = f"torchao_fp8_{granularity}"
    return convert


JOBS = [
    GpuJob("bf16 (original)"),
    GpuJob("fp8 native", "fp8 native", _torchao_fp8("tensor"), "torchao Float8DynamicActivationFloat8Weight"),
    GpuJob("fp8 native scaling=row", "fp8 native scaling=row", _torchao_fp8("row"),
           "torchao Float8DynamicActivationFloat8Weight PerRow"),
    GpuJob("fp8 storage", "fp8 storage", hand.diffusers_layerwise_fp8, "diffusers enable_layerwise_casting"),
    GpuJob("quantize int8", "quantize int8", hand.bnb_int8, "bitsandbytes Linear8bitLt by hand"),
    GpuJob("quantize nf4", "quantize nf4 compute=bfloat16", hand.bnb_4bit("nf4", torch.bfloat16),
           "bitsandbytes Linear4bit nf4 by hand"),
    GpuJob("compile", "compile", hand.torch_compile, "torch.compile(model)"),
    GpuJob("fp8 native + compile", "fp8 native; compile", hand.chain(_torchao_fp8("tensor"), hand.torch_compile),
           "torchao fp8 + torch.compile"),
]


def inputs(model, device: str, tiny: bool) -> tuple[tuple, dict]:
    if tiny:
        return workloads.sample(model, torch.bfloat16)
    config = model.config
    g = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    return (randn(1, IMAGE_TOKENS, config.in_channels),), {
        "encoder_hidden_states": randn(1, TEXT_TOKENS, config.joint_attention_dim),
        "pooled_projections": randn(1, config.pooled_projection_dim),
        "timestep": torch.tensor([0.5], device=device, dtype=torch.bfloat16),
        "img_ids": torch.zeros(IMAGE_TOKENS, 3, device=device), "txt_ids": torch.zeros(TEXT_TOKENS, 3, device=device)}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def latency_ms(fn, device: str, repeats: int, warmup: int) -> float:
    """Median milliseconds per call (CUDA events on the GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def fresh_model(workload, device: str):
    model = workloads.model_class("flux").from_pretrained(workloads.directory(workload), torch_dtype=torch.bfloat16)
    return model.eval().to(device)


def run_side(workload, device: str, convert, reference, args) -> dict:
    """Transform a fresh model with ``convert``; time it, its calls and its memory."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = fresh_model(workload, device)
    sample = inputs(model, device, args.tiny)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model = convert(model)
    sync(device)
    transform_s = time.perf_counter() - start
    with torch.inference_mode():
        start = time.perf_counter()
        output = workloads.forward(model, sample)
        sync(device)
        first_s = time.perf_counter() - start
        ms = latency_ms(lambda: workloads.forward(model, sample), device, args.repeats, args.warmup)
    row = {"transform_s": transform_s, "first_call_s": first_s, "latency_ms": ms, "weight_bytes": weight_bytes(model),
           "error": relative_error(output, reference) if reference is not None else 0.0}
    if device == "cuda":
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return row | {"output": output}  # the model is freed on return, before the next job


def ours(script: str):
    def convert(model):
        import transformdsl

        return transformdsl.transform(model, script)

    return convert


def measure_job(job: GpuJob, workload, device: str, reference, args) -> list[dict]:
    rows = []
    sides = [("transformdsl", ours(job.ours) if job.ours else None), (job.label, job.by_hand)]
    if job.ours is None:
        sides = [("original", lambda model: model)]
    for who, convert in sides:
        if convert is None:
            continue
        try:
            row = run_side(workload, device, convert, reference, args)
            row.pop("output")
            row["status"] = "ok"
        except Exception as exc:  # e.g. torchao missing, an unsupported GPU: the row says so
            row = {"status": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        rows.append({"job": job.name, "who": who, **row})
        print(f"{job.name:24} {who[:44]:44} {row['status'][:60]}", flush=True)
    return rows


def render(rows: list[dict], device_name: str, args) -> str:
    base = next((r for r in rows if r["who"] == "original" and r["status"] == "ok"), None)
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append({"job": r["job"], "who": r["who"], "status": r["status"]})
            continue
        speedup = f"{base['latency_ms'] / r['latency_ms']:.2f}×" if base else "–"
        lines.append({"job": r["job"], "who": r["who"], "transform s": f"{r['transform_s']:.3g}",
                      "first call s": f"{r['first_call_s']:.3g}", "latency ms": f"{r['latency_ms']:.3g}",
                      "vs bf16": speedup, "weights GB": f"{r['weight_bytes'] / 1e9:.3g}",
                      "peak GPU GB": f"{r.get('peak_gpu_bytes', 0) / 1e9:.3g}", "error": f"{r['error']:.2g}",
                      "status": "ok"})
    text = header("GPU: fp8, int8/4-bit and compile against bf16")
    text += (f"\nDevice: {device_name}.  Model: Flux, width 3072, {GPU_FLUX.config['num_layers']} double + "
             f"{GPU_FLUX.config['num_single_layers']} single blocks, bf16; batch 1, {IMAGE_TOKENS} image + "
             f"{TEXT_TOKENS} text tokens.  Latency: median of {args.repeats} calls after {args.warmup} warm-up "
             "calls.  Error: against the bf16 model's output.\n\n")
    text += table(lines, ["job", "who", "transform s", "first call s", "latency ms", "vs bf16", "weights GB",
                          "peak GPU GB", "error", "status"]) + "\n"
    return text + "\nCommand: `python benchmarks/gpu.py`\n"


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the built-in tiny Flux instead of the 1.3 B one")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where gpu.md and gpu.json go")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu.py: no CUDA device here; skipped (nothing written).  RESULTS.md keeps 'not yet measured'.")
        return None
    if workloads.TORCHAO_SITE.is_dir():
        sys.path.append(str(workloads.TORCHAO_SITE))
    workload = workloads.tiny("flux") if args.tiny else GPU_FLUX
    workloads.prepare(workload)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (code-path check only)"
    original = run_side(workload, args.device, lambda m: m, None, args)
    reference = original.pop("output")
    rows = [{"job": JOBS[0].name, "who": "original", **original, "status": "ok"}]
    for job in JOBS[1:]:
        rows += measure_job(job, workload, args.device, reference, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps({"device": device_name, "rows": rows}, indent=1, default=str))
    page = args.out / "gpu.md"
    page.write_text(render(rows, device_name, args))
    print(f"written {page}")
    return page


if __name__ == "__main__":
    main()
