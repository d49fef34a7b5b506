"""The support matrix: every corpus model x every script, as a new user would run them.

    python -m tests.zoo.matrix                      # everything -> docs/SUPPORT.json (+ docs/SUPPORT.md)
    python -m tests.zoo.matrix --models Flux,Llama --scripts "fuse qkv,quantize nf4" --json out.json

For each cell (model, script) :func:`run_cell`:

1. builds the model and its inputs (tests/zoo/corpus.py), runs it on them and on a held-out
   sample (another seed) to get the reference outputs;
2. plans the script (``not applicable``, and nothing more is done, when no statement selects a
   module it can change);
3. ``transformdsl.transform(model, plan, verify=True, verify_inputs=[inputs, ...])`` on the
   test input and :data:`VERIFY_SEEDS` more samples (one sample under the bound proves little
   where the error varies from input to input, e.g. fp8 storage on the narrow UNet1D: 0.15 to
   0.33 over six random inputs against a bound of 0.2): a refusal
   because the output moved past the script's bound is ``refused by verify``; a failure of the
   transformed model's own forward is ``crash in forward``;
4. runs the transformed model on both samples: past the bound on the held-out sample, which
   verify did not see, is ``past bound silently``;
5. ``save``\\ s it and ``load(dir)`` with no ``model=``, runs the reloaded model and checks its
   output is bit-identical (``reload needs model=``, ``reload fails``, ``reload crash in forward``,
   ``reload mismatch``);
6. saves it with each ``save(format=...)`` of its library (:data:`FORMATS`) and, where the stock
   loader runs here, loads that directory with the library's own ``from_pretrained`` and checks
   the output is within the script's bound of the untransformed model's (``formats``: format ->
   ``ok``, ``written`` (the stock loader does not run here: why), ``refused`` (the format cannot
   carry the script: the error's first line), ``save fails``, ``stock load fails``, ``stock past
   bound``).

Cells run in worker processes (2 by default), one cell at a time each, with a timeout per cell;
a worker that dies or hangs is replaced and its cell is ``worker died`` / ``timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Column name -> script.  The elementwise fusions run with ``kernel=eager``: compiling is the
#: slow part and is covered by the ``compile`` column on :data:`COMPILE_SLICE` only.
SCRIPTS = {
    "fuse qkv": "fuse qkv",
    "quantize int8": "quantize int8",
    "quantize nf4": "quantize nf4",
    "quantize hqq": "quantize hqq",
    "quantize hqq auto": "quantize hqq group_size=auto",  # the tiny models' layers are narrower than 64
    "fp8 storage": "fp8 storage",
    "fp8 native": "fp8 native",
    "quantize w8a8": "quantize w8a8",
    "quantize int4": "quantize int4 group_size=32",  # the smallest group: the tiny models' layers are narrow
    # llm-compressor's W4A16 groups (what format='compressed-tensors' writes)
    "quantize int4 symmetric": "quantize int4 group_size=32 symmetric=true",
    # llama.cpp's activation rounding on int4's groups: integer products for decode-sized inputs
    "quantize int4 activations=int8": "quantize int4 group_size=32 activations=int8",
    # GGUF's grids (blocks of 32 inputs); sample inputs of at most 8 rows take the packed decode kernel
    "quantize q8_0": "quantize q8_0",
    "quantize q4_0": "quantize q4_0",
    "quantize q4_1": "quantize q4_1",
    "quantize q5_0": "quantize q5_0",
    "quantize q5_1": "quantize q5_1",
    # llama.cpp's arithmetic: activations rounded to int8 blocks, integer products (decode-sized inputs)
    "quantize q4_0 activations=int8": "quantize q4_0 activations=int8",
    "quantize q4_k": "quantize q4_k",  # super-blocks of 256 inputs: not applicable to most tiny models
    "quantize q5_k": "quantize q5_k",  # as q4_k
    "quantize q6_k": "quantize q6_k",  # as q4_k
    # Methods that learn from data, calibrated on the cell's generated samples (the test input and the
    # verify samples; the held-out sample stays unseen).
    "quantize int4 method=gptq": "quantize int4 group_size=32 method=gptq",
    "quantize int4 method=awq": "quantize int4 group_size=32 method=awq",
    "quantize int8 weight_only method=gptq": "quantize int8 weight_only=true method=gptq",
    "quantize w8a8 smooth=0.5": "quantize w8a8 smooth=0.5",
    "fuse qkv; quantize int8": "fuse qkv; quantize int8",
    "fuse bias_act_dropout": "fuse bias_act_dropout kernel=eager",
    "fuse bias_dropout_residual": "fuse bias_dropout_residual kernel=eager",
    "fuse bias_dropout_residual_layernorm": "fuse bias_dropout_residual_layernorm kernel=eager",
    "compile": "compile",
    # generate()'s decode step on a static KV cache (transformers LMs): the forward the cell runs stays
    # eager, so the column checks which models transformers can run so, the plan, and that load() sets it again
    "compile kv_cache=static": "compile kv_cache=static",
    # {lora}: a LoRA file written for the cell's model (lora_file: every Linear, random weights)
    "lora": 'lora "{lora}"',
    # Step caches (diffusers denoisers only): one call in a fresh cache context, as verify and the
    # reload check make it, computes every block; the columns check planning (which denoisers each
    # mode's hooks can wrap), enabling, one step, and that load() enables the cache again.
    "cache first_block": "cache first_block",
    "cache taylorseer": "cache taylorseer",
    "cache pyramid_broadcast": "cache pyramid_broadcast",
    # Without is_guidance_distilled, FasterCache needs the CFG batch (uncond + cond) of a pipeline, which
    # a single sample input is not; and its first call must compute attention, which the corpus samples'
    # low timesteps would not (a pipeline starts above the range).  The guard says both at the call
    # (tests/test_cache.py); this column checks the hooks themselves on one computed step.
    "cache faster": 'cache faster is_guidance_distilled=true spatial_attention_timestep_skip_range="-1,0"',
    "cache mag": "cache mag mag_ratios=flux",
    "cache sea": "cache sea",
    "cache text_kv": "cache text_kv",
    # The attention backend each library computes in plain PyTorch on any machine.
    "attention": "attention native_math",
    "attention (transformers)": "attention eager",
}

#: Columns that run on one library's models only (a statement of the other library is a plan error).
LIBRARY_ONLY = {**{name: "diffusers" for name in SCRIPTS if name.startswith("cache ")},
                "attention": "diffusers", "attention (transformers)": "transformers",
                "compile kv_cache=static": "transformers"}

#: Models the (slow) ``compile`` column runs on (the tiny UNet and Flux took over 5 min a cell on a
#: loaded 2-core machine: compilation, then recompilation for the reloaded model).
COMPILE_SLICE = ("transformers/Llama", "transformers/BERT")

#: Statuses, best first; the order the summary counts them in.
STATUSES = ("ok", "not applicable", "refused by verify", "past bound silently", "crash in forward",
            "transform fails", "plan fails", "reload needs model=", "reload fails", "reload crash in forward",
            "reload mismatch", "timeout", "worker died", "corpus model fails")

#: Separate q/k/v projections (children of one module) this matrix counts as a fusion candidate,
#: whatever the pass knows: the denominator of the "fused" figure.
SEPARATE_QKV = (("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj"), ("q_proj", "k_proj", "v_proj"),
                ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"),
                ("query_proj", "key_proj", "value_proj"))

MARK = "@@zoo@@ "

#: ``save(format=...)`` targets per library, each with the short name the support page uses.
FORMATS = {"diffusers": {"diffusers": "df"}, "transformers": {"transformers": "tf", "compressed-tensors": "ct"}}

#: Seeds of the samples verify checks besides the test input (seed 0); the held-out sample
#: (:data:`HELDOUT_SEED`), which verify never sees, is where "past bound silently" is measured.
VERIFY_SEEDS = (2, 3)
HELDOUT_SEED = 1

#: model id -> its outputs on the test and held-out inputs, before any transform (one model kept).
_REFERENCES: dict = {}
CELL_TIMEOUT = 300.0


def scripts_for(model_id: str) -> list[str]:
    """The columns that run on ``model_id`` (``compile`` on :data:`COMPILE_SLICE` only)."""
    library = model_id.split("/", 1)[0]
    return [name for name in SCRIPTS if (name != "compile" or model_id in COMPILE_SLICE)
            and LIBRARY_ONLY.get(name, library) == library]


def _run(model, inputs):
    """The model's output tensor; a denoiser with a step cache runs as one fresh denoising loop."""
    from transformdsl.transforms.cache.guard import fresh_context

    from . import corpus

    with fresh_context(model):
        return corpus.run(model, inputs)


