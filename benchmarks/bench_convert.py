"""``convert`` against model size: peak RSS and time, against the in-memory ways.

    nice -n 10 .venv/bin/python benchmarks/bench_convert.py [--sizes small,medium,1b] [--script "quantize nf4"]
    nice -n 10 .venv/bin/python benchmarks/bench_convert.py --flux-dev /work/bigckpt   # the larger-than-memory run

Writes ``benchmarks/results/convert.md`` and ``convert.json`` (``benchmarks/run.py --report-only`` puts
them in RESULTS.md, with a chart).

The checkpoints are Llama models (transformers ``save_pretrained``, bf16, random weights) of growing
size, the largest shaped like TinyLlama-1.1B.  Three ways, each in a fresh process under a watchdog:

- **convert**: ``transformdsl.convert(checkpoint, script, out)``, unit by unit;
- **load → transform → save**: ``transformdsl.load`` (memory-mapped), ``transform``, ``save``;
- **transformers + bitsandbytes**: ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``
  then ``save_pretrained`` (the library quantizes each tensor as it loads it).

**peak RSS** is the highest resident memory of the process during the job above what it held before
(its imports done; Linux ``clear_refs``/``VmHWM``), and the watchdog's samples split it into anonymous
memory (``RssAnon``: tensors) and file pages (``RssFile``: the memory-mapped checkpoint, which the
kernel can drop at will).

``--flux-dev DIR`` writes a FLUX.1-dev-shaped ``FluxTransformer2DModel`` (diffusers' default
configuration: 19 double and 38 single blocks, 24 heads × 128, ``joint_attention_dim`` 4096, guidance
embedding; 11.9 B parameters, 23.8 GB in bf16) block by block with random weights, never whole in
memory, converts it with ``quantize nf4`` and ``fp8 storage`` under a watchdog (``--max-rss-gb``,
10 by default), loads each result and runs one forward at a 16×16 latent; then deletes ``DIR``.
``--smoke`` does the same with one double and one single block (1 GB, about a minute) and only
prints its table: a check that the long run will get to the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from common import RESULTS, cpu_model, header, table, write  # noqa: E402

#: name -> (hidden, intermediate, layers, heads, kv heads, vocab)
SIZES = {
    "small": (512, 1376, 8, 8, 8, 32000),
    "medium": (1024, 2816, 16, 16, 4, 32000),
    "1b": (2048, 5632, 22, 32, 4, 32000),  # TinyLlama-1.1B's shape
}
WAYS = ("convert", "load → transform → save", "transformers + bitsandbytes")


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def make_checkpoint(size: str, directory: Path) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, heads, kv, vocab = SIZES[size]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="1GB")
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "bytes": sum(p.stat().st_size for p in directory.glob("*.safetensors"))}


def _job(way: str, source: str, script: str, out: str, writer, threads: int = 1, workers: int = 1) -> None:
    import gc

    # Imported before the baseline: what every way needs (the libraries, our passes).
    import bitsandbytes  # noqa: F401
    import diffusers  # noqa: F401
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import transformdsl
    import transformdsl.persist  # noqa: F401
    from transformdsl import registry

    registry.transforms()
    torch.set_num_threads(threads)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status()
    base = before["VmRSS"]
    start = time.perf_counter()
    if way == WAYS[0]:
        transformdsl.convert(source, script, out, workers=workers)
    elif way == WAYS[1]:
        model = transformdsl.load(source)
        transformdsl.transform(model, script)
        transformdsl.save(model, out)
    else:
        mode = script.split()[1]
        config = (BitsAndBytesConfig(load_in_8bit=True) if mode == "int8" else
                  BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mode,
                                     bnb_4bit_compute_dtype=torch.bfloat16))
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, device_map="cpu",
                                                     dtype=torch.bfloat16, local_files_only=True)
        model.save_pretrained(out, safe_serialization=True)
    seconds = time.perf_counter() - start
    writer.send({"seconds": seconds, "peak": _status()["VmHWM"] - base, "base_anon": before["RssAnon"],
                 "base_file": before["RssFile"]})


def _tree_status(pid: int, own: dict[str, int] | None = None) -> dict[str, int]:
    """``_status`` summed over the process and its descendants (convert's worker processes); ``own``:
    the process's ``_status``, when the caller has read it already."""
    total = dict(_status(pid) if own is None else own)
    try:
        children = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    except OSError:
        return total
    for child in children:
        try:
            for key, value in _tree_status(child).items():
                total[key] = total.get(key, 0) + value
        except (OSError, KeyError):
            continue
    return total


def run_way(way: str, source: Path, script: str, out: Path, max_rss: int, timeout: float, threads: int = 1,
            workers: int = 1) -> dict:
    """One job in a fresh process; the watchdog samples RssAnon/RssFile (of the process and its children:
    ``tree``, their sum) and kills it past ``max_rss``."""
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_job, args=(way, str(source), script, str(out), writer, threads, workers),
                              daemon=workers == 1)  # a daemonic process may not start worker processes
    process.start()
    writer.close()
    peaks = {"RssAnon": 0, "RssFile": 0, "tree": 0}
    killed = []

    def watchdog():
        while process.is_alive():
            try:
                status = _status(process.pid)
                tree = _tree_status(process.pid, status)
            except (OSError, KeyError):
                return
            for key in ("RssAnon", "RssFile"):
                peaks[key] = max(peaks[key], status.get(key, 0))
            peaks["tree"] = max(peaks["tree"], tree.get("VmRSS", 0))
            if tree.get("VmRSS", 0) > max_rss:
                killed.append(status["VmRSS"])
                process.kill()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    row = reader.recv() if reader.poll(timeout) else None
    process.join(30)
    if process.is_alive():
        process.kill()
    thread.join(1)
    if row is None:
        return {"status": f"killed by the watchdog at {killed[0] / 2**30:.1f} GiB" if killed else "no result"}
    return {**row, "anon": peaks["RssAnon"], "file": peaks["RssFile"], "tree": peaks["tree"], "status": "ok"}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def scaling(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.work))
    rows, points = [], []
    started = time.time()
    try:
        for size in args.sizes.split(","):
            source = work / size
            made = make_checkpoint(size, source)
            for way in WAYS:
                out = work / f"{size}-out"
                result = run_way(way, source, args.script, out, int(args.max_rss_gb * 2**30), args.timeout)
                shutil.rmtree(out, ignore_errors=True)
                point = {"size": size, "params": made["params"], "checkpoint": made["bytes"], "way": way, **result}
                points.append(point)
                ok = result["status"] == "ok"
                rows.append({
                    "checkpoint": f"Llama {size} ({made['params'] / 1e6:,.0f} M, {made['bytes'] / 2**30:.2f} GiB bf16)",
                    "way": way,
                    "peak RSS MiB": _mib(result["peak"]) if ok else result["status"],
                    "÷ checkpoint": f"{result['peak'] / made['bytes']:.2f}" if ok else "",
                    "peak RssAnon / RssFile MiB": f"{_mib(result['anon'] - result['base_anon'])} / {_mib(result['file'] - result['base_file'])}"
                    if ok else "",
                    "time s": f"{result['seconds']:.1f}" if ok else "",
                })
            shutil.rmtree(source, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = header(f"convert against model size ({args.script})", started, 1)
    text += ("\nCommand: `nice -n 10 .venv/bin/python benchmarks/bench_convert.py` (each job in a fresh process, one "
             "thread).  Peak RSS: the highest resident memory during the job above the process's memory before it "
             "(imports done); RssAnon (tensors) and RssFile (mapped file pages: the checkpoint, which the kernel "
             "can drop) are the watchdog's highest samples above the same moment's.\n\n")
    text += table(rows, ["checkpoint", "way", "peak RSS MiB", "÷ checkpoint", "peak RssAnon / RssFile MiB", "time s"])
    text += "\n"
    previous = json.loads((RESULTS / "convert.json").read_text()) if (RESULTS / "convert.json").exists() else {}
    (RESULTS / "convert.json").write_text(json.dumps({**previous, "script": args.script, "points": points}, indent=1))
    big = "".join(previous.get(f"{name}_text", "") for name in BIG_RUNS)
    write("convert.md", text + big)


# ---------------------------------------------------------------------------- FLUX.1-dev, larger than memory

def write_random_shards(directory: Path, model, stem: str, ones, shard_bytes: int,
                        chunk_rows: int | None = None) -> dict:
    """Write ``model``'s state (a meta skeleton: shapes only) as bf16 random weights (std 0.02; the keys
    ``ones(key)`` picks are 1, as norms are) into ``{stem}-0000i-of-0000n.safetensors`` shards with
    the libraries' index: at most one shard's tensors in memory.  ``chunk_rows``: draw the random
    numbers that many rows at a time (no float32 copy of a whole large tensor)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    weight_map, shard, size, count, total, params = {}, {}, 0, 0, 0, 0

    def flush():
        nonlocal shard, size, count
        if shard:
            count += 1
            name = f"{stem}-{count:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
            shard, size = {}, 0

    for key, tensor in model.state_dict().items():
        value = torch.empty(tensor.shape, dtype=torch.bfloat16)
        if ones(key):
            value.fill_(1.0)
        elif chunk_rows is None:
            value.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float32).mul_(0.02))
        else:
            for start in range(0, value.shape[0], chunk_rows):
                rows = value[start:start + chunk_rows]
                rows.copy_(torch.randn(rows.shape, generator=generator).mul_(0.02))
        nbytes = value.numel() * 2
        if size and size + nbytes > shard_bytes:
            flush()
        shard[key] = value
        size += nbytes
        total += nbytes
        params += value.numel()
    flush()
    final = {f"{stem}-{i:05d}.safetensors": f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)}
    for old, new in final.items():
        os.rename(directory / old, directory / new)
    (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}))
    return {"params": params, "bytes": total}


def write_flux_dev(directory: Path, shard_bytes: int = 2 * 10**9, **config) -> dict:
    """FLUX.1-dev's transformer (diffusers' default config) with random bf16 weights, written shard by
    shard from the meta skeleton: at most one block's tensors in memory."""
    import torch
    from diffusers import FluxTransformer2DModel

    directory.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = FluxTransformer2DModel(guidance_embeds=True, **config)
    config = dict(model.config)
    config["_class_name"] = "FluxTransformer2DModel"
    config["_diffusers_version"] = __import__("diffusers").__version__
    (directory / "config.json").write_text(json.dumps(config, indent=1, default=list))
    return write_random_shards(directory, model, "diffusion_pytorch_model",
                               lambda key: "norm" in key and key.endswith("weight"), shard_bytes)


