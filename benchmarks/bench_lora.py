"""``lora``: a merged LoRA under nf4, and a switchable one's cost per call, against diffusers/PEFT by hand.

    .venv/bin/python benchmarks/bench_lora.py [--heads 4] [--rank 16] [--rounds 5] [--compile]

Writes ``benchmarks/results/lora.md``.  On a Flux of FLUX.1's head size (``--heads 4``: width 512;
24 = FLUX.1's 3072) with one double and one single block, read with ``from_pretrained`` as a user
does, a LoRA (diffusers keys, random weights, rank ``--rank``) on every attention projection and
feed-forward layer, one torch thread, in one process:

- **merged + nf4**: ``transform(model, 'lora "X"; quantize nf4')`` against diffusers by hand
  (``load_lora_adapter`` + ``fuse_lora`` + ``unload_lora``, then bitsandbytes ``Linear4bit`` on the same
  layers: :func:`baselines.bnb_4bit`).  Load time = ``from_pretrained`` + LoRA + quantization; latency
  = one forward on the built-in sample input.  Both sides compute the same weights (the max difference
  of their outputs is shown).
- **switchable**: the time the adapters add to a call (``lora "X" merge=false``) against PEFT's
  (``load_lora_adapter``, unfused: PEFT's ``LoraLayer``): on one model, a call with the adapters on
  minus one with them off (``set_lora(enabled=...)``; PEFT: ``enable_lora``/``disable_lora``); and
  beside nf4 layers (ours: ``lora "X" merge=false; quantize nf4``; PEFT: its ``Linear4bit`` LoRA layer
  on :func:`baselines.bnb_4bit`).

``--compile`` adds a compiled model's scale changes and toggles (recompiles or not).

The sides run in turn, round after round, in ABBA order after the first; a round's latency is the
fastest of 5 calls, a comparison the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines  # noqa: E402
import torch  # noqa: E402
import workloads  # noqa: E402
from common import header, table, write  # noqa: E402

import transformdsl  # noqa: E402


def lora_file(model: torch.nn.Module, rank: int, path: Path) -> Path:
    """A diffusers-format LoRA on the attention projections and feed-forward layers (seed 0)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and (".attn." in name or ".ff" in name or "proj_mlp" in name):
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, module.in_features) / module.in_features ** 0.5
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, rank) * 0.01
    save_file(sd, str(path))
    return path


def by_hand_merged_nf4(workload, path: Path) -> torch.nn.Module:
    model = workloads.read(workload)
    model.load_lora_adapter(str(path), prefix="transformer", adapter_name="style")
    model.fuse_lora()
    model.unload_lora()
    return baselines.bnb_4bit("nf4")(model).eval()


def ours(workload, script: str) -> torch.nn.Module:
    model = workloads.read(workload)
    transformdsl.transform(model, script)
    return model.eval()


def peft(workload, path: Path, nf4: bool = False) -> torch.nn.Module:
    model = workloads.read(workload)
    if nf4:
        model = baselines.bnb_4bit("nf4")(model)
    model.load_lora_adapter(str(path), prefix="transformer", adapter_name="style")
    return model.eval()


def timed(build) -> tuple[float, torch.nn.Module]:
    start = time.perf_counter()
    model = build()
    return time.perf_counter() - start, model


def latency(model, inputs, calls: int = 5) -> float:
    """The fastest of ``calls`` calls (after one warm-up): the least disturbed by other processes."""
    times = []
    with torch.inference_mode():
        workloads.forward(model, inputs)
        for _ in range(calls):
            start = time.perf_counter()
            workloads.forward(model, inputs)
            times.append(time.perf_counter() - start)
    return min(times)


def rounds(sides: dict, n: int, measure) -> dict[str, list[float]]:
    """``measure(build)`` for each side, the sides in turn, ABBA after the first round."""
    out = {name: [] for name in sides}
    names = list(sides)
    for r in range(n):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            out[name].append(measure(sides[name]))
    return out


