"""The diffusers direction of interchange, which needs a GPU (diffusers' bitsandbytes loader
refuses without one: "No GPU found. A GPU is needed for quantization").

    .venv/bin/python benchmarks/gpu_interop_check.py [--out benchmarks/results/interop-gpu.json]

Checks, on the tiny Flux transformer (real diffusers class, random weights):

1. transformdsl -> stock diffusers: ``quantize int8|nf4 ... except proj_out`` on the CPU, saved with
   ``format="diffusers"``, loaded by ``FluxTransformer2DModel.from_pretrained`` in a fresh process
   that never imports transformdsl (tests/stock_loader.py), run on the GPU; compared with our CPU output.
2. stock diffusers -> transformdsl: diffusers quantizes the same model with its ``BitsAndBytesConfig``
   on the GPU and saves it; ``transformdsl.load`` rebuilds our layers from that directory (no
   re-quantization), runs on the CPU, takes ``compile`` and saves again.  Compared with the stock output.
3. transformers fp8 on the GPU: ``fp8 storage`` on tiny Llama saved with ``format="transformers"``;
   the stock loader keeps it in fp8 (``FP8Linear``) on a GPU with compute capability >= 8.9.

CPU and GPU kernels differ, so outputs are compared with a relative tolerance (``TOL``), not bit
for bit (the CPU tests in tests/test_interop.py compare bit for bit where the kernels are the same).
Without CUDA the script says so and exits 0.  Exit status 1 if any check fails.  About a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl.history import history_of  # noqa: E402
from transformdsl.models import run, sample_inputs, tiny_flux, tiny_llama  # noqa: E402

#: Relative tolerance between CPU (ours) and GPU (stock) outputs, per mode.
TOL = {"int8": 0.05, "nf4": 0.05, "fp8": 0.05}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def stock(directory: Path, library: str, cls: str, model, tmp: Path) -> tuple[torch.Tensor, dict]:
    args, kwargs = sample_inputs(model)
    tensors = {f"arg{i}": a for i, a in enumerate(args)}
    tensors.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "in.safetensors"))
    jobs = [{"dir": str(directory), "library": library, "class": cls, "inputs": str(tmp / "in.safetensors"),
             "out": str(tmp / "out.safetensors"), "device": "cuda"}]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "stock_loader.py"), str(tmp / "jobs.json")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    report = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("STOCK ")][-1][6:])[0]
    with safe_open(str(tmp / "out.safetensors"), "pt") as f:
        return f.get_tensor("out"), report


def to_diffusers(mode: str, tmp: Path) -> dict:
    model = tiny_flux()
    script = {"int8": "quantize int8 except proj_out", "nf4": "quantize nf4 compute=bfloat16 except proj_out"}[mode]
    transformdsl.transform(model, script)
    transformdsl.save(model, tmp / f"ours-{mode}", format="diffusers")
    out, report = stock(tmp / f"ours-{mode}", "diffusers", "FluxTransformer2DModel", model, tmp)
    error = relative_error(out, run(model))
    return {"check": f"transformdsl -> stock diffusers ({mode})", "error": error, "ok": error <= TOL[mode],
            "stock_layers": report["layers"], "stock_device": report["device"]}


def from_diffusers(mode: str, tmp: Path) -> dict:
    import diffusers

    plain = tiny_flux()
    plain.save_pretrained(tmp / "flux-fp")
    config = (diffusers.BitsAndBytesConfig(load_in_8bit=True) if mode == "int8" else
              diffusers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_compute_dtype=torch.bfloat16))
    quantized = diffusers.FluxTransformer2DModel.from_pretrained(tmp / "flux-fp", quantization_config=config)
    quantized.save_pretrained(tmp / f"stock-{mode}")
    args, kwargs = sample_inputs(plain, device="cuda")
    with torch.no_grad():
        expected = quantized(*args, **kwargs).sample
    ours = transformdsl.load(tmp / f"stock-{mode}")
    error = relative_error(run(ours), expected)
    transformdsl.transform(ours, "compile")
    transformdsl.save(ours, tmp / f"again-{mode}")
    again = transformdsl.load(tmp / f"again-{mode}")
    keys = [s.key for s in history_of(again).steps]
    return {"check": f"stock diffusers -> transformdsl ({mode})", "error": error,
            "ok": error <= TOL[mode] and keys == [f"quantize {mode}", "compile"], "steps": keys}


def transformers_fp8(tmp: Path) -> dict:
    model = tiny_llama()
    transformdsl.transform(model, "fp8 storage compute=bfloat16 except embed_tokens")
    transformdsl.save(model, tmp / "llama-fp8", format="transformers")
    out, report = stock(tmp / "llama-fp8", "transformers", "LlamaForCausalLM", model, tmp)
    error = relative_error(out, run(model))
    return {"check": "transformdsl -> stock transformers fp8 on GPU", "error": error, "ok": error <= TOL["fp8"],
            "stock_layers": report["layers"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "interop-gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the diffusers direction of interchange needs one; nothing checked")
        return 0
    results = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        checks = [lambda: to_diffusers("int8", tmp), lambda: to_diffusers("nf4", tmp),
                  lambda: from_diffusers("int8", tmp), lambda: from_diffusers("nf4", tmp)]
        if torch.cuda.get_device_capability() >= (8, 9):
            checks.append(lambda: transformers_fp8(tmp))
        for check in checks:
            try:
                results.append(check())
            except Exception as exc:  # report every check, then fail
                results.append({"check": getattr(check, "__name__", "check"), "ok": False,
                                "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(json.dumps(results[-1]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
