"""quantize int8 / nf4 / hqq 4-bit against the float32 and bfloat16 models, side by side.

    .venv/bin/python benchmarks/bench_quantize.py [--repeats 5] [--skip-wide]

For each built-in tiny model (Flux transformer, UNet, Llama) and for a stack of realistically
wide linear layers (an MLP 1024 -> 4096 -> 1024, twice), in one run:

- bytes: everything the model saves (state_dict), and the quantized layers' bytes against
  their float32 bytes;
- latency: median wall time of one forward (``models.run``), CPU, torch's thread count;
- accuracy: relative L2 error of the output against the float32 model;
- quantize time against ``transformdsl.load`` of the saved quantized model (which replays the
  structure and reads the quantized tensors: nothing is quantized again).

Writes ``benchmarks/results/quantize.md``.  A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's transformdsl

import torch  # noqa: E402
from common import header, median_time, table, write  # noqa: E402
from torch import nn  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import models  # noqa: E402
from transformdsl.history import history_of  # noqa: E402

#: hqq's group size must divide every quantized layer's in_features (tiny Flux: 16 and 80).
MODELS = {
    "flux": (models.tiny_flux, 16),
    "unet": (models.tiny_unet, 32),
    "llama": (models.tiny_llama, 64),
}


class WideMLP(nn.Module):
    """Two transformer-sized MLPs (1024 -> 4096 -> 1024): 16.8 M parameters, 64 MiB in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return WideMLP().eval()


def state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def mib(n: int) -> str:
    return f"{n / 2**20:.3f}" if n < 2**20 else f"{n / 2**20:.1f}"


def measure(name: str, make, group_size: int, repeats: int) -> list[dict]:
    """One row per variant of one model."""
    if name == "wide-mlp":
        x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(0))

        def run(model):
            bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters())
            with torch.no_grad():
                return model(x.to(torch.bfloat16) if bf16 else x)
    else:
        run = models.run
    base = make()
    reference = run(base)
    rows = [row(name, "float32", base, run, reference, repeats)]
    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    rows.append(row(name, "bfloat16", bf16, run, reference, repeats))
    del bf16
    for label, script in (("int8", "quantize int8"), ("nf4", "quantize nf4"),
                          ("hqq 4-bit", f"quantize hqq bits=4 group_size={group_size}")):
        model = make()
        started = time.perf_counter()
        transformdsl.transform(model, script)
        quantize_s = time.perf_counter() - started
        record = history_of(model).steps[-1].record
        entry = row(name, label, model, run, reference, repeats)
        entry["quantized layers"] = f"{len(record['layers'])}: {record['bytes_after'] / record['bytes_before']:.3f}x"
        with tempfile.TemporaryDirectory() as tmp:
            transformdsl.save(model, Path(tmp) / "m")
            gc.collect()
            started = time.perf_counter()
            loaded = transformdsl.load(Path(tmp) / "m", model=make if name == "wide-mlp" else None)
            load_s = time.perf_counter() - started
            same = torch.equal(run(loaded), run(model))
        entry["quantize s"] = f"{quantize_s:.3f}"
        entry["load s"] = f"{load_s:.3f}"
        entry["load vs quantize"] = f"{quantize_s / load_s:.1f}x faster" + ("" if same else " (OUTPUT DIFFERS)")
        rows.append(entry)
        del model, loaded
    return rows


def row(name: str, label: str, model: nn.Module, run, reference: torch.Tensor, repeats: int) -> dict:
    out = run(model)
    latency = median_time(lambda: run(model), repeats=repeats)
    return {
        "model": name,
        "variant": label,
        "MiB saved": mib(state_bytes(model)),
        "latency ms": f"{latency * 1e3:.2f}",
        "rel. error": "0" if label == "float32" else f"{rel_error(out, reference):.4f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-wide", action="store_true", help="only the tiny models (seconds)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for name, (make, group_size) in MODELS.items():
        rows.extend(measure(name, make, group_size, args.repeats))
        print(f"{name} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if not args.skip_wide:
        rows.extend(measure("wide-mlp", wide_mlp, 64, args.repeats))
    columns = ["model", "variant", "MiB saved", "quantized layers", "latency ms", "rel. error", "quantize s",
               "load s", "load vs quantize"]
    text = "\n".join([
        header("quantize: int8, nf4, hqq 4-bit against float32 and bfloat16"),
        "Default exclusions (norms, embeddings/embedders, output heads stay float).  `MiB saved`: every",
        "tensor the model saves.  `quantized layers`: count, and their bytes against their float32",
        "bytes.  `rel. error`: relative L2 error of the output against float32.  `load s`:",
        "`transformdsl.load` of the saved quantized model (structure replayed, tensors read, nothing",
        "quantized again), against `quantize s`, the time `transform` took.  Latency: median of",
        f"{args.repeats}.  On CPU the quantized layers dequantize (or quantize activations) on every",
        "call: they save memory, not time; the tiny models' latency is mostly Python overhead.",
        "",
        table(rows, columns),
        "",
        f"Total benchmark time: {time.perf_counter() - started:.0f} s.",
        "",
    ])
    write("quantize.md", text)


if __name__ == "__main__":
    main()
