"""Quantized compute against float and against torchao, side by side in one run, on this CPU.

    python -m venv /tmp/vt && /tmp/vt/bin/pip install torch==2.13.0 && \
        /tmp/vt/bin/pip install -c requirements/constraints.txt -e '.[bench]' torchao==0.18.0
    /tmp/vt/bin/python benchmarks/bench_quantized_compute.py [--rounds 5] [--quick]

(any environment with torch 2.13; torchao's columns need torchao installed there: never in the
project's environment, where diffusers would import it on every import).  Writes
``benchmarks/results/quantized_compute.md`` and ``.json``.  One torch thread; every way of a
table runs in turn, round after round, and the minimum of each is kept (ratios compare calls made
one right after the other).

- **layers, prefill** (512 tokens, square layers at FLUX.1's width 3072 and Llama-7B's 4096):
  ``quantize w8a8`` against the fp32 and bf16 layer and torchao's
  ``Int8DynamicActivationInt8WeightConfig`` applied by hand (``quantize_``), and the relative
  error of each against the fp32 layer; the fallback (CPU flags hidden) against fp32;
- **layers, decode** (one token): ``quantize int8 weight_only=true`` (packed bf16 x int8 kernel)
  and ``quantize int4`` against fp32, bf16, torchao's ``Int8WeightOnlyConfig`` /
  ``Int4WeightOnlyConfig`` and the physical floor (weight bytes ÷ measured read bandwidth);
- **crossover**: the packed int8 kernel against the blocked cast-and-multiply by rows;
- **whole models**: medium Flux (width 768, 1024 image + 128 text tokens) with ``quantize w8a8``;
  a Llama-shaped LM at Llama-7B's width (one decoder layer, 4096/11008, 32 heads, vocabulary
  4096 so the decoder layer dominates): prefill of 512 tokens and decode of one token with a KV
  cache of 512, each mode ÷ fp32 / bf16 / torchao, and decode ÷ the floor.  torchao quantizes the
  same layers as ours (``quantize_`` with a ``filter_fn`` of the plan's targets: ``quantize``'s default
  exclusions, e.g. ``lm_head`` and Flux's embedders, norms and ``proj_out``, stay float on both sides).

Memory bandwidth: the best of several single-thread sums over a 1 GiB float32 tensor
(``torch.empty(1 << 28).sum()``), the read a decode step does.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from transformdsl import capabilities  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WIDTHS = (3072, 4096)
PREFILL, CONTEXT = 512, 512


# --------------------------------------------------------------------------- helpers


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def torchao():
    try:
        import torchao.quantization as q  # noqa: F401

        return q
    except ImportError:
        return None


def bandwidth(rounds: int = 5) -> float:
    """Bytes per second one thread reads (sum over 1 GiB of float32)."""
    data = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def race(ways: dict, rounds: int) -> dict[str, float]:
    """Seconds per call of each way (minimum over rounds; the ways in turn in each round)."""
    best = {name: float("inf") for name in ways}
    with torch.inference_mode():
        for call in ways.values():
            call()  # warm-up (packing, allocator)
        for _ in range(rounds):
            for name, call in ways.items():
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def ours(module: nn.Module, script: str) -> nn.Module:
    import transformdsl

    return transformdsl.transform(copy.deepcopy(module), script)


def by_torchao(module: nn.Module, config, script: str | None = None) -> nn.Module:
    """torchao's ``quantize_`` on a copy: on the layers ``script`` would quantize (the same layers,
    so that times and errors compare the schemes), or on every Linear (its default)."""
    import transformdsl

    q = torchao()
    model = copy.deepcopy(module)
    if script is None:
        q.quantize_(model, config)
    else:
        targets = set(transformdsl.plan(module, script).steps[0].targets)
        q.quantize_(model, config, filter_fn=lambda m, fqn: fqn in targets)
    return model


def weight_bytes(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Bytes a forward reads of the module's stored tensors (each storage once)."""
    def size(tensor: torch.Tensor) -> int:
        if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):  # torchao's subclasses
            names, _ = tensor.__tensor_flatten__()
            return sum(size(getattr(tensor, n)) for n in names)
        return tensor.numel() * tensor.element_size()

    seen, total = set(), 0
    for name, tensor in module.state_dict().items():
        if any(s in name for s in skip) or not isinstance(tensor, torch.Tensor):
            continue
        try:
            key = (tensor.untyped_storage().data_ptr(), tensor.dtype)
        except RuntimeError:  # a tensor subclass without storage of its own
            key = (id(tensor), None)
        if key not in seen:
            seen.add(key)
            total += size(tensor)
    return total


