"""The main job, end to end, on a built-in tiny model (``transformdsl demo``, ``make demo``).

Explain the plan, apply an example script, compare size, latency and outputs before and
after, save, reload, and check the reloaded model reproduces the transformed one exactly.

Latency is reported as the user's workload would see it: the first call after the transform
(where ``compile`` compiles: a one-off cold start) is timed and shown on its own, and the
steady latency is the median of the calls after it.  Without ``--out`` the model is saved to a
temporary directory that is removed at the end.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .explain import human_bytes

#: The demo's script: package data (a copy of examples/demo.tfm, which a test keeps identical).
DEFAULT_SCRIPT = Path(__file__).with_name("demo.tfm")
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
    from . import plan, transform
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
        started = time.perf_counter()
        output = run(model)  # the first call: where compile compiles (a one-off cold start)
        first_s = time.perf_counter() - started
        before_ms, after_ms = _latencies_ms([lambda: run(original), lambda: run(model)])
    after_bytes = parameter_bytes(model)
    diff = (output.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item() or 1.0
    print("\n-- before -> after")
    print(f"  parameters: {human_bytes(before_bytes)} -> {human_bytes(after_bytes)} "
          f"({after_bytes / before_bytes:.2f}x)")
    compiles = any(step.transform.verb == "compile" for step in the_plan.steps)
    print(f"  latency:    {before_ms:.2f} ms -> {after_ms:.2f} ms ({after_ms / before_ms:.2f}x, steady state: median "
          f"of 9 calls after 2 warm-up calls, {torch.get_num_threads()} threads)")
    if compiles:
        print(f"  first call: {first_s:.2f} s, once per process: compiling (not counted in the latency above)")
    print(f"  outputs:    max abs diff {diff:.3g} (relative {diff / scale:.3g})")
    device = "GPU" if torch.cuda.is_available() else "CPU"
    if after_ms > before_ms:
        print(f"  (slower per call on this {device}, on this tiny model: "
              + _slower_because(the_plan, device) + ";\n   benchmarks/RESULTS.md has the figures at realistic "
              "sizes)")

    print("\n-- save and reload")
    with contextlib.ExitStack() as cleanup:
        if out:
            directory = Path(out)
        else:  # removed at the end: the demo leaves nothing behind
            directory = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="transformdsl-demo-"))) / "model"
        return _save_and_reload(model, output, directory, kept=bool(out))


def _slower_because(the_plan, device: str) -> str:
    """Why the transformed model is slower per call, from what the script does."""
    steps = [step for step in the_plan.steps if step.targets]
    verbs = {step.transform.key() for step in steps}

    def llm_int8(step) -> bool:
        return step.transform.key() == "quantize int8" and not step.transform.options.weight_only

    int8_matmul = any(llm_int8(step) for step in steps)
    # Layers that dequantize their weight at every call (every quantized or fp8 layer but LLM.int8's).
    upcasting = any(step.transform.key().startswith(("quantize", "fp8")) and not llm_int8(step) for step in steps)
    reasons = []
    if int8_matmul and device == "CPU":
        reasons.append(_int8_cpu_reason())
    if upcasting:
        reasons.append("quantized and fp8 layers turn their weights back into floats on every call: they save "
                       "memory, not time" if device == "CPU" else "the layers trade time for memory")
    if any(k.startswith("compile") for k in verbs):
        reasons.append("compile speeds up the arithmetic, a small share of each call of a model this tiny")
    return "; ".join(reasons) or "the transformed layers do more work per call than the original ones"


def _int8_cpu_reason() -> str:
    """How LLM.int8 multiplies on this CPU, detected as bitsandbytes decides it (capabilities.py)."""
    from .capabilities import cpu_int8_matmul

    alternative = "`quantize int8 weight_only=true` keeps int8 weights and multiplies in float"
    how = cpu_int8_matmul()
    if how == "float32":
        return ("LLM.int8 layers on this CPU (no AVX-512) convert activations and weights to float32 and "
                "rescale on every call, extra work around the same float matmul; " + alternative)
    if how == "int_mm without int8 dot product":
        # spec.md (quantize, weight_only): on CPUs without VNNI/AMX the int8 matmul is ~35x slower than float32.
        return ("LLM.int8 layers multiply in int8 (torch._int_mm), which a CPU without int8 matrix "
                "instructions (VNNI, AMX) runs far slower than a float matmul; " + alternative)
    return ("LLM.int8 layers quantize their activations on every call, a fixed cost a model this tiny "
            "does not earn back; " + alternative)


def _save_and_reload(model, output, directory: Path, kept: bool) -> int:
    from . import load, save
    from .models import run

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
    if not kept:
        print("  (the temporary directory is removed now; --out DIR keeps the save)")
    return 0 if same else 1
