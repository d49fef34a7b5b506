"""The undo log's memory: ``fp8 storage`` peak RSS against diffusers' layerwise casting, per ``undo`` mode.

    nice -n 10 .venv/bin/python benchmarks/bench_undo.py [--models flux-large] [--rounds 2]

Writes ``benchmarks/results/undo.md`` (``benchmarks/run.py`` puts it in RESULTS.md).

Same protocol as the main comparison (:mod:`measure`), each configuration in a fresh process:
read the model with ``from_pretrained`` (fp32, every byte read), cast it to bfloat16, reset the
peak-RSS counter, then transform (timed) and run one forward.  **peak RSS** is the highest resident
memory from the transform to the end of that forward, above the process's memory before it read
the model; the by-hand side is ``enable_layerwise_casting(float8_e4m3fn, bfloat16)``, which
converts weights in place and so needs no undo log.  ``undo="memory"`` keeps every original until
the script ends (what transformdsl did before the bounded undo log); ``auto`` (the default) and
``disk`` keep them on disk past their budget.  A watchdog kills a configuration whose RSS passes
``--max-rss-gb`` (the machine is shared).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from common import header, table, write  # noqa: E402

#: (label, undo mode or None for the by-hand way)
SIDES = [("diffusers enable_layerwise_casting", None), ("transformdsl undo=memory", "memory"),
         ("transformdsl undo=auto (default)", "auto"), ("transformdsl undo=disk", "disk")]


def _child(key: str, undo: str | None, threads: int, out) -> None:
    import torch
    import workloads
    from baselines import diffusers_layerwise_fp8
    from measure import peak_rss, quiet, reset_peak, rss, touch_model

    import transformdsl

    quiet()
    torch.set_num_threads(threads)
    workload = next(w for w in ALL_WORKLOADS() if w.key == key)
    base = rss()
    with torch.no_grad():
        model = workloads.read(workload)
        touch_model(model)
        model = model.to(torch.bfloat16)
    inputs = workloads.sample(model, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    import gc

    gc.collect()
    reset_peak()
    start = time.perf_counter()
    with torch.no_grad():
        if undo is None:
            model = diffusers_layerwise_fp8(model)
        else:
            model = transformdsl.transform(model, "fp8 storage", undo=undo)
    seconds = time.perf_counter() - start
    with torch.inference_mode():
        workloads.forward(model, inputs)
    out.send({"peak": peak_rss() - base, "seconds": seconds, "params": params})


def ALL_WORKLOADS():  # noqa: N802 - a constant that needs an import
    import workloads

    return [workloads.flux("medium", heads=6), workloads.flux("large", heads=24)]


def run_one(key: str, undo: str | None, threads: int, max_rss: int, timeout: float) -> dict:
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(key, undo, threads, writer), daemon=True)
    process.start()
    writer.close()
    killed = []

    def watchdog():
        while process.is_alive():
            try:
                with open(f"/proc/{process.pid}/status") as f:
                    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
            except (OSError, StopIteration):
                return
            if rss_kb * 1024 > max_rss:
                killed.append(rss_kb)
                process.kill()
                return
            time.sleep(0.05)

    threading.Thread(target=watchdog, daemon=True).start()
    row = reader.recv() if reader.poll(timeout) else None
    process.join(10)
    if process.is_alive():
        process.kill()
    if row is None:
        raise SystemExit(f"{key} undo={undo}: " + (f"killed by the watchdog at {killed[0] >> 20} GiB RSS" if killed
                                                    else "no result (timeout or crash)"))
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", action="append", default=[], help="flux-medium, flux-large (default: both)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every configuration; the minimum is kept")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-rss-gb", type=float, default=6.0)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    import workloads

    chosen = [w for w in ALL_WORKLOADS() if not args.models or w.key in args.models]
    rows = []
    started = time.time()
    for workload in chosen:
        workloads.prepare(workload)
        results = {label: [] for label, _ in SIDES}
        for _ in range(args.rounds):  # the sides in turn, round after round: both see the same machine
            for label, undo in SIDES:
                results[label].append(run_one(workload.key, undo, args.threads, int(args.max_rss_gb * (1 << 30)),
                                              args.timeout))
        hand_peak = min(r["peak"] for r in results[SIDES[0][0]])
        memory_s = min(r["seconds"] for r in results[SIDES[1][0]])
        for label, _ in SIDES:
            peak = min(r["peak"] for r in results[label])
            seconds = min(r["seconds"] for r in results[label])
            rows.append({"model": f"{workload.key} ({results[label][0]['params'] / 1e6:.0f} M parameters)",
                         "way": label, "peak RSS MiB": f"{peak / (1 << 20):.0f}",
                         "peak RSS ÷ layerwise": f"{peak / hand_peak:.2f}×",
                         "transform s": f"{seconds:.2f}",
                         "time ÷ undo=memory": "" if label == SIDES[0][0] else f"{seconds / memory_s:.2f}×"})
    text = header("The undo log's memory: fp8 storage against diffusers' layerwise casting", started, args.threads)
    text += ("\nCommand: `nice -n 10 .venv/bin/python benchmarks/bench_undo.py` (each configuration in a fresh "
             f"process, {args.rounds} rounds in turn, the minimum kept).  Peak RSS: from the transform to the end "
             "of one forward, above the process's memory before it read the model (bf16 weights).  Target: "
             "default (`undo=auto`) ≤ 1.1× layerwise casting.  `auto` keeps originals in memory up to its budget "
             "(5% of the parameter bytes, at least 64 MiB): on the 37 M-parameter model that floor holds most of "
             "what is replaced, so `auto` stays close to `memory` there; `disk` (no budget) shows the bound: the "
             "layer being converted and the one before it.\n\n")
    text += table(rows, ["model", "way", "peak RSS MiB", "peak RSS ÷ layerwise", "transform s", "time ÷ undo=memory"])
    text += "\n"
    write("undo.md", text)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