def _load_and_run(out: str, writer) -> None:
    import torch

    import transformdsl

    start = time.perf_counter()
    model = transformdsl.load(out)
    loaded = time.perf_counter() - start
    config = model.config
    with torch.inference_mode():
        latent = torch.randn(1, 16 * 16 // 4 * 1, config.in_channels, dtype=torch.bfloat16)
        text = torch.randn(1, 8, config.joint_attention_dim, dtype=torch.bfloat16)
        start = time.perf_counter()
        output = model(hidden_states=latent, encoder_hidden_states=text,
                       pooled_projections=torch.randn(1, config.pooled_projection_dim, dtype=torch.bfloat16),
                       timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                       img_ids=torch.zeros(latent.shape[1], 3), txt_ids=torch.zeros(8, 3), return_dict=False)[0]
    writer.send({"load_s": loaded, "forward_s": time.perf_counter() - start,
                 "finite": bool(torch.isfinite(output).all()), "peak": _status()["VmHWM"]})


def convert_and_run(args, directory: Path, made: dict, source: str, run, forward: str, forward_text,
                    scripts: tuple[str, ...] = ("quantize nf4", "fp8 storage"), threads: int = 1) -> list[dict]:
    """Convert ``directory/source`` with each of ``scripts`` (each in a fresh process under the
    watchdog), load each result and run it in another (``run(out, writer)``): the table rows, the
    forward's column ``forward`` written by ``forward_text(result)``."""
    rows = []
    for script in scripts:
        out = directory / script.splitlines()[-1].replace(" ", "-").replace("=", "")
        result = run_way("convert", directory / "source", script, out, int(args.max_rss_gb * 2**30), args.timeout,
                         threads=threads)
        print(script, result, flush=True)
        row = {"script": script.replace("\n", "; ").replace(str(directory) + "/", "")
               + (f" ({threads} torch threads)" if threads > 1 else ""), "source": source,
               "measured": f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu_model()}"}
        if result["status"] != "ok":
            rows.append({**row, "peak RSS GiB": result["status"]})
            continue
        written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        context = multiprocessing.get_context("spawn")
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=run, args=(str(out), writer), daemon=True)
        process.start()
        writer.close()
        ran = reader.recv() if reader.poll(args.timeout) else {}
        process.join(30)
        rows.append({**row, "output GB": f"{written / 1e9:.1f}",
                     "peak RSS GiB": f"{result['peak'] / 2**30:.2f}",
                     "÷ source": f"{result['peak'] / made['bytes']:.3f}",
                     "peak RssAnon / RssFile GiB": f"{(result['anon'] - result['base_anon']) / 2**30:.2f} / "
                                                   f"{(result['file'] - result['base_file']) / 2**30:.2f}",
                     "convert s": f"{result['seconds']:.0f}",
                     forward: forward_text(ran)})
        shutil.rmtree(out, ignore_errors=True)
    return rows