def x(value: float) -> str:
    return f"{value:.2f}×"


# --------------------------------------------------------------------------- layers


def layers_prefill(rounds: int) -> list[dict]:
    q = torchao()
    rows = []
    for width in WIDTHS:
        torch.manual_seed(0)
        linear = nn.Linear(width, width).eval()
        bf16 = copy.deepcopy(linear).to(torch.bfloat16)
        w8a8 = ours(nn.Sequential(linear), "quantize w8a8")
        with capabilities.hidden_cpu_flags(*capabilities.INT8_DOT_FLAGS):
            fallback = ours(nn.Sequential(linear), "quantize w8a8")
        inp = torch.randn(PREFILL, width)
        inp_bf = inp.bfloat16()
        ways = {"fp32": lambda: linear(inp), "bf16": lambda: bf16(inp_bf), "w8a8": lambda: w8a8(inp),  # noqa: B023 (called at once, in this iteration)
                "w8a8 fallback": lambda: fallback(inp)}  # noqa: B023 (called at once, in this iteration)
        if q is not None:
            tao = by_torchao(nn.Sequential(linear), q.Int8DynamicActivationInt8WeightConfig())
            ways["torchao"] = lambda: tao(inp)  # noqa: B023 (called at once, in this iteration)
        t = race(ways, rounds)
        with torch.inference_mode():
            ref = linear(inp)
            err = rel(w8a8(inp), ref)
            err_tao = rel(tao(inp), ref) if q is not None else None
        rows.append({"width": width, "tokens": PREFILL, **{k + " ms": v * 1e3 for k, v in t.items()},
                     "w8a8 ÷ fp32": t["w8a8"] / t["fp32"], "w8a8 ÷ bf16": t["w8a8"] / t["bf16"],
                     "w8a8 ÷ torchao": t["w8a8"] / t["torchao"] if q is not None else None,
                     "fallback ÷ fp32": t["w8a8 fallback"] / t["fp32"],
                     "error": err, "torchao error": err_tao,
                     "error ÷ torchao": err / err_tao if err_tao else None})
        print(rows[-1], flush=True)
    return rows


def layers_decode(rounds: int, bytes_per_s: float) -> list[dict]:
    q = torchao()
    rows = []
    for width in WIDTHS:
        torch.manual_seed(0)
        linear = nn.Linear(width, width, bias=False).eval()
        bf16 = copy.deepcopy(linear).to(torch.bfloat16)
        int8 = ours(nn.Sequential(bf16), "quantize int8 weight_only=true")
        int4 = ours(nn.Sequential(bf16), "quantize int4 group_size=128")
        inp = torch.randn(1, width)
        inp_bf = inp.bfloat16()
        ways = {"fp32": lambda: linear(inp), "bf16": lambda: bf16(inp_bf), "int8": lambda: int8(inp_bf),  # noqa: B023 (called at once, in this iteration)
                "int4": lambda: int4(inp_bf)}  # noqa: B023 (called at once, in this iteration)
        if q is not None:
            tao8 = by_torchao(nn.Sequential(bf16), q.Int8WeightOnlyConfig())
            ways["torchao int8"] = lambda: tao8(inp_bf)  # noqa: B023 (called at once, in this iteration)
        t = race(ways, rounds)
        floor8 = weight_bytes(int8) / bytes_per_s
        floor4 = weight_bytes(int4) / bytes_per_s
        row = {"width": width, **{k + " ms": v * 1e3 for k, v in t.items()},
               "int8 ÷ fp32": t["int8"] / t["fp32"], "int8 ÷ torchao": (t["int8"] / t["torchao int8"]
                                                                      if q is not None else None),
               "int8 ÷ floor": t["int8"] / floor8, "int4 ÷ fp32": t["int4"] / t["fp32"],
               "int4 ÷ floor": t["int4"] / floor4, "int4 ÷ torchao": None}
        rows.append(row)
        print(row, flush=True)
    return rows