def compile_rows(rank: int) -> list[dict]:
    """A switchable LoRA under ``compile fullgraph=true`` (inductor) on the tiny Flux (fused, weight-only
    int8): each call's time and the graphs compiled so far, through scale changes and toggles."""
    import torch._dynamo.utils as dynamo_utils

    from transformdsl import models

    torch._dynamo.reset()
    model = models.tiny_flux()
    path = lora_file(model, rank, workloads.WORK / f"lora-tiny-r{rank}.safetensors")
    transformdsl.transform(model, f'lora "{path}" merge=false name=style\nfuse qkv\nquantize int8 weight_only=true\n'
                                  "compile fullgraph=true")
    rows = []
    steps = [("first call (compiles)", None), ("second call", None), ("set_lora(scale=0.3)", {"scale": 0.3}),
             ("set_lora(enabled=False)", {"enabled": False}), ("set_lora(enabled=True)", {"enabled": True}),
             ("set_lora(enabled=False) again", {"enabled": False}), ("set_lora(scale=0.7)", {"scale": 0.7})]
    for label, change in steps:
        if change:
            transformdsl.set_lora(model, "style", change.get("scale"), enabled=change.get("enabled"))
        start = time.perf_counter()
        models.run(model)
        rows.append({"step": label, "next call": f"{time.perf_counter() - start:.3f} s",
                     "graphs compiled so far": dynamo_utils.counters["stats"]["unique_graphs"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also measure a compiled model's scale changes "
                        "and toggles (inductor; minutes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = workloads.flux(f"h{args.heads}", args.heads)
    workloads.prepare(workload)
    path = lora_file(workloads.read(workload), args.rank, workloads.WORK / f"lora-h{args.heads}-r{args.rank}.safetensors")
    sample = workloads.sample(workloads.read(workload))

    # merged + nf4: load time and latency
    merged = {"transformdsl: lora + quantize nf4": lambda: ours(workload, f'lora "{path}"\nquantize nf4'),
              "diffusers fuse_lora + bitsandbytes by hand": lambda: by_hand_merged_nf4(workload, path)}
    loads = rounds(merged, args.rounds, lambda build: timed(build)[0])
    models_ = {name: build() for name, build in merged.items()}
    calls = rounds(models_, args.rounds, lambda model: latency(model, sample))
    with torch.inference_mode():
        outputs = [workloads.forward(m, sample) for m in models_.values()]
    difference = (outputs[0] - outputs[1]).abs().max().item()
    a, b = merged
    rows = [{"comparison": "merged LoRA + nf4: load (from_pretrained + LoRA + quantize)",
             "transformdsl": f"{statistics.median(loads[a]) * 1e3:.0f} ms",
             "by hand": f"{statistics.median(loads[b]) * 1e3:.0f} ms",
             "ratio": f"{statistics.median(x / y for x, y in zip(loads[a], loads[b])):.2f}×"},
            {"comparison": "merged LoRA + nf4: latency per call",
             "transformdsl": f"{statistics.median(calls[a]) * 1e3:.1f} ms",
             "by hand": f"{statistics.median(calls[b]) * 1e3:.1f} ms",
             "ratio": f"{statistics.median(x / y for x, y in zip(calls[a], calls[b])):.2f}×"}]

    # switchable: the time the adapters add to a call, each side measured on one model with its
    # adapters on, then off (ours: set_lora(enabled=...); PEFT: enable_lora / disable_lora)
    for label, script, nf4 in (("float", f'lora "{path}" merge=false name=style', False),
                               ("nf4", f'lora "{path}" merge=false name=style\nquantize nf4', True)):
        sides = {"ours": ours(workload, script), "peft": peft(workload, path, nf4)}

        def toggle(name: str, on: bool, sides: dict = sides) -> None:
            if name == "ours":
                transformdsl.set_lora(sides["ours"], "style", enabled=on)
            elif on:
                sides["peft"].enable_lora()
            else:
                sides["peft"].disable_lora()

        def added(name: str, sides: dict = sides) -> float:
            toggle(name, True)
            with_adapters = latency(sides[name], sample)
            toggle(name, False)
            without = latency(sides[name], sample)
            toggle(name, True)
            return with_adapters - without

        over = rounds({name: name for name in sides}, args.rounds, added)
        with torch.inference_mode():
            check = (workloads.forward(sides["ours"], sample) - workloads.forward(sides["peft"], sample)).abs().max()
        ours_over, peft_over = statistics.median(over["ours"]), statistics.median(over["peft"])
        rows.append({"comparison": f"switchable adapters beside {label} layers: time they add to a call (on "
                                   f"minus off, same model; outputs of the two sides differ by {check.item():.1e})",
                     "transformdsl": f"{ours_over * 1e3:.2f} ms",
                     "by hand": f"{peft_over * 1e3:.2f} ms (PEFT)",
                     "ratio": f"{ours_over / peft_over:.2f}×" if peft_over > 0 else "-"})
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    write("lora.md", "\n".join([
        header("lora: merged under nf4, and switchable adapters, against diffusers/PEFT by hand"), "",
        f"Command: `.venv/bin/python benchmarks/bench_lora.py --heads {args.heads} --rank {args.rank} "
        f"--rounds {args.rounds}{' --compile' if args.compile else ''}` (Flux, width {128 * args.heads}, 1 double + 1 single block; LoRA rank "
        f"{args.rank} on every attention projection and feed-forward layer; CPU: {cpu}; 1 torch thread; the "
        "sides in turn, ABBA; a round's latency the fastest of 5 calls, the median over rounds).", "",
        table(rows, ["comparison", "transformdsl", "by hand", "ratio"]), "",
        f"Merged: the two sides' outputs differ by {difference:.1e}: the merged weights are equal up to float "
        "rounding, and a weight at the edge between two nf4 codes may round to the other one.  The merged LoRA "
        "adds nothing to a call: the latency ratio is `quantize nf4`'s own against bitsandbytes by hand "
        "(RESULTS.md, flux-medium 'quantize nf4' row).  Switchable: ours adds `((x @ A.T) * scale) @ B.T` in "
        "the layer's forward; PEFT's LoraLayer does the same with dropout, per-adapter dictionaries and dtype "
        "casts around it.  Beside nf4 layers both sides' outputs differ by the two quantizations' own "
        "difference (ours is `quantize nf4`, PEFT's sits on bitsandbytes by hand).", "",
        *(["## With compile", "",
           "`lora \"X\" merge=false; fuse qkv; quantize int8 weight_only=true; compile fullgraph=true` on the tiny "
           "Flux (inductor, 1 thread): each step, then the time of the next call and the graphs dynamo has "
           "compiled so far (`torch._dynamo.utils.counters['stats']['unique_graphs']`).", "",
           table(compile_rows(args.rank), ["step", "next call", "graphs compiled so far"]), "",
           "The scale is a buffer the graph reads: no recompile.  `enabled` is guarded: the first call in each "
           "state compiles once, then both graphs are cached.", ""] if args.compile else [])]))


if __name__ == "__main__":
    main()