def _flux_forward_text(ran: dict) -> str:
    return f"{ran['load_s']:.1f} s + {ran['forward_s']:.1f} s, finite: {ran['finite']}" if ran else "failed"


def flux_dev(args) -> None:
    directory = Path(args.flux_dev)
    started = time.time()
    try:
        begin = time.perf_counter()
        made = write_flux_dev(directory / "source", **({"num_layers": 1, "num_single_layers": 1} if args.smoke else {}))
        print(f"wrote FLUX.1-dev shape: {made['params'] / 1e9:.2f} B parameters, {made['bytes'] / 1e9:.1f} GB "
              f"in {time.perf_counter() - begin:.0f} s", flush=True)
        rows = convert_and_run(args, directory, made, f"{made['params'] / 1e9:.2f} B params, "
                               f"{made['bytes'] / 1e9:.1f} GB bf16", _load_and_run, "load + forward (16×16)",
                               _flux_forward_text)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    text = ("\n## Near the size of memory: a FLUX.1-dev-shaped transformer\n\n"
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))} on this machine (23.5 GiB of "
            "memory, shared): the 23.8 GB (22.2 GiB) checkpoint is 94% of it, so `load → transform → save`, whose "
            "peak RSS was 1.36× the checkpoint at 1.1 B parameters (above), would need more than the machine has "
            "(not tried).  Command: `nice -n 10 .venv/bin/python benchmarks/bench_convert.py --flux-dev /work/bigckpt` "
            "(the checkpoint is written with random weights, block by block, then deleted).  Peak RSS is the "
            "process's, above its memory before the convert (imports done); RssAnon / RssFile: the watchdog's "
            "highest samples, above the same moment's.  Target: peak RSS < 1/3 of the source.  The outputs keep the "
            "AdaLayerNorm modulation linears (3.2 B of the 11.9 B parameters) in bf16, as both statements exclude "
            "`norm` by default (spec.md, quantize).\n\n")
    _report_big(args, "flux_dev", rows, text, "load + forward (16×16)")


