"""One measurement: a model, one way of transforming it, in a process of its own.

:func:`measure` does the whole job for one (workload, comparison, side) and returns a dict of
plain numbers.  :func:`run_isolated` runs it in a fresh process forked from a server that has
already imported torch and the libraries, so every configuration starts from the same memory
(peak RSS is meaningful and comparable) without paying the imports each time.

Protocol, for every side alike:

1. read the original model (``from_pretrained``, every byte read), run it once: the reference;
2. in the comparison's dtype if it has one (bf16 for fp8 jobs): read its checkpoint saved in
   that dtype (``workloads.prepare``), as a user of a bf16 model does, not timed;
3. reset the peak-RSS counter; transform (timed); first call (timed: includes compilation);
4. steady latency: median of ``repeats`` calls after ``warmup`` calls, torch threads fixed;
5. weight bytes, peak and steady RSS, layers changed, error against the reference;
6. ours only: save, then reload with ``transformdsl.load`` against the floor (safetensors
   reading the same bytes), and check the reloaded model reproduces our output bit for bit.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import workloads
from common import median_time
from comparisons import BY_NAME, Comparison
from workloads import Workload

ORIGINAL = "original"
OURS = "transformdsl"
LOW_PRECISION = {torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class Job:
    """What one process measures.  ``side`` is ORIGINAL, OURS or a baseline's label."""

    workload: Workload
    comparison: str
    side: str
    threads: int = 1
    repeats: int = 5
    warmup: int = 1
    latency: bool = True
    reload: bool = True
    #: By-hand jobs: call ours and theirs in turn this many times in the same process (0: no duel).
    duel: int = 0
    #: Transform this many fresh copies and keep the fastest (the scaling series).
    best_of: int = 1
    #: Only read the model and time the transform (another round of a comparison's apply time,
    #: :attr:`comparisons.Comparison.apply_rounds`): no reference, latency, reload or duel.
    apply_only: bool = False


# ---------------------------------------------------------------------- memory

def _status() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def rss() -> int:
    """Resident set size of this process now, bytes."""
    return _status()["VmRSS"]


def peak_rss() -> int:
    """Highest resident set size since the last :func:`reset_peak`, bytes."""
    return _status()["VmHWM"]


def release_free_memory() -> None:
    """Hand freed heap memory back to the system (glibc ``malloc_trim``), so that "RSS after"
    counts memory in use rather than what the allocator happened to keep."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def reset_peak() -> None:
    """Restart the kernel's high-water mark at the current RSS (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak then includes what came before
        pass


