"""load() against the floor: plain safetensors reading into the same structure.

    .venv/bin/python benchmarks/bench_persist.py [--size small|large]

Side by side in one run, on a Flux transformer (random weights) whose hidden size is
realistic (3072) but with few layers: the time of ``transformdsl.load(dir)`` (which builds
the architecture on the meta device from the saved config, replays the transforms and
reads the tensors) against ``safetensors.torch.load_file`` + ``load_state_dict`` into an
already-built model of the same structure (the floor: the same bytes read into place).
Target: within 1.3x.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import header, table, write  # noqa: E402

import transformdsl  # noqa: E402

SIZES = {
    # hidden 3072 = 24 heads x 128, like FLUX.1; layers cut down to fit a small machine.
    "large": dict(num_layers=1, num_single_layers=2, attention_head_dim=128, num_attention_heads=24,
                  joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64, axes_dims_rope=(16, 56, 56)),
    "small": dict(num_layers=1, num_single_layers=2, attention_head_dim=64, num_attention_heads=8,
                  joint_attention_dim=512, pooled_projection_dim=256, in_channels=64, axes_dims_rope=(8, 28, 28)),
}


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--script", default="", help="script to apply before saving (default: none)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**SIZES[args.size]).eval()
    if args.script:
        transformdsl.transform(model, args.script)
    params = sum(p.numel() for p in model.parameters())
    work = Path(tempfile.mkdtemp(prefix="bench-persist-"))
    try:
        directory = work / "model"
        start = time.perf_counter()
        transformdsl.save(model, directory)
        save_s = time.perf_counter() - start
        weights = directory / "model.safetensors"
        nbytes = weights.stat().st_size
        # Read the file once so both sides start from a warm page cache.
        weights.read_bytes()

        target = FluxTransformer2DModel(**SIZES[args.size]).eval()

        def floor():
            state = load_file(str(weights))
            target.load_state_dict(state, strict=True)
            return target

        floor_s = best_of(floor, args.repeats)
        load_s = best_of(lambda: transformdsl.load(directory), args.repeats)

        def load_and_touch():
            # Mapped pages are read on first use: touch every byte to count that too.
            loaded = transformdsl.load(directory)
            for tensor in loaded.state_dict().values():
                tensor.view(-1)[:: max(1, 4096 // tensor.element_size())].sum() if tensor.numel() else None
            return loaded

        touch_s = best_of(load_and_touch, args.repeats)
        copy_s = best_of(lambda: transformdsl.load(directory, mmap=False), args.repeats)
        loaded = transformdsl.load(directory)
        exact = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = [
        {"what": "safetensors load_file + load_state_dict (floor)", "seconds": f"{floor_s:.3f}",
         "GB/s": f"{nbytes / floor_s / 1e9:.2f}", "ratio": "1.00"},
        {"what": "transformdsl.load (config -> meta skeleton -> replay -> read)", "seconds": f"{load_s:.3f}",
         "GB/s": f"{nbytes / load_s / 1e9:.2f}", "ratio": f"{load_s / floor_s:.2f}"},
        {"what": "transformdsl.load, then every page touched", "seconds": f"{touch_s:.3f}",
         "GB/s": f"{nbytes / touch_s / 1e9:.2f}", "ratio": f"{touch_s / floor_s:.2f}"},
        {"what": "transformdsl.load(mmap=False) (bytes copied into fresh memory)", "seconds": f"{copy_s:.3f}",
         "GB/s": f"{nbytes / copy_s / 1e9:.2f}", "ratio": f"{copy_s / floor_s:.2f}"},
    ]
    text = header("Persistence: load() against plain safetensors reading")
    text += (f"\nModel: FluxTransformer2DModel ({args.size}: {params / 1e6:.0f} M parameters, "
             f"{nbytes / 1e9:.2f} GB file), script: `{args.script or 'none'}`; save took {save_s:.2f} s.\n"
             f"Best of {args.repeats}, warm page cache.  Reloaded tensors bit-equal: {exact}.\n\n")
    text += table(rows, ["what", "seconds", "GB/s", "ratio"]) + "\n"
    text += ("\nCommand: `.venv/bin/python benchmarks/bench_persist.py --size "
             f"{args.size}" + (f" --script '{args.script}'" if args.script else "") + "`\n")
    write(f"persist-{args.size}.md", text)


if __name__ == "__main__":
    main()
