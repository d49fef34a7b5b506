"""Step caches (``cache MODE``) on a Flux-shaped denoiser loop: ours against diffusers' enable_cache by hand.

For a tiny and a medium Flux transformer (random weights, seed 0) the loop is ``--steps`` denoiser
calls in one cache context, as a flow-matching pipeline makes them: the latent moves by
``(sigma_next - sigma) * prediction`` after each call and the timestep falls from 1 to 0.  Per
cache mode that runs on Flux:

- **latency ÷ uncached**: the whole loop with the cache ÷ the loop without one;
- **ours ÷ by hand**: ``transform(model, "cache ...")`` ÷ ``model.enable_cache(Config(...))`` on a
  copy (target ≤ 1.02×: the same hooks, nothing of ours in the loop but one hook at the call);
- **identical**: our final latent equals the by-hand one bit for bit;
- **error**: RMS(final latent - uncached final latent) ÷ RMS(uncached final latent).  Random
  weights say little about image quality: the figure says how far the cache moves this loop, not
  whether a real model's image degrades;
- and cache + ``compile regional`` ÷ the cache alone (first_block, both blocks lists).

Timing: the variants of a model run in interleaved rounds (each round runs every variant once, in
alternating order), the median loop time over ``--rounds`` after one warm-up loop each; ratios
are of those medians, measured in the same process one right after the other.

    .venv/bin/python benchmarks/bench_cache.py               # ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_cache.py --steps 20 --rounds 3 --models tiny

Writes ``benchmarks/results/cache.md`` and its section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from common import RESULTS, header, table  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import models  # noqa: E402

HERE = Path(__file__).resolve().parent
SECTION = "## Step caches (cache MODE) against diffusers' enable_cache"


def _flux_medium():
    from workloads import Workload, build, flux_config

    return build(Workload("flux", "medium", flux_config(4, double=2, single=4)))


MODELS = {"tiny": ("built-in tiny Flux (1 double + 2 single blocks, width 32)", models.tiny_flux),
          "medium": ("Flux-shaped, width 512 (4 heads of 128), 2 double + 4 single blocks", _flux_medium)}


def modes(steps: int) -> dict:
    """mode -> (our statement, the by-hand config factory given a timestep callback)."""
    from diffusers.hooks import (
        FasterCacheConfig,
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    return {
        "first_block": ("cache first_block threshold=0.2", lambda ts: FirstBlockCacheConfig(threshold=0.2)),
        "taylorseer": ("cache taylorseer cache_interval=4 disable_cache_before_step=3",
                       lambda ts: TaylorSeerCacheConfig(cache_interval=4, disable_cache_before_step=3)),
        "pyramid_broadcast": (
            "cache pyramid_broadcast spatial_attention_block_skip_range=2",
            lambda ts: PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                                       current_timestep_callback=ts)),
        "mag": (f"cache mag mag_ratios=flux num_inference_steps={steps}",
                lambda ts: MagCacheConfig(mag_ratios=FLUX_MAG_RATIOS.clone(), num_inference_steps=steps)),
        "faster": ("cache faster is_guidance_distilled=true",
                   lambda ts: FasterCacheConfig(is_guidance_distilled=True, current_timestep_callback=ts,
                                                attention_weight_callback=lambda _: 0.5)),
    }


class Loop:
    """A flow-matching denoising loop of ``steps`` calls on one model (its latent kept for the error)."""

    def __init__(self, model, steps: int, clock: dict | None = None):
        self.model, self.steps = model, steps
        args, self.kwargs = models.sample_inputs(model)
        self.latent0 = args[0]
        self.sigmas = torch.linspace(1.0, 0.0, steps + 1)
        self.clock = clock  # the by-hand callback reads the pipeline's current timestep from here

    def __call__(self) -> torch.Tensor:
        latent = self.latent0.clone()
        cached = getattr(self.model, "is_cache_enabled", False)
        with torch.inference_mode():
            for i in range(self.steps):
                sigma = self.sigmas[i]
                if self.clock is not None:
                    self.clock["t"] = float(sigma) * 1000
                kwargs = dict(self.kwargs, timestep=torch.full_like(self.kwargs["timestep"], float(sigma)))
                if cached:
                    with self.model.cache_context("cond"):
                        prediction = self.model(latent, **kwargs).sample
                else:
                    prediction = self.model(latent, **kwargs).sample
                latent = latent + (self.sigmas[i + 1] - sigma) * prediction
        if cached:
            self.model._reset_stateful_cache()
        return latent


def timed_rounds(loops: dict[str, Loop], count: int) -> dict[str, list[float]]:
    """Loop times per variant over ``count`` rounds (after one warm-up each); each round runs every variant
    once, the order reversed every other round, so that ours and by hand (adjacent) see the same load."""
    times: dict[str, list[float]] = {name: [] for name in loops}
    for loop in loops.values():
        loop()  # warm-up (and the compile, for compiled variants)
    names = list(loops)
    for r in range(count):
        for name in (names if r % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            loops[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of the round's ``a`` ÷ ``b`` (both measured in the same round)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def rms_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())


def measure(model_name: str, steps: int, rounds: int, compile_check: bool) -> tuple[list[dict], list[dict]]:
    label, build = MODELS[model_name]
    base = build()
    loops = {"uncached": Loop(copy.deepcopy(base), steps)}
    rows, failures = [], {}
    for mode, (script, config) in modes(steps).items():
        ours = copy.deepcopy(base)
        try:
            transformdsl.transform(ours, script)
            Loop(ours, steps)()
        except Exception as exc:  # noqa: BLE001 - a mode that fails on Flux is a row, not a crash
            failures[mode] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        clock = {"t": 1000.0}
        hand = copy.deepcopy(base)
        hand.enable_cache(config(lambda c=clock: c["t"]))
        loops[f"{mode} ours"] = Loop(ours, steps)
        loops[f"{mode} by hand"] = Loop(hand, steps, clock)
    times = timed_rounds(loops, rounds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    reference = loops["uncached"]()
    for mode, (script, _) in modes(steps).items():
        if mode in failures:
            rows.append({"model": model_name, "cache": f"`{script}`", "fails on Flux": failures[mode]})
            continue
        ours, hand = loops[f"{mode} ours"](), loops[f"{mode} by hand"]()
        rows.append({
            "model": model_name, "cache": f"`{script}`",
            "loop s": f"{medians[f'{mode} ours']:.3f}",
            "÷ uncached": f"{ratio(times, f'{mode} ours', 'uncached'):.2f}×",
            "ours ÷ by hand": f"{ratio(times, f'{mode} ours', f'{mode} by hand'):.3f}×",
            "identical to by hand": "yes" if torch.equal(ours, hand) else "NO",
            "error vs uncached": f"{rms_error(ours, reference):.3g}",
        })
    rows.insert(0, {"model": model_name, "cache": "none (uncached)", "loop s": f"{medians['uncached']:.3f}",
                    "÷ uncached": "1.00×"})
    compiled = []
    if compile_check:
        blocks = "in transformer_blocks.*, single_transformer_blocks.*"
        variants = {"first_block alone": "cache first_block threshold=0.2",
                    "first_block + compile regional": f"cache first_block threshold=0.2\ncompile regional {blocks}",
                    "compile regional alone": f"compile regional {blocks}"}
        loops2 = {}
        for name, script in variants.items():
            model = copy.deepcopy(base)
            transformdsl.transform(model, script)
            loops2[name] = Loop(model, steps)
        loops2["uncached"] = loops["uncached"]
        t2 = timed_rounds(loops2, rounds)
        outs = {name: loop() for name, loop in loops2.items()}
        compiled.append({
            "model": model_name,
            "cache + compile regional ÷ cache alone":
                f"{ratio(t2, 'first_block + compile regional', 'first_block alone'):.2f}×",
            "compile regional alone ÷ uncached": f"{ratio(t2, 'compile regional alone', 'uncached'):.2f}×",
            "cache + compile regional ÷ uncached": f"{ratio(t2, 'first_block + compile regional', 'uncached'):.2f}×",
            "max difference to the cache alone": f"{float((outs['first_block + compile regional'] - outs['first_block alone']).abs().max()):.2g}",
        })
    return rows, compiled


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def splice(results: Path, section: str) -> None:
    """Put ``section`` into RESULTS.md (replacing its previous version), before the GPU section."""
    if not results.exists():
        return
    text = results.read_text()
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + text[end + 1:] if end >= 0 else text[:start]
    anchor = text.find("\n## GPU")
    anchor = anchor + 1 if anchor >= 0 else len(text)
    text = text[:anchor] + section.rstrip("\n") + "\n\n" + text[anchor:]
    results.write_text(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="skip the compile regional rows")
    parser.add_argument("--compile-models", default="tiny,medium", help="models that get the compile regional rows")
    parser.add_argument("--out", default=str(RESULTS / "cache.md"))
    args = parser.parse_args(argv)
    started = time.time()
    rows, compiled = [], []
    for name in args.models.split(","):  # the page is written after each model: a long run keeps what it measured
        r, c = measure(name, args.steps, args.rounds,
                       not args.no_compile and name in args.compile_models.split(","))
        rows += r
        compiled += c
        write_page(args, rows, compiled, started)


def write_page(args, rows: list[dict], compiled: list[dict], started: float) -> None:
    done = sorted({row["model"] for row in rows}, key=args.models.split(",").index)
    command = f"`.venv/bin/python benchmarks/bench_cache.py --models {args.models} --steps {args.steps} " \
              f"--rounds {args.rounds}{' --no-compile' if args.no_compile else ''}" \
              f"{'' if args.compile_models == 'tiny,medium' else ' --compile-models ' + args.compile_models}`"
    body = (f"CPU: {cpu_name()}.  Command: {command}, {time.time() - started:.0f} s"
            f"{'' if len(done) == len(args.models.split(',')) else ' (so far: ' + ', '.join(done) + ')'}.  "
            f"Loop: {args.steps} denoiser "
            f"calls in one cache context (flow matching, timestep 1 → 0), {args.rounds} interleaved "
            "rounds after a warm-up; loop s is the median, each ratio the median of the rounds' ratios.  Models: "
            + "; ".join(f"{k}: {MODELS[k][0]}" for k in done)
            + ".  **Random weights say little about image quality**: the error column says how far each cache "
            "moves this loop's final latent (RMS ÷ RMS of the uncached one), not how an image would look; with "
            "random weights the block residuals change more from step to step than a trained model's, so "
            "threshold-based caches (first_block, mag) skip less than on a real model.\n\n"
            + table(rows, ["model", "cache", "loop s", "÷ uncached", "ours ÷ by hand", "identical to by hand",
                           "error vs uncached", "fails on Flux"]) + "\n")
    if compiled:
        body += ("\n`cache first_block threshold=0.2` with `compile regional in transformer_blocks.*, "
                 "single_transformer_blocks.*` (fullgraph=false; the cache's per-step decision stays in Python "
                 "between the compiled blocks):\n\n"
                 + table(compiled, ["model", "cache + compile regional ÷ cache alone",
                                    "compile regional alone ÷ uncached", "cache + compile regional ÷ uncached",
                                    "max difference to the cache alone"]) + "\n")
    page = header("Step caches against diffusers' enable_cache", started) + "\n" + body
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    print(page, flush=True)
    if path.resolve() == (RESULTS / "cache.md").resolve():  # a trial run (--out elsewhere) leaves RESULTS.md alone
        splice(HERE / "RESULTS.md", f"{SECTION}\n\nFrom [results/cache.md](results/cache.md), written by the script "
                                    f"that measured it.\n\n{body}")


if __name__ == "__main__":
    main()