def _report_big(args, key: str, rows: list[dict], text: str, forward: str) -> None:
    """A larger-than-memory run's section (``text``, then its table): printed with ``--smoke``,
    else written to the page."""
    text += table(rows, ["script", "source", "output GB", "peak RSS GiB", "÷ source", "peak RssAnon / RssFile GiB",
                         "convert s", forward, "measured"]) + "\n"
    if args.smoke:
        print(text)
        return
    _write_big(key, rows, text)


#: The larger-than-memory runs, in the order their sections appear on the page.
BIG_RUNS = ("llama_13b", "workers_13b", "flux_dev")


def _write_big(name: str, rows: list[dict], text: str) -> None:
    """Record one larger-than-memory run and rewrite the page: the scaling table, then every big run's section."""
    previous = json.loads((RESULTS / "convert.json").read_text()) if (RESULTS / "convert.json").exists() else {}
    previous.update({name: rows, f"{name}_text": text})
    (RESULTS / "convert.json").write_text(json.dumps(previous, indent=1))
    page = RESULTS / "convert.md"
    current = page.read_text().split("\n## ")[0] if page.exists() else ""  # the scaling table
    sections = "".join(previous.get(f"{big}_text", "") for big in BIG_RUNS)
    write("convert.md", current.rstrip("\n") + "\n" + sections)