# --------------------------------------------------------------------------- one cell


def qkv_candidates(model) -> list[str]:
    """Paths of modules holding separate q, k and v projections (Linear-like children)."""
    found = []
    for path, module in model.named_modules():
        children = module._modules
        for names in SEPARATE_QKV:
            if all(children.get(n) is not None and hasattr(children[n], "weight") for n in names):
                found.append(path)
                break
    return found


def _first_line(text: str) -> str:
    text = str(text).strip()
    return (text.splitlines()[0] if text else "")[:300]


def _exception(exc: BaseException) -> str:
    return _first_line(f"{type(exc).__name__}: {exc}")


def run_cell(model_id: str, script_name: str) -> dict:
    """Run one cell (see the module docstring); a JSON-able dict with ``status`` and figures."""


    from . import corpus

    script = SCRIPTS[script_name]
    cell = {"model": model_id, "script": script_name, "status": None, "detail": None, "changed": None,
            "fused": None, "candidates": None, "error": None, "error_heldout": None, "bound": None,
            "reload": None}
    started = time.perf_counter()

    def done(status: str, detail: str | None = None) -> dict:
        cell["status"] = status
        cell["detail"] = detail
        cell["seconds"] = round(time.perf_counter() - started, 2)
        return cell

    entry = corpus.entry(model_id)
    try:
        model, inputs = corpus.build(entry)
        heldout = corpus.inputs(entry, seed=HELDOUT_SEED)
        verify_samples = [inputs] + [corpus.inputs(entry, seed=seed) for seed in VERIFY_SEEDS]
        if model_id not in _REFERENCES:  # same model, same inputs: the same outputs for every script
            _REFERENCES.clear()
            _REFERENCES[model_id] = (corpus.run(model, inputs), corpus.run(model, heldout))
        reference, reference_heldout = _REFERENCES[model_id]
    except Exception as exc:
        return done("corpus model fails", _exception(exc))
    if "fuse qkv" in script:
        cell["candidates"] = len(qkv_candidates(model))
    lora_dir = None
    if "{lora}" in script:
        lora_dir = tempfile.TemporaryDirectory(prefix="zoo-lora-")
        script = script.replace("{lora}", lora_file(model, Path(lora_dir.name)))
    try:
        return _run_planned(cell, done, model, script, inputs, heldout, verify_samples, reference, reference_heldout,
                            entry)
    finally:
        if lora_dir is not None:
            lora_dir.cleanup()