def _tensor_storages(tensor: torch.Tensor):
    """(data_ptr, nbytes) of the storages behind a tensor, looking inside tensor subclasses (torchao)."""
    if hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _tensor_storages(getattr(tensor, name))
        return
    if tensor.device.type == "meta":
        return
    storage = tensor.untyped_storage()
    yield storage.data_ptr(), storage.nbytes()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds: parameters, buffers and what its state_dict adds
    (quantization state such as hqq's scales), each storage counted once."""
    seen = {}
    tensors = [*model.parameters(), *model.buffers(), *model.state_dict().values()]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            for ptr, nbytes in _tensor_storages(tensor):
                seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


# ---------------------------------------------------------------------- model facts

def _unwrap(model):
    return getattr(model, "_orig_mod", model)


def layer_kinds(model: torch.nn.Module) -> dict[str, str]:
    return {path: type(m).__name__ for path, m in _unwrap(model).named_modules()}


def changed_layers(before: dict[str, str], model: torch.nn.Module) -> int:
    """Leaf modules that are new, re-typed, or hold low-precision (or tensor-subclass) weights."""
    count = 0
    for path, module in _unwrap(model).named_modules():
        if next(module.children(), None) is not None:
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            weight = getattr(module, "W_q", None)  # hqq's HQQLinear
        # torchao swaps weights for tensor subclasses that report the float dtype
        low = isinstance(weight, torch.Tensor) and (
            weight.dtype in LOW_PRECISION or type(weight) not in (torch.Tensor, torch.nn.Parameter))
        if before.get(path) != type(module).__name__ or low:
            count += 1
    return count


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """RMS of the difference over the RMS of the reference (0 = identical)."""
    diff = output.detach().float() - reference.detach().float()
    return (diff.norm() / reference.detach().float().norm().clamp_min(1e-30)).item()


def touch(tensors) -> None:
    """Read every byte of every tensor: memory-mapped files are read lazily, and both sides of
    a reload comparison (and the reading of the original model) must have really read them."""
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or not tensor.numel() or tensor.is_meta:
            continue
        try:  # bitsandbytes' Int8Params/Params4bit are plain tensors underneath
            data = tensor.detach().as_subclass(torch.Tensor)
        except (TypeError, RuntimeError):  # wrapper subclasses (torchao): their own storage
            continue
        if data.is_contiguous():
            # every byte: touching one per page would only map the (cached) file, not read it
            data.reshape(-1).view(torch.uint8).max()
        else:
            data.float().sum()


def touch_model(model) -> None:
    touch(_unwrap(model).state_dict().values())


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        result, seconds = _timed(fn)
        del result
        times.append(seconds)
    return min(times)


def latency(fn, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` calls, after ``warmup`` calls."""
    return median_time(fn, repeats=repeats, warmup=warmup)


# ---------------------------------------------------------------------- the job

class NotAvailable(Exception):
    """The transform (or a baseline's package) is not there yet: the row says so."""


def quiet() -> None:
    """bitsandbytes warns on every fp32 call and diffusers on every dtype cast: keep the log readable."""
    warnings.filterwarnings("ignore")
    for name in ("bitsandbytes", "diffusers", "transformers", "torch._dynamo", "torch._inductor", "hqq"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from diffusers.utils import logging as dlogging

        dlogging.set_verbosity_error()
    except ImportError:
        pass


def _apply(job: Job, comparison: Comparison, model):
    """Transform ``model`` the job's way; raise :class:`NotAvailable` if that way cannot run yet."""
    if job.side == ORIGINAL:
        return model
    if job.side == OURS:
        import transformdsl

        try:
            return transformdsl.transform(model, comparison.script_for(job.workload),
                                          **dict(comparison.transform_kwargs))
        except transformdsl.TransformError as exc:
            if "cannot be executed yet" in str(exc) or isinstance(exc.__cause__, NotImplementedError):
                raise NotAvailable("not available yet (the transform has not landed)") from exc
            raise
    baseline = next(b for b in comparison.baselines if b.label == job.side)
    if baseline.needs:
        try:
            __import__(baseline.needs)
        except ImportError as exc:
            raise NotAvailable(f"{baseline.needs} is not installed") from exc
    return baseline.fn(model)


def _fresh_compile_cache() -> None:
    """Each compiling job starts cold: neither side reuses the other's compiled graphs."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=workloads.WORK)
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"


def measure(job: Job) -> dict:
    """Measure one job; never raises (a failure is a row that says what failed)."""
    torch.set_num_threads(job.threads)
    row = {"workload": job.workload.key, "family": job.workload.family, "size": job.workload.size,
           "comparison": job.comparison, "side": job.side, "threads": torch.get_num_threads()}
    try:
        row.update(_measure(job))
        row["status"] = "ok"
    except NotAvailable as exc:
        row["status"] = str(exc)
    except Exception as exc:  # a row with the error beats a lost run
        row["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        row["traceback"] = traceback.format_exc()[-3000:]
    return row


def _read(job: Job, comparison: Comparison | None):
    """The original model (every byte read), its facts, and the sample input in the job's dtype."""
    with torch.no_grad():  # not inference_mode: the transforms could not change its tensors after
        model, read_s = _timed(lambda: workloads.read(job.workload))
        _, touch_s = _timed(lambda: touch_model(model))
    facts = {"params": workloads.parameter_count(model), "read_s": read_s + touch_s,
             "original_bytes": weight_bytes(model)}
    reference = workloads.reference(job.workload, model)
    dtype = comparison.dtype if comparison else torch.float32
    if dtype != torch.float32:
        # The job's model is its checkpoint in that dtype, read as a user reads one (memory-mapped:
        # the same values as model.to(dtype), held by the file's pages rather than new memory).
        del model
        gc.collect()
        with torch.no_grad():
            model = workloads.read(job.workload, dtype)
            touch_model(model)
    return model, facts, reference, workloads.sample(model, dtype)


def _transform(job: Job, comparison: Comparison | None, model):
    with torch.no_grad():
        # no_grad, not inference_mode: quantizers create parameters, which inference mode forbids.
        return _timed(lambda: _apply(job, comparison, model))


def saved_dir(job: Job) -> Path:
    """Where our transformed model of this (workload, comparison) is saved for the other jobs."""
    slug = "".join(c if c.isalnum() else "-" for c in job.comparison)
    return workloads.WORK / "saved" / f"{job.workload.key}-{slug}"


def _measure(job: Job) -> dict:
    comparison = BY_NAME.get(job.comparison)
    if job.apply_only:
        return _apply_round(job, comparison)
    base = rss()
    model, facts, reference, inputs = _read(job, comparison)
    before = layer_kinds(model)
    if comparison and "compile" in comparison.script_for(job.workload):
        _fresh_compile_cache()
    if job.side == OURS:
        shutil.rmtree(saved_dir(job), ignore_errors=True)  # never duel against an older run's model
    duel = job.duel and job.side not in (OURS, ORIGINAL) and (saved_dir(job) / "transformdsl.json").exists()

    gc.collect()
    reset_peak()
    model, transform_s = _transform(job, comparison, model)
    with torch.inference_mode():
        output, first_s = _timed(lambda: workloads.forward(model, inputs))
        # A duel (below) times the by-hand model too: no separate latency runs then.
        steady = (latency(lambda: workloads.forward(model, inputs), job.repeats, job.warmup)
                  if job.latency and not duel else None)
    peak = peak_rss() - base
    release_free_memory()
    facts.update(transform_s=transform_s, first_call_s=first_s, latency_s=steady, peak_rss=peak,
                 rss_after=rss() - base, weight_bytes=weight_bytes(model),
                 layers=changed_layers(before, model), error=relative_error(output, reference))
    if job.best_of > 1:  # the scaling series: the fastest of a few fresh transforms
        facts["transform_s"] = min([transform_s] + [_transform(job, comparison, _read(job, comparison)[0])[1]
                                                    for _ in range(job.best_of - 1)])
    if job.side == OURS:
        facts["covered"] = covered_bytes(model)
    if job.side == OURS and job.reload and comparison and comparison.reload:
        facts["reload"] = _reload(model, output, inputs, saved_dir(job))
    if duel:
        facts["duel"] = _duel(job, model, inputs)
        facts["latency_s"] = facts["duel"]["hand_s"]
    return facts


def _apply_round(job: Job, comparison: Comparison) -> dict:
    """Another round of the job's apply time: the checkpoint the full job transforms (in the
    comparison's dtype, every byte read), then the transform, timed alike.  Unlike the full job it
    reads no float32 original and runs no reference first: both sides' rounds start alike, which is
    what their ratio needs."""
    with torch.no_grad():
        model = workloads.read(job.workload, comparison.dtype)
        touch_model(model)
    gc.collect()
    _, transform_s = _transform(job, comparison, model)
    return {"transform_s": transform_s}


def covered_bytes(model) -> list[int] | None:
    """[before, after]: the bytes of the layers our script replaced, as its records give them
    (quantize writes ``bytes_before``/``bytes_after``); None when no statement records them."""
    from transformdsl.history import history_of

    history = history_of(model)
    records = [step.record for step in (history.steps if history else ())
               if isinstance(step.record, dict) and "bytes_before" in step.record]
    if not records:
        return None
    return [sum(r["bytes_before"] for r in records), sum(r["bytes_after"] for r in records)]


def _duel(job: Job, hand_model, inputs) -> dict:
    """Our model (as ``transformdsl.load`` gives it back from our job's save: bit-exact, checked
    there) and the by-hand one, in this same process, called in turn (ABBA...): both see the
    same machine load, so the ratio of their latencies is robust on a busy machine."""
    import transformdsl

    ours = transformdsl.load(saved_dir(job))
    times = {OURS: [], "hand": []}
    calls = {OURS: lambda: workloads.forward(ours, inputs), "hand": lambda: workloads.forward(hand_model, inputs)}
    with torch.inference_mode():
        calls[OURS]()  # warm-up; the by-hand model had its first call above
        for i in range(job.duel):
            for side in ((OURS, "hand") if i % 2 == 0 else ("hand", OURS)):
                _, seconds = _timed(calls[side])
                times[side].append(seconds)
    ratios = [a / b for a, b in zip(times[OURS], times["hand"])]
    return {"pairs": job.duel, "ours_s": statistics.median(times[OURS]), "hand_s": statistics.median(times["hand"]),
            "ratio": statistics.median(ratios)}


def _reload(model, output: torch.Tensor, inputs, target: Path) -> dict:
    """Save our model to ``target`` (kept for the duels), then time ``transformdsl.load``
    against safetensors reading the same bytes, every byte read on both sides."""
    from safetensors.torch import load_file

    import transformdsl

    try:
        _, save_s = _timed(lambda: transformdsl.save(model, target))
        files = sorted(target.glob("*.safetensors"))
        for f in files:  # both sides read from a warm page cache
            f.read_bytes()

        def floor():
            tensors = [t for f in files for t in load_file(str(f)).values()]
            touch(tensors)
            return tensors

        def load_and_touch():
            loaded = transformdsl.load(target)
            touch_model(loaded)
            return loaded

        def architecture():
            # What any load that rebuilds the model from its configuration pays before reading a
            # byte: the library's own constructor, on the meta device (accelerate's empty weights).
            cls, config = type(_unwrap(model)), _unwrap(model).config
            with torch.device("meta"):
                # as transformdsl.load builds it: transformers' cls(config), diffusers' from_config
                return cls(config) if hasattr(cls, "config_class") else cls.from_config(config)

        floor_s = _best_of(floor, 2)
        load_s = _best_of(load_and_touch, 2)
        # after the load: building on meta without transformdsl's init skipping runs torch's meta
        # kernels, whose first use imports torch._dynamo (objects that then weigh on every collection)
        architecture_s = _best_of(architecture, 2)
        with torch.inference_mode():
            again = workloads.forward(transformdsl.load(target), inputs)
        return {"save_s": save_s, "floor_s": floor_s, "architecture_s": architecture_s, "load_s": load_s,
                "file_bytes": sum(f.stat().st_size for f in files), "exact": bool(torch.equal(again, output))}
    except Exception as exc:
        shutil.rmtree(target, ignore_errors=True)  # no duel against a model that did not reload
        return {"status": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


# ---------------------------------------------------------------------- isolation

def set_preload(need: set[str], paths: list[str]) -> None:
    """Tell the fork server (:mod:`preload`) which backends the planned jobs use, and where the
    modules are: Python 3.11's fork server does not apply the parent's ``sys.path`` (it ignores
    a failed preload silently), so the paths go through ``PYTHONPATH``."""
    os.environ["BENCH_PRELOAD"] = ",".join(sorted(need))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])


class Isolated:
    """Runs each job in a fresh process forked from one server that preloaded the libraries."""

    def __init__(self, need: set[str], paths: list[str], timeout_s: float = 600):
        set_preload(need, paths)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["preload"])
        self.timeout_s = timeout_s

    def __call__(self, job: Job) -> dict:
        reader, writer = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_child, args=(job, writer), daemon=True)
        process.start()
        writer.close()
        row = None
        timed_out = not reader.poll(self.timeout_s)
        if not timed_out:
            try:
                row = reader.recv()
            except EOFError:
                row = None
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
        if row is None:
            why = f"timed out after {self.timeout_s:.0f} s" if timed_out else f"crashed (exit code {process.exitcode})"
            row = {"workload": job.workload.key, "family": job.workload.family, "size": job.workload.size,
                   "comparison": job.comparison, "side": job.side,
                   "status": f"failed: the process {why}"}
        reader.close()
        return row


def _child(job: Job, writer) -> None:
    quiet()
    writer.send(measure(job))
    writer.close()