# ---------------------------------------------------------------------------- Llama-2-13B shape, larger than memory

#: Llama-2-13B's shape: 13.0 B parameters, 26.0 GB in bf16, more than this machine's 23.5 GiB of memory.
LLAMA_13B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                 num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)


def write_llama(directory: Path, shard_bytes: int = 5 * 10**9, **overrides) -> dict:
    """A Llama checkpoint (transformers layout: config.json, sharded model.safetensors with its index)
    with random bf16 weights, written shard by shard from the meta skeleton."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**{**LLAMA_13B, **overrides}, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    return write_random_shards(directory, model, "model", lambda key: "norm" in key, shard_bytes, chunk_rows=4096)


def _load_and_run_llama(out: str, writer) -> None:
    import torch

    import transformdsl

    start = time.perf_counter()
    model = transformdsl.load(out)
    loaded = time.perf_counter() - start
    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        logits = model(input_ids=ids).logits
    writer.send({"load_s": loaded, "forward_s": time.perf_counter() - start,
                 "finite": bool(torch.isfinite(logits).all()), "peak": _status()["VmHWM"]})


def _memory_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def _llama_forward_text(ran: dict) -> str:
    if not ran:
        return "failed"
    return (f"{ran['load_s']:.1f} s + {ran['forward_s']:.1f} s, finite: {ran['finite']}, "
            f"peak RSS {ran['peak'] / 2**30:.1f} GiB")


#: ``--scripts gptq``: GPTQ int4 through convert, on calibration token ids written beside the checkpoint
#: (random weights: the figures are memory and time, not quality; 8 samples of 128 tokens).
GPTQ_SCRIPT = 'calibrate "{directory}/calibration.safetensors" samples=8\nquantize int4 group_size=128 method=gptq'


def _write_calibration_ids(directory: Path) -> None:
    """``GPTQ_SCRIPT``'s calibration data: 8 samples of 128 random token ids."""
    import torch
    from safetensors.torch import save_file

    ids = torch.randint(0, LLAMA_13B["vocab_size"], (8, 128), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(directory / "calibration.safetensors"))


