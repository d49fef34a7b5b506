"""Our GGUF export of the LM trained here, in llama.cpp: per-token KL against our own logits.

    .venv/bin/python benchmarks/bench_serving_trained.py [--llama-python /work/llamaenv2/bin/python]

The serving benchmark (``bench_serving.py``) measures the same thing on SmolLM2-135M, where llama.cpp's
rounding of activations is chaotic: llama.cpp disagrees with itself (its batched kernels against one token a
call) by 2-4e-3, so no export can come closer to it.  This page asks the question on a model where that
rounding is not chaotic: ``tests/trained`` (a 4-layer Llama, hidden 128, byte vocabulary, trained here).

For the float model and for ``quantize q8_0`` / ``q4_0`` (with float activations, and with ``activations=int8``,
llama.cpp's own rounding of activations), the model is exported with ``save(..., format="gguf")`` and
evaluated by llama.cpp (llama-cpp-python built from source in its own environment, one thread) on 4×256
held-out tokens (``tests/trained/heldout.txt``, bytes as token ids); per-token KL(ours ‖ llama.cpp) of
the next-token distribution, mean and max, beside two floors: llama.cpp against itself (the windows one
token a call against one call each) and ours against ours with the embeddings' output times
``1 + 1e-6·N(0,1)``.  The last two columns: llama.cpp with its KV cache in float32 (``type_k``/``type_v`` =
GGML_TYPE_F32) instead of its default float16, which rounds every key and value (ours keep float32).
KL only: nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import LLAMA_CPP, PERTURBATION, held_out_logits, kl  # noqa: E402
from benchmarks.common import header, table, write  # noqa: E402

SCRIPTS = ["", "quantize q8_0", "quantize q8_0 activations=int8", "quantize q4_0", "quantize q4_0 activations=int8"]
WINDOWS, LENGTH = 4, 256


def llama_cpp(python: str, gguf_file: Path, ids_file: Path, kv_f32: bool) -> dict:
    """llama.cpp's logits on the windows (:data:`LLAMA_CPP`, one thread), its KV cache in float32 with ``kv_f32``."""
    done = subprocess.run([python, "-c", LLAMA_CPP, str(gguf_file), str(ids_file), "1", "64", "2"],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "KV_F32": "1" if kv_f32 else ""})
    if done.returncode != 0:
        sys.exit(f"llama.cpp failed on {gguf_file}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-python", default="/work/llamaenv2/bin/python",
                        help="the Python of the environment llama-cpp-python is built in")
    args = parser.parse_args()

    import torch

    import transformdsl
    from tests.trained import heldout_ids, load_model

    torch.set_num_threads(1)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="bench-serving-trained-"))
    ids = heldout_ids()[0]
    windows = [ids[i * LENGTH:(i + 1) * LENGTH] for i in range(WINDOWS)]
    ids_file = work / "ids.json"
    ids_file.write_text(json.dumps({"heldout": [w.tolist() for w in windows], "prompt": ids[:64].tolist()}))
    rows = []
    for script in SCRIPTS:
        model = load_model()
        if script:
            transformdsl.transform(model, script)
        target = work / f"export-{len(rows)}"
        transformdsl.save(model, target, format="gguf")
        theirs, f32_kv = (llama_cpp(args.llama_python, target / "model.gguf", ids_file, kv_f32)
                          for kv_f32 in (False, True))
        ours = held_out_logits(model, windows)
        batched = torch.tensor(theirs["logits"]).reshape(ours.shape)
        mean, worst = kl(ours, batched)
        rows.append({"statement": f"`{script}`" if script else "(float: F32)",
                     "file KB": f"{(target / 'model.gguf').stat().st_size / 1e3:.0f}",
                     "KL mean": f"{mean:.2e}", "KL max": f"{worst:.2e}",
                     "llama.cpp batched vs one at a time": f"{kl(batched, torch.tensor(theirs['single']).reshape(ours.shape))[0]:.2e}",
                     "ours vs ours perturbed": f"{kl(ours, held_out_logits(model, windows, PERTURBATION))[0]:.2e}",
                     "KL mean, llama.cpp's KV cache in float32":
                         f"{kl(ours, torch.tensor(f32_kv['logits']).reshape(ours.shape))[0]:.2e}",
                     "KL max, llama.cpp's KV cache in float32":
                         f"{kl(ours, torch.tensor(f32_kv['logits']).reshape(ours.shape))[1]:.2e}"})
        print(rows[-1], flush=True)
    version = subprocess.run([args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    text = header("Our GGUF export of the LM trained here, in llama.cpp: per-token KL against our own logits",
                  started, threads=1)
    text += (f"\nllama-cpp-python {version}, built from source in its own environment. Command: `.venv/bin/python "
             f"benchmarks/bench_serving_trained.py --llama-python {args.llama_python}`.\n\n"
             + __doc__.split("\n\n", 2)[2].strip() + "\n\n"
             + table(rows, ["statement", "file KB", "KL mean", "KL max", "llama.cpp batched vs one at a time",
                            "ours vs ours perturbed", "KL mean, llama.cpp's KV cache in float32",
                            "KL max, llama.cpp's KV cache in float32"]) + "\n")
    write("serving_trained.md", text)


if __name__ == "__main__":
    main()
