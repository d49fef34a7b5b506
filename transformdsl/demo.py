"""The main job, end to end, on a built-in tiny model (``transformdsl demo``, ``make demo``).

Explain the plan, apply an example script, compare size, latency and outputs before and
after, save, reload, and check the reloaded model reproduces the transformed one exactly.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .explain import human_bytes

DEFAULT_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "demo.tfm"
DEFAULT_MODEL = "flux"


def _latencies_ms(fns, repeats: int = 9, warmup: int = 2) -> list[float]:
    """Median latency of each function, measured interleaved so that machine noise hits all alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            start = time.perf_counter()
            fn()
            bucket.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(bucket) for bucket in times]


def run_demo(model_name: str | None = None, script_path: str | None = None, out: str | None = None) -> int:
    from . import load, plan, save, transform
    from .models import BUILTIN, run
    from .parser import parse_file
    from .tree import parameter_bytes

    script = parse_file(script_path or DEFAULT_SCRIPT)
    name = model_name or DEFAULT_MODEL
    model = BUILTIN[name]()
    print(f"== transformdsl demo: {script.filename} on the built-in tiny '{name}' ({type(model).__name__})")
    print("\n-- plan")
    the_plan = plan(model, script)
    print(the_plan)

    original = copy.deepcopy(model)
    with torch.inference_mode():
        reference = run(original)
    before_bytes = parameter_bytes(original)

    print("\n-- apply")
    started = time.perf_counter()
    transform(model, the_plan, log=lambda line: print("  " + line))
    print(f"  done in {time.perf_counter() - started:.2f} s")

    with torch.inference_mode():
        output = run(model)
        before_ms, after_ms = _latencies_ms([lambda: run(original), lambda: run(model)])
    after_bytes = parameter_bytes(model)
    diff = (output.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item() or 1.0
    print("\n-- before -> after")
    print(f"  parameters: {human_bytes(before_bytes)} -> {human_bytes(after_bytes)} "
          f"({after_bytes / before_bytes:.2f}x)")
    print(f"  latency:    {before_ms:.2f} ms -> {after_ms:.2f} ms ({after_ms / before_ms:.2f}x, median of 9, "
          f"{torch.get_num_threads()} threads)")
    print(f"  outputs:    max abs diff {diff:.3g} (relative {diff / scale:.3g})")
    if after_ms > before_ms and not torch.cuda.is_available():
        print("  (on a CPU, quantized and fp8 layers dequantize on every call: they save memory, not time;\n"
              "   see benchmarks/ for GPU figures and for compile, which does speed CPUs up)")

    print("\n-- save and reload")
    directory = Path(out) if out else Path(tempfile.mkdtemp(prefix="transformdsl-demo-")) / "model"
    save(model, directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    print(f"  saved to {directory}: {len(files)} files, {human_bytes(sum(p.stat().st_size for p in files))}")
    started = time.perf_counter()
    reloaded = load(directory)
    print(f"  loaded in {(time.perf_counter() - started) * 1e3:.1f} ms (no re-quantization, no recomputation)")
    with torch.inference_mode():
        again = run(reloaded)
    same = torch.equal(again, output)
    print(f"  reloaded output equals transformed output bit for bit: {'yes' if same else 'NO'}")
    return 0 if same else 1