def lora_file(model, directory: Path) -> str:
    """A LoRA (rank 2, random weights, PEFT's keys without prefix) on every ``nn.Linear`` of ``model``."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and name:
            tensors[f"{name}.lora_A.weight"] = torch.randn(2, module.in_features, generator=generator) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 2, generator=generator) * 0.01
    path = directory / "lora.safetensors"
    save_file(tensors, str(path))
    return str(path)


def _run_planned(cell, done, model, script, inputs, heldout, verify_samples, reference, reference_heldout, entry):
    """Steps 2-6 of the module docstring for one cell."""
    import torch

    import transformdsl
    from transformdsl.errors import LoadError, ScriptError, TransformError
    from transformdsl.verification import (
        METRICS,
        VerifyError,
        default_metric,
        measure,
        model_output,
        script_error_bound,
    )


    learns = "method=" in script or "smooth=" in script
    try:
        plan = transformdsl.plan(model, script, calibration=learns)
    except ScriptError as exc:
        if "matches no module" in str(exc) or "selects nothing" in str(exc):
            return done("not applicable", _first_line(exc))
        return done("plan fails", _first_line(exc))
    except Exception as exc:
        return done("plan fails", _exception(exc))
    cell["changed"] = sum(len(step.targets) for step in plan.steps)
    if "fuse qkv" in script:
        cell["fused"] = sum(len(step.targets) for step in plan.steps if step.transform.key() == "fuse qkv")
        cell["not_fused"] = not_fused(model, plan)
    if cell["changed"] == 0:
        return done("not applicable", "no statement selected a module it can change")
    # verify's metric (KL per token for logits, relative RMS otherwise) and the script's bound in it
    transforms = [step.transform for step in plan.steps]
    metric = default_metric(model_output(model, inputs).kind, transforms)
    bound = script_error_bound(transforms, metric)
    cell["metric"], cell["bound"] = metric, bound
    tolerance = None if bound is None else METRICS[metric].tolerance(bound, reference)

    try:
        transformdsl.transform(model, plan, verify=True, verify_inputs=verify_samples,
                               calibration=verify_samples if learns else None)
    except VerifyError as exc:
        cell["error"] = exc.report.value
        return done("refused by verify", _first_line(exc))
    except TransformError as exc:
        message = str(exc)
        moved = re.search(r"verify: the output changed by ([0-9.eE+-]+|inf|nan)", message)
        if moved:
            cell["error"] = float(moved.group(1))
            return done("refused by verify", _first_line(message))
        if "after transforming" in message or "not finite" in message:
            crash = message.split("after transforming: ", 1)[-1]
            return done("crash in forward", _first_line(crash.split(" (the model was left unchanged)")[0]))
        return done("transform fails", _first_line(message))
    except Exception as exc:
        return done("transform fails", "not a TransformError: " + _exception(exc))

    try:
        output = _run(model, inputs)
        output_heldout = _run(model, heldout)
    except Exception as exc:
        return done("crash in forward", _exception(exc))
    cell["error"] = measure(metric, reference, output)
    cell["error_heldout"] = measure(metric, reference_heldout, output_heldout)
    if tolerance is not None and not cell["error_heldout"] <= tolerance:
        past = f"held-out sample: error {cell['error_heldout']:.3g} > bound {bound:g}"
    else:
        past = None

    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        directory = Path(tmp) / "saved"
        try:
            transformdsl.save(model, directory)
        except Exception as exc:
            cell["reload"] = "save fails"
            return done("reload fails", "save: " + _exception(exc))
        try:
            loaded = transformdsl.load(directory)
        except LoadError as exc:
            cell["reload"] = "needs model="
            if "model=" in str(exc):
                return done("reload needs model=", _first_line(exc))
            return done("reload fails", _first_line(exc))
        except Exception as exc:
            cell["reload"] = "fails"
            return done("reload fails", _exception(exc))
        try:
            reloaded = _run(loaded, inputs)
        except Exception as exc:
            cell["reload"] = "crash in forward"
            return done("reload crash in forward", _exception(exc))
    if reloaded.shape != output.shape or not torch.equal(reloaded, output):
        cell["reload"] = "mismatch"
        difference = (reloaded.float() - output.float()).abs().max().item() if reloaded.shape == output.shape else None
        return done("reload mismatch", f"max |reloaded - transformed| = {difference}")
    cell["reload"] = "bit-identical"
    cell["formats"] = save_formats(model, entry, inputs, reference, tolerance, metric, cell["error"])
    if past:
        return done("past bound silently", past)
    return done("ok")


def not_fused(model, plan) -> dict[str, str]:
    """Modules with separate q/k/v projections that ``plan`` does not fuse -> why (the plan's near
    miss, or the analysis of a module the default target does not select)."""
    from transformdsl.transforms.qkv import analysis as qkv

    steps = [step for step in plan.steps if step.transform.key() == "fuse qkv"]
    fused = {path for step in steps for path in step.targets}
    reasons = {path: reason for step in steps for path, reason in step.skipped}
    out = {}
    for path in qkv_candidates(model):
        if path in fused:
            continue
        if path not in reasons:
            analysis = qkv.analyse(model.get_submodule(path), steps[0].transform.options, path) if steps else None
            why = analysis if isinstance(analysis, str) else "it would fuse"
            reasons[path] = f"not selected by the default target ({why})"
        out[path] = reasons[path]
    return out


#: A stock model whose 4-bit rows bitsandbytes misreads on this CPU, and whose error is this many times
#: the error of the same save read back by transformdsl, is ``written`` (misread), not ``ok``.
MISREAD_RATIO = 1.5


def save_formats(model, entry: dict, inputs, reference, tolerance, metric: str = "rms",
                 own_error: float | None = None) -> dict[str, dict]:
    """Step 6 of the module docstring: ``format -> {"status", "detail", "error"}`` (``own_error``: the
    transformed model's error on ``inputs``, in ``metric``)."""
    import importlib
    import importlib.util

    import transformdsl
    from transformdsl.errors import TransformError
    from transformdsl.verification import measure

    from . import corpus

    results = {}
    for fmt in FORMATS[entry["library"]]:
        result = results[fmt] = {"status": None, "detail": None, "error": None}
        with tempfile.TemporaryDirectory(prefix="zoo-format-") as tmp:
            directory = Path(tmp) / "saved"
            try:
                transformdsl.save(model, directory, format=fmt)
            except TransformError as exc:
                result.update(status="refused", detail=_first_line(exc))
                continue
            except Exception as exc:
                result.update(status="save fails", detail=_exception(exc))
                continue
            if fmt == "compressed-tensors" and importlib.util.find_spec("compressed_tensors") is None:
                result.update(status="written", detail="the compressed-tensors package is not installed here")
                continue
            config = json.loads((directory / "config.json").read_text())
            if fmt == "diffusers" and "quantization_config" in config:
                result.update(status="written", detail="diffusers' bitsandbytes loader needs a GPU")
                continue
            try:
                klass = getattr(importlib.import_module(entry["library"]), entry["class"])
                stock = klass.from_pretrained(directory).eval()
                misread = _portable_4bit(stock)
                output = corpus.run(stock, inputs)
            except Exception as exc:
                result.update(status="stock load fails", detail=_exception(exc))
                continue
            result["error"] = measure(metric, reference, output)
            # a misread shows as an error past the bound, or (the bounds being set for trained models,
            # loose on these tiny ones) as one measurably above the same model read back by transformdsl
            worse = own_error is not None and result["error"] > MISREAD_RATIO * own_error
            if misread and (worse or tolerance is not None and not result["error"] <= tolerance):
                result.update(status="written", detail=f"stock bitsandbytes misreads this CPU's 4-bit rows of "
                              f"{misread} weights (not whole blocks; error {result['error']:.3g}); the file "
                              "is what transformdsl reads back exactly")
            elif tolerance is not None and not result["error"] <= tolerance:
                result.update(status="stock past bound",
                              detail=f"stock model's error {result['error']:.3g} > bound {tolerance:g}")
            else:
                result["status"] = "ok"
    return results


def _portable_4bit(stock) -> int | None:
    """Set a stock model's bitsandbytes 4-bit layers to the kernels every CPU runs
    (``tests/stock_kernels.py``: no in-place repacking on AVX512-BF16 CPUs);
    return a row width that bitsandbytes' native CPU kernel misreads on this CPU, if a layer has one."""
    from ..stock_kernels import stock_runs_portable_4bit

    misread = None
    for module in stock_runs_portable_4bit(stock).modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if hasattr(module, "support_avx512bf16_for_cpu") and state is not None and state.shape[-1] % state.blocksize:
            misread = misread or int(state.shape[-1])
    if misread is not None:
        from transformdsl.transforms.quantize.layers import cpu_kernel_misreads_crossing_blocks

        return misread if cpu_kernel_misreads_crossing_blocks() else None
    return None


# --------------------------------------------------------------------------- workers


def _worker() -> None:
    """Read ``model<TAB>script`` lines on stdin, answer one marked JSON line each on stdout."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for line in sys.stdin:
        model_id, script_name = line.rstrip("\n").split("\t")
        try:
            cell = run_cell(model_id, script_name)
        except BaseException as exc:  # a bug in the matrix itself: say so, keep going
            cell = {"model": model_id, "script": script_name, "status": "transform fails",
                    "detail": "matrix error: " + _exception(exc) + " " + traceback.format_exc()[-300:]}
        sys.stdout.write(MARK + json.dumps(cell) + "\n")
        sys.stdout.flush()


class Worker:
    """One worker process, replaced after a crash, a timeout, or ``recycle`` cells."""

    def __init__(self, recycle: int = 300):
        self.process = None
        self.buffer = b""
        self.count = 0
        self.recycle = recycle

    def _start(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen([sys.executable, "-m", "tests.zoo.matrix", "--worker"], cwd=ROOT, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.buffer = b""
        self.count = 0

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def run(self, model_id: str, script_name: str, timeout: float) -> dict:
        if self.process is None or self.count >= self.recycle:
            self.stop()
            self._start()
        self.count += 1
        self.process.stdin.write(f"{model_id}\t{script_name}\n".encode())
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(MARK):
                    return json.loads(text[len(MARK):])
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                return {"model": model_id, "script": script_name, "status": "timeout",
                        "detail": f"no result after {timeout:.0f} s"}
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.process.wait()
                    self.process = None
                    return {"model": model_id, "script": script_name, "status": "worker died",
                            "detail": f"the worker process exited with {code}"}
                self.buffer += chunk


def run_matrix(cells: list[tuple[str, str]], workers: int = 2, timeout: float = CELL_TIMEOUT,
               progress: bool = True, partial: Path | None = None) -> list[dict]:
    """Run ``cells`` on ``workers`` processes; results in the order of ``cells``.

    ``partial``: a file that gets one JSON line per finished cell, as they finish.
    """
    results: dict[int, dict] = {}
    lock = threading.Lock()
    queue = list(enumerate(cells))
    started = time.perf_counter()

    def drain() -> None:
        worker = Worker()
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    index, (model_id, script_name) = queue.pop(0)
                result = worker.run(model_id, script_name, timeout)
                with lock:
                    results[index] = result
                    if partial is not None:
                        with open(partial, "a") as stream:
                            stream.write(json.dumps(result) + "\n")
                    if progress:
                        print(f"[{len(results)}/{len(cells)} {time.perf_counter() - started:.0f}s] {model_id} | "
                              f"{script_name}: {result['status']}"
                              + (f" ({result['detail']})" if result.get("detail") else ""), file=sys.stderr,
                              flush=True)
        finally:
            worker.stop()

    threads = [threading.Thread(target=drain) for _ in range(max(1, workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(cells))]


# --------------------------------------------------------------------------- command line


def _select(names: Iterable[str], wanted: str | None) -> list[str]:
    names = list(names)
    if not wanted:
        return names
    chosen = []
    for part in (p.strip() for p in wanted.split(",") if p.strip()):
        exact = [n for n in names if n == part or n.split("/", 1)[-1] == part]
        matches = exact or [n for n in names if part.lower() in n.lower()]
        if not matches:
            raise SystemExit(f"nothing matches {part!r}")
        chosen += [m for m in matches if m not in chosen]
    return chosen


def commit() -> str:
    """The commit the matrix ran on: ``$ZOO_COMMIT`` (a copy without .git), else ``git rev-parse HEAD``,
    with ``+ uncommitted changes (...)`` when the working tree differs from it (files under docs/,
    where the results go, not counted)."""
    if os.environ.get("ZOO_COMMIT"):
        return os.environ["ZOO_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = [line[3:] for line in status if line.strip()]
    if not changed:
        return head
    return f"{head} + uncommitted changes ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})"


def _cpu() -> dict:
    """The CPU the matrix ran on: results differ by CPU where kernels do (spec.md, quantize)."""
    from transformdsl.capabilities import describe_cpu

    return describe_cpu()


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("transformdsl", "torch", "diffusers", "transformers", "bitsandbytes",
                                              "hqq", "safetensors")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.zoo.matrix", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", help="comma-separated ids or substrings (default: all)")
    parser.add_argument("--scripts", help="comma-separated column names (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=CELL_TIMEOUT, help="seconds per cell")
    parser.add_argument("--json", default=str(ROOT / "docs" / "SUPPORT.json"), help="where results go")
    parser.add_argument("--markdown", default=None, help="also write the support page here (docs/SUPPORT.md)")
    parser.add_argument("--first", help="comma-separated ids or substrings of models to run before the others")
    args = parser.parse_args(argv)
    if args.worker:
        _worker()
        return 0

    from . import corpus

    models = _select([e["id"] for e in corpus.entries()], args.models)
    columns = _select(SCRIPTS, args.scripts)
    if args.first:
        first = _select(models, args.first)
        models = first + [m for m in models if m not in first]
    cells = [(m, s) for m in models for s in scripts_for(m) if s in columns]
    started = time.perf_counter()
    partial = Path(args.json).with_suffix(".partial.jsonl")
    partial.unlink(missing_ok=True)
    results = run_matrix(cells, workers=args.workers, timeout=args.timeout, partial=partial)
    partial.unlink(missing_ok=True)
    report = {
        "command": "python -m tests.zoo.matrix" + ("" if argv is None else " " + " ".join(argv)),
        "commit": commit(),
        "seconds": round(time.perf_counter() - started, 1),
        "workers": args.workers,
        "versions": versions(),
        "cpu": _cpu(),
        "scripts": {name: SCRIPTS[name] for name in columns},
        "compile_slice": list(COMPILE_SLICE),
        "skipped": corpus.skipped(),
        "models": [{"id": e["id"], "library": e["library"], "class": e["class"]}
                   for e in corpus.entries() if e["id"] in models],  # corpus order, whatever ran first
        "cells": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    counts = {}
    for cell in results:
        counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    print(f"{len(results)} cells in {report['seconds']:.0f} s: "
          + ", ".join(f"{status} {counts[status]}" for status in STATUSES if status in counts), file=sys.stderr)
    if args.markdown:
        from .support import write_page

        write_page(report, Path(args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] if len(sys.argv) > 1 else None))