def crossover(rounds: int) -> list[dict]:
    from transformdsl.transforms.quantize.int8_weight_only import Int8WeightOnlyLinear, int8_linear

    rows = []
    for width in WIDTHS:
        torch.manual_seed(0)
        layer = Int8WeightOnlyLinear.build(torch.randn(width, width), None)
        scale = layer.weight_scale.bfloat16()
        for tokens in (1, 2, 4, 8, 16, 32):
            inp = torch.randn(tokens, width, dtype=torch.bfloat16)
            t = race({"packed": lambda: torch.ops.aten._weight_int8pack_mm(inp, layer.int8_weight, scale),  # noqa: B023 (called at once, in this iteration)
                      "blocked": lambda: int8_linear(inp, layer.int8_weight) * scale}, rounds)  # noqa: B023 (called at once, in this iteration)
            rows.append({"width": width, "tokens": tokens, "packed ms": t["packed"] * 1e3,
                         "blocked ms": t["blocked"] * 1e3, "packed ÷ blocked": t["packed"] / t["blocked"]})
            print(rows[-1], flush=True)
    return rows


# --------------------------------------------------------------------------- models


def flux_model(rounds: int) -> dict:
    import workloads

    q = torchao()
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**workloads.flux_config(heads=6)).eval()  # benchmarks' medium Flux
    torch.manual_seed(0)
    image, text = 1024, 128
    inputs = dict(hidden_states=torch.randn(1, image, 64), encoder_hidden_states=torch.randn(1, text, 4096),
                  pooled_projections=torch.randn(1, 768), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(image, 3), txt_ids=torch.zeros(text, 3), return_dict=False)
    inputs_bf = {k: (v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                 for k, v in inputs.items()}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    w8a8 = ours(model, "quantize w8a8")
    ways = {"fp32": lambda: model(**inputs)[0], "bf16": lambda: bf16(**inputs_bf)[0],
            "w8a8": lambda: w8a8(**inputs)[0]}
    if q is not None:
        tao = by_torchao(model, q.Int8DynamicActivationInt8WeightConfig(), "quantize w8a8")
        ways["torchao"] = lambda: tao(**inputs)[0]
    t = race(ways, rounds)
    with torch.inference_mode():
        ref = model(**inputs)[0]
        err = rel(w8a8(**inputs)[0], ref)
        err_tao = rel(tao(**inputs)[0], ref) if q is not None else None
    row = {"model": "flux-medium (768 wide, 1024+128 tokens)", **{k + " s": v for k, v in t.items()},
           "w8a8 ÷ fp32": t["w8a8"] / t["fp32"], "w8a8 ÷ bf16": t["w8a8"] / t["bf16"],
           "w8a8 ÷ torchao": t["w8a8"] / t["torchao"] if q is not None else None,
           "error": err, "torchao error": err_tao}
    print(row, flush=True)
    return row


def llama(rounds: int, bytes_per_s: float) -> list[dict]:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    q = torchao()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=4096, max_position_embeddings=2048,
                         attn_implementation="sdpa")
    fp32 = LlamaForCausalLM(config).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    prompt = torch.randint(0, 4096, (1, PREFILL))
    step = torch.randint(0, 4096, (1, 1))
    models = {"fp32": fp32, "bf16": bf16, "w8a8": ours(fp32, "quantize w8a8"),
              "int8 weight-only": ours(bf16, "quantize int8 weight_only=true"),
              # the float32 model as it is: decode-sized inputs rounded to bfloat16 inside each layer
              "int8 weight-only (fp32 model)": ours(fp32, "quantize int8 weight_only=true"),
              "int4": ours(bf16, "quantize int4 group_size=128")}
    if q is not None:
        models["torchao w8a8"] = by_torchao(fp32, q.Int8DynamicActivationInt8WeightConfig(), "quantize w8a8")
        models["torchao int8 weight-only"] = by_torchao(bf16, q.Int8WeightOnlyConfig(),
                                                        "quantize int8 weight_only=true")

    def prefill(model):
        return lambda: model(prompt, use_cache=False).logits

    caches = {}
    with torch.inference_mode():
        for name, model in models.items():
            cache = DynamicCache(config=config)
            model(prompt, past_key_values=cache, use_cache=True)
            caches[name] = cache

    def decode(name):
        model, cache = models[name], caches[name]

        def call():
            out = model(step, past_key_values=cache, use_cache=True).logits
            cache.crop(-1)  # drop the token just added: the same context length at every call
            return out
        return call

    prefill_ways = {n: prefill(models[n]) for n in ("fp32", "bf16", "w8a8", "torchao w8a8") if n in models}
    decode_ways = {n: decode(n) for n in models if n != "w8a8" and n != "torchao w8a8"}
    tp = race(prefill_ways, max(2, rounds // 2))
    td = race(decode_ways, rounds * 3)
    with torch.inference_mode():
        ref = fp32(prompt, use_cache=False).logits
        errors = {n: rel(m(prompt, use_cache=False).logits, ref) for n, m in models.items() if n != "fp32"}
    skip = ("embed_tokens",)  # a decode step reads one row of the embedding
    floors = {n: weight_bytes(models[n], skip) / bytes_per_s for n in decode_ways}
    rows = [{"model": f"llama-7B-wide, prefill {PREFILL}", **{k + " s": v for k, v in tp.items()},
             "w8a8 ÷ fp32": tp["w8a8"] / tp["fp32"], "w8a8 ÷ bf16": tp["w8a8"] / tp["bf16"],
             "w8a8 ÷ torchao": tp["w8a8"] / tp["torchao w8a8"] if q is not None else None,
             "error": errors["w8a8"], "torchao error": errors.get("torchao w8a8")}]
    decode_row = {"model": f"llama-7B-wide, decode 1 token (cache {CONTEXT})",
                  **{k + " ms": v * 1e3 for k, v in td.items()}}
    for name in ("int8 weight-only", "int8 weight-only (fp32 model)", "int4", "bf16"):
        decode_row[f"{name} ÷ fp32"] = td[name] / td["fp32"]
        decode_row[f"{name} ÷ floor"] = td[name] / floors[name]
        decode_row[f"{name} error"] = errors[name]
    decode_row["fp32 ÷ floor"] = td["fp32"] / floors["fp32"]
    if q is not None:
        decode_row["int8 weight-only ÷ torchao"] = td["int8 weight-only"] / td["torchao int8 weight-only"]
        decode_row["torchao int8 error"] = errors["torchao int8 weight-only"]
    decode_row["weight MB read per token"] = {n: round(weight_bytes(models[n], skip) / 1e6, 1) for n in decode_ways}
    rows.append(decode_row)
    for row in rows:
        print(row, flush=True)
    return rows


# --------------------------------------------------------------------------- imports


def import_costs() -> dict:
    """diffusers' import time with torchao installed (this interpreter, if it has torchao) and without
    (the project's environment), what it pulls in; and that ``import transformdsl`` and the
    declarations ``check`` reads import neither torchao nor torch."""
    code = ("import time, sys; s = time.perf_counter(); from diffusers import FluxTransformer2DModel; "
            "print(round(time.perf_counter() - s, 2), 'torchao' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = {}
    project = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    if not project.exists():
        project = Path("/work/main/.venv/bin/python")
    for label, python in (("this environment", sys.executable), ("project environment", str(project))):
        runs = []
        for _ in range(3):
            result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
            if result.stdout.split():
                runs.append(result.stdout.split())
        if runs:
            times = sorted(float(r[0]) for r in runs)
            out[label] = {"from diffusers import FluxTransformer2DModel, s (median of 3)": times[len(times) // 2],
                          "torchao imported": runs[0][1], "torch._dynamo imported": runs[0][2]}
    mine = ("import sys, transformdsl; from transformdsl import registry; "
            "[registry.declaration(k) for k in ('quantize w8a8', 'quantize int4', 'fp8 dynamic')]; "
            "print('torchao' in sys.modules, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", mine], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    out["import transformdsl + declarations: torchao, torch imported"] = result.stdout.strip()
    return out


# --------------------------------------------------------------------------- page


def table(rows: list[dict]) -> str:
    keys = []
    for row in rows:
        keys += [k for k in row if k not in keys]

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="layers only")
    parser.add_argument("--render", action="store_true", help="write the page again from the JSON of the last run")
    parser.add_argument("--llama-only", metavar="NAME", help="measure the whole-Llama rows again and write them into "
                        "results/NAME.json and NAME.md (e.g. quantized_compute-epyc: a run on this CPU)")
    args = parser.parse_args()
    if args.render:
        data = json.loads((RESULTS / "quantized_compute.json").read_text())
        (RESULTS / "quantized_compute.md").write_text(render(data))
        return
    torch.set_num_threads(1)
    if args.llama_only:
        page = RESULTS / f"{args.llama_only}.json"
        data = json.loads(page.read_text())
        if data["cpu"] != cpu_name():
            sys.exit(f"{page.name} was measured on {data['cpu']}, this is {cpu_name()}: a page holds one CPU's figures")
        data["llama"] = llama(args.rounds, data["bandwidth GB/s"] * 1e9)
        data["llama measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        page.write_text(json.dumps(data, indent=1, default=str))
        page.with_suffix(".md").write_text(render(data))
        return
    started = time.time()
    q = torchao()
    cpu = capabilities.describe_cpu()
    bytes_per_s = bandwidth()
    print(f"bandwidth {bytes_per_s / 1e9:.1f} GB/s", flush=True)
    data = {"cpu": cpu_name(), "capabilities": cpu, "torch": torch.__version__,
            "torchao": getattr(sys.modules.get("torchao"), "__version__", None) if q else None,
            "bandwidth GB/s": bytes_per_s / 1e9, "rounds": args.rounds,
            "load before": os.getloadavg()}
    data["prefill layers"] = layers_prefill(args.rounds)
    data["decode layers"] = layers_decode(args.rounds * 5, bytes_per_s)  # milliseconds: more rounds
    data["crossover"] = crossover(args.rounds * 5)
    if not args.quick:
        data["flux"] = flux_model(max(2, args.rounds // 2))
        data["llama"] = llama(args.rounds, bytes_per_s)
    data["imports"] = import_costs()
    data["load after"] = os.getloadavg()
    data["seconds"] = time.time() - started
    data["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quantized_compute.json").write_text(json.dumps(data, indent=1, default=str))
    page = render(data)
    (RESULTS / "quantized_compute.md").write_text(page)
    print(page)


def render(data: dict) -> str:
    cpu = data["capabilities"]
    text = (f"# Quantized compute: W8A8, packed int8/int4 weight-only, against float and torchao\n\n"
            f"Measured {data.get('measured') or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {data['cpu']} "
            f"({capabilities.cpu_text(cpu)}), one torch thread; torch {data['torch']}, torchao {data['torchao']}; "
            f"load average {data['load before'][0]:.1f} before, {data['load after'][0]:.1f} after (a shared "
            f"machine: ratios compare calls made in turn).  Memory read bandwidth (one thread, the floor's "
            f"denominator): {data['bandwidth GB/s']:.1f} GB/s.\n\n"
            "Command: `python benchmarks/bench_quantized_compute.py"
            f" --rounds {data['rounds']}`, in a venv with torchao {data['torchao']} beside the project's stack (the module "
            "docstring says how to make one; bandwidth: the best of 5 `torch.ones(1 << 28).sum()`, in the same run).\n")
    text += "\n## Targets\n\n" + targets(data) + "\n"
    text += f"\n## Layers, prefill ({PREFILL} tokens, float32 input; times in ms)\n\n" + table(data["prefill layers"])
    text += ("\n\n`w8a8 fallback`: the same layer built with the CPU's int8 dot-product flags hidden "
             "(`TRANSFORMDSL_HIDE_CPU_FLAGS`): the int8 values multiplied in float32.\n")
    text += "\n## Layers, decode (1 token, bfloat16 activations; times in ms)\n\n" + table(data["decode layers"])
    text += ("\n\ntorchao 0.18 has no int4 weight-only layout for a CPU (its `Int4CPULayout` is gone; `plain` and "
             "`preshuffled` need the mslk package, `tile_packed_to_4d` CUDA): no `int4 ÷ torchao` here.\n")
    text += ("\n## Packed int8 kernel against the blocked cast-and-multiply, by rows (bfloat16)\n\n"
             + table(data["crossover"]) + "\n\nDecode-sized inputs (at most 8 rows) take the packed kernel "
             "(`PACKED_MAX_ROWS`).\n")
    if "flux" in data:
        text += "\n## Whole models\n\n"
        if data.get("llama measured"):
            text += (f"The Llama rows were measured again on {data['llama measured']} "
                     f"(`--llama-only`), on the same CPU.\n\n")
        text += table([data["flux"]]) + "\n\n" + table(data["llama"][:1])
        text += "\n\n" + table(data["llama"][1:]) + "\n"
    imports = data["imports"]
    rows = [{"environment": k, **v} for k, v in imports.items() if isinstance(v, dict)]
    text += "\n## Imports\n\n" + table(rows) + "\n\n" + "".join(
        f"{k}: {v}\n" for k, v in imports.items() if not isinstance(v, dict))
    return text


def targets(data: dict) -> str:
    rows = []

    def add(what, value, target, limit):
        if value is None:
            rows.append({"measure": what, "value": "not measured", "target": target, "met": ""})
        else:
            met = "" if limit is None else "yes" if value <= limit else "NO"
            rows.append({"measure": what, "value": x(value), "target": target, "met": met})
    for r in data["prefill layers"]:
        add(f"w8a8 layer {r['width']}, {r['tokens']} tokens: latency ÷ fp32", r["w8a8 ÷ fp32"], "≤ 0.5×", 0.5)
        add(f"w8a8 layer {r['width']}: latency ÷ torchao int8 dynamic", r["w8a8 ÷ torchao"], "≤ 1.0×", 1.0)
        add(f"w8a8 layer {r['width']}: error ÷ torchao's", r["error ÷ torchao"], "≈ 1×", 1.1)
    if "llama" in data:
        d = data["llama"][1]
        add("llama decode: int8 weight-only time per token ÷ fp32", d["int8 weight-only ÷ fp32"], "≤ 0.6×", 0.6)
        add("llama decode, float32 model quantized as it is: int8 weight-only ÷ fp32",
            d.get("int8 weight-only (fp32 model) ÷ fp32"), "≤ 0.6×", 0.6)
        add("llama decode: int4 time per token ÷ fp32", d["int4 ÷ fp32"], "≤ 0.35×", 0.35)
        add("llama decode: int8 weight-only ÷ torchao", d.get("int8 weight-only ÷ torchao"), "≤ 1.0×", 1.0)
        rows.append({"measure": "llama decode: int4 ÷ torchao", "value": "torchao has no CPU int4 path",
                     "target": "≤ 1.0×", "met": ""})
        add("llama decode: int8 weight-only ÷ floor", d["int8 weight-only ÷ floor"], "report (floor = 1)", None)
        add("llama decode: int4 ÷ floor", d["int4 ÷ floor"], "report (floor = 1)", None)
        p = data["llama"][0]
        add("llama prefill 512: w8a8 ÷ fp32", p["w8a8 ÷ fp32"], "≤ 0.5×", 0.5)
        add("llama prefill 512: w8a8 ÷ torchao", p.get("w8a8 ÷ torchao"), "≤ 1.0×", 1.0)
        f = data["flux"]
        add("flux-medium: w8a8 ÷ fp32", f["w8a8 ÷ fp32"], "report", None)
        add("flux-medium: w8a8 ÷ torchao", f.get("w8a8 ÷ torchao"), "≤ 1.0×", 1.0)
    return table(rows)


if __name__ == "__main__":
    main()
