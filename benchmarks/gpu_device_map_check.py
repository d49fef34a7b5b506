"""GPU check of ``load(dir, device_map=...)``: a transformed model placed over GPUs, CPU and disk.

    .venv/bin/python benchmarks/gpu_device_map_check.py [--out benchmarks/results/device-map-gpu.json]

Not run in CI (no GPU there).  For each quantization mode on the built-in Flux (diffusers) and Llama
(transformers): save the transformed model, then load it

1. whole on ``cuda:0`` (the reference);
2. with an explicit map: the first half of the top-level modules on ``cuda:0``, the rest on ``cuda:1``
   if there is one, else on the CPU and disk alternately;
3. with ``device_map="auto"`` and a ``max_memory`` that gives each GPU a third of the model, the CPU
   a third and the disk the rest;

and reports, per case, where the layers landed, whether every transformed layer kept its class and
dtypes, and the largest difference of the output to the reference (0 where the same kernels ran on
the same kind of device; layers run on the CPU use CPU kernels).  Exit status 1 if a case failed to
load or run, or a layer lost its quantization.  One to two minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import models  # noqa: E402

SCRIPTS = ["quantize int8", "quantize nf4", "quantize hqq bits=4 group_size=16", "fp8 storage",
           "fp8 native", "quantize int8 weight_only=true"]
BUILDERS = {"flux": models.tiny_flux, "llama": models.tiny_llama}


def layout(model) -> list:
    return ([(path, type(m).__name__) for path, m in model.named_modules()] +
            [(k, str(t.dtype), tuple(t.shape)) for k, t in model.state_dict().items()])


def output(model) -> torch.Tensor:
    return models.run(model).float().cpu()


def check(family: str, script: str, work: Path) -> list[dict]:
    rows = []
    model = BUILDERS[family]()
    transformdsl.transform(model, script)
    save = work / f"{family}-{script.replace(' ', '_')}"
    transformdsl.save(model, save)
    reference = transformdsl.load(save, device="cuda:0")
    expected, want = output(reference), layout(reference)
    size = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    children = [name for name, _ in reference.named_children()]
    gpus = torch.cuda.device_count()
    half = len(children) // 2
    if gpus > 1:
        explicit = {name: (0 if i < half else 1) for i, name in enumerate(children)}
    else:
        explicit = {name: (0 if i < half else ("cpu" if i % 2 else "disk")) for i, name in enumerate(children)}
    memory = {i: size // 3 for i in range(gpus)} | {"cpu": size // 3}
    for label, kwargs in (("explicit", {"device_map": explicit}),
                          ("auto", {"device_map": "auto", "max_memory": memory})):
        row = {"family": family, "script": script, "map": label}
        try:
            placed = transformdsl.load(save, offload_folder=work / f"offload-{family}-{label}", **kwargs)
            row["placed"] = {k: str(v) for k, v in placed.hf_device_map.items()}
            row["kept_quantized"] = layout(placed) == want
            got = output(placed)
            row["max_abs_diff"] = (got - expected).abs().max().item()
            row["bit_identical"] = bool(torch.equal(got, expected))
            row["ok"] = row["kept_quantized"] and torch.isfinite(got).all().item()
        except Exception as exc:  # a row saying what failed beats a lost run
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/device-map-gpu.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for family in BUILDERS:
            for script in SCRIPTS:
                rows += check(family, script, Path(work))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                                    "rows": rows}, indent=1))
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} cases placed, ran and kept their quantization; written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