def llama_13b(args) -> None:
    directory = Path(args.llama_13b)
    memory = _memory_total()
    scripts = tuple(GPTQ_SCRIPT.format(directory=directory) if name == "gptq" else name
                    for name in args.scripts.split(","))
    try:
        begin = time.perf_counter()
        made = write_llama(directory / "source", **({"num_hidden_layers": 2} if args.smoke else {}))
        print(f"wrote Llama-2-13B shape: {made['params'] / 1e9:.2f} B parameters, {made['bytes'] / 1e9:.1f} GB "
              f"({made['bytes'] / memory:.2f}x this machine's memory) in {time.perf_counter() - begin:.0f} s",
              flush=True)
        if any("calibrate" in script for script in scripts):
            _write_calibration_ids(directory)
        rows = convert_and_run(args, directory, made, f"{made['params'] / 1e9:.2f} B params, "
                               f"{made['bytes'] / 1e9:.1f} GB bf16 ({made['bytes'] / memory:.2f}× memory)",
                               _load_and_run_llama, "load + forward (8 tokens)", _llama_forward_text, scripts,
                               threads=args.threads)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if not args.smoke:  # rows of scripts not run this time are kept from the last run
        previous = json.loads((RESULTS / "convert.json").read_text()).get("llama_13b", []) \
            if (RESULTS / "convert.json").exists() else []
        ran = {row["script"] for row in rows}
        rows = [{"measured": "2026-12-01 20:31 UTC", **row} for row in previous if row["script"] not in ran] + rows
    text = ("\n## Larger than memory: a Llama-2-13B-shaped model\n\n"
            f"Measured on this machine ({memory / 2**30:.1f} GiB of memory, 2 cores), at the time "
            "of each row, one torch thread unless the row says otherwise.  Command: `nice -n 10 .venv/bin/python benchmarks/bench_convert.py --llama-13b "
            "/work/bigllama [--scripts gptq]` (a transformers checkpoint with Llama-2-13B's "
            "configuration, random bf16 weights, written tensor by tensor, then deleted): larger than the machine's "
            "memory, so it is never all resident at once, and `load → transform → save` would need more still "
            "(not tried).  Peak RSS is the process's, above its "
            "memory before the convert (imports done); RssAnon / RssFile: the watchdog's highest samples, above the "
            "same moment's.  Target: peak RSS < 1/3 of the source.  The forward loads the result memory-mapped "
            "(its peak RSS counts the mapped pages it touched).  The GPTQ row calibrates on 8 samples of 128 random "
            "token ids (`calibrate` statement; the weights are random, so it measures memory and time, not "
            "quality): every block is fitted and run quantized as it is read.\n\n")
    _report_big(args, "llama_13b", rows, text, "load + forward (8 tokens)")


def _save_digest(directory: Path) -> str:
    """SHA-256 over a save's files (names and bytes), its save id masked: equal digests, equal saves."""
    import hashlib

    save_id = json.loads((directory / "transformdsl.json").read_text())["save_id"].encode()
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with open(path, "rb") as f:
            head = f.read(1 << 20)  # a shard's save id is in its header, at the start
            digest.update(head.replace(save_id, b"ID"))
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def workers_13b(args, argv=None) -> None:
    """``convert --workers N`` against one process on the Llama-2-13B shape: wall time, peak RSS of the
    process tree, and whether the saves are the same bytes."""
    directory = Path(args.llama_13b)
    memory = _memory_total()
    count = args.workers
    # all the cores, unless --threads says (with fewer torch threads than cores, as on a larger machine,
    # the processes have cores to themselves)
    threads = args.threads if "--threads" in (argv or sys.argv) else os.cpu_count() or 1
    rows = []
    blocks = 2 if args.smoke else args.blocks
    try:
        made = write_llama(directory / "source", **({"num_hidden_layers": blocks} if blocks else {}))
        print(f"wrote {made['bytes'] / 1e9:.1f} GB", flush=True)
        if "gptq" in args.scripts.split(","):
            _write_calibration_ids(directory)
        for script in (GPTQ_SCRIPT.format(directory=directory) if name == "gptq" else name
                       for name in args.scripts.split(",")):
            results, digests = {}, {}
            for label, kwargs in (("1 process", {"threads": threads, "workers": 1}),
                                  (f"{count} workers", {"threads": threads, "workers": count})):
                out = directory / label.replace(" ", "-")
                result = run_way("convert", directory / "source", script, out, int(args.max_rss_gb * 2**30),
                                 args.timeout, **kwargs)
                print(script, label, result, flush=True)
                results[label] = result
                if result["status"] == "ok":
                    digests[label] = _save_digest(out)
                shutil.rmtree(out, ignore_errors=True)
            one, many = results["1 process"], results[f"{count} workers"]
            ok = one["status"] == many["status"] == "ok"
            rows.append({
                "script": script.replace(str(directory), "DIR").replace("\n", "; "),
                "source": f"{made['params'] / 1e9:.2f} B params, {made['bytes'] / 1e9:.1f} GB bf16"
                          + (f" ({blocks} of the 40 blocks)" if blocks else ""),
                "torch threads": str(threads),
                "1 process s": f"{one['seconds']:.0f}" if one["status"] == "ok" else one["status"],
                f"{count} workers s": f"{many['seconds']:.0f}" if many["status"] == "ok" else many["status"],
                "time ÷ 1 process": f"{many['seconds'] / one['seconds']:.2f}" if ok else "",
                "peak RSS GiB (1 / workers, process tree)": f"{one['tree'] / 2**30:.2f} / {many['tree'] / 2**30:.2f}"
                if ok else "",
                "same bytes": str(digests.get("1 process") == digests.get(f"{count} workers")) if ok else "",
                "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            })
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if not args.smoke:  # rows of scripts not run this time are kept from the last run
        previous = json.loads((RESULTS / "convert.json").read_text()).get("workers_13b", []) \
            if (RESULTS / "convert.json").exists() else []
        ran = {(row["script"], row["source"], row.get("torch threads", "2")) for row in rows}
        rows = [{"torch threads": "2", **row} for row in previous
                if (row["script"], row["source"], row.get("torch threads", "2")) not in ran] + rows
    text = (f"\n## convert --workers {count} on the Llama-2-13B shape\n\n"
            f"Measured on this machine ({cpu_model()}, {os.cpu_count()} cores, {memory / 2**30:.1f} GiB), at the time of each "
            f"row.  Command: `nice -n 10 .venv/bin/python benchmarks/bench_convert.py --llama-13b /work/bigllama "
            f"--workers {count} [--scripts gptq --blocks 4]`.  The same source as above (random bf16 weights, written "
            f"then deleted; `--blocks 4`: 4 of its 40 blocks, each of the 13B shape); each way in "
            f"a fresh process: one process with the row's torch threads, and `workers={count}` (each worker "
            f"a share of them, the parent writing; for the GPTQ rows, {count} processes each "
            f"holding a share of the 8 samples, each with the row's threads, summing the Hessians: spec.md, "
            "\"Calibration across processes\"; `--threads 1`: one thread per process, so that the processes have "
            "a core each, as on a machine with more cores than one process's threads).  Peak RSS: the watchdog's highest sample of "
            "the process and its children together (file pages of the mapped source counted in each process that "
            "touched them).  Same bytes: SHA-256 over every file of the two saves, save id masked.\n\n")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    text += table([{key: row.get(key, "") for key in columns} for row in rows], columns) + "\n"
    if args.smoke:
        print(text)
        return
    _write_big("workers_13b", rows, text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,medium,1b")
    parser.add_argument("--script", default="quantize nf4")
    parser.add_argument("--max-rss-gb", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--work", default=None, help="where checkpoints are written (default: the system's tmp)")
    parser.add_argument("--flux-dev", metavar="DIR", help="the larger-than-memory run, in DIR (deleted after)")
    parser.add_argument("--llama-13b", metavar="DIR",
                        help="the larger-than-memory run with Llama-2-13B's shape (26 GB bf16), in DIR (deleted after)")
    parser.add_argument("--scripts", default="quantize nf4,fp8 storage",
                        help="with --llama-13b: the scripts, comma-separated (gptq: GPTQ int4 on calibration ids)")
    parser.add_argument("--smoke", action="store_true",
                        help="with --flux-dev or --llama-13b: two blocks (1-2 GB), to try the run; writes nothing")
    parser.add_argument("--threads", type=int, default=1,
                        help="with --llama-13b: torch threads of the convert (GPTQ's matrix products use them)")
    parser.add_argument("--workers", type=int, default=0,
                        help="with --llama-13b: compare convert --workers N with one process instead")
    parser.add_argument("--blocks", type=int, default=0,
                        help="with --llama-13b --workers N: only this many of the 40 blocks (0: all)")
    args = parser.parse_args(argv)
    if args.llama_13b and args.workers:
        if "--max-rss-gb" not in (argv or sys.argv):
            args.max_rss_gb = 16.0
        workers_13b(args, argv)
    elif args.llama_13b:
        if "--max-rss-gb" not in (argv or sys.argv):
            args.max_rss_gb = 10.0
        llama_13b(args)
    elif args.flux_dev:
        if "--max-rss-gb" not in (argv or sys.argv):
            args.max_rss_gb = 10.0
        flux_dev(args)
    else:
        scaling(args)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
