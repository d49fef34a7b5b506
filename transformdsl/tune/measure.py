"""What ``tune`` measures: quality on held-out inputs, saved bytes, latency paired with the float model.

Quality uses the numerical guard's metrics (:mod:`transformdsl.verification`: ``kl``, ``rms``) and the
perplexity ratio ``ppl_ratio`` (``exp`` of the rise of the next-token cross-entropy on the held-out
token ids).  Over several held-out samples the worst one counts, as in the guard.  Each quality has an
*additive part*, which the per-layer search sums over layers: the errors of different layers' rounding
are close to independent, so their variances add: KL itself (the variance of the logits' change, over
two), the square of a relative RMS, the log of a perplexity ratio.  (The guard's bounds add the square
roots instead: the worst case, aligned errors.  Measured on the trained LM of the tests: a script of 30
changed layers had a KL 0.92x the sum of its layers' KLs; another, whose layers' square roots summed
to a KL of 0.26, measured 0.008.)
"""

from __future__ import annotations

import copy
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import verification
from ..errors import TransformError

Sample = tuple[tuple, dict]

#: The metrics a budget may bound, and the CLI flag of each.
QUALITIES = {"kl": "--max-kl", "rms": "--max-rms", "ppl_ratio": "--max-ppl-ratio"}


def as_sample(item: Any) -> Sample:
    """One model input as ``(args, kwargs)``: a tensor is the first positional argument, a dict the
    forward's keyword arguments, a pair ``(args, kwargs)`` is kept."""
    if isinstance(item, torch.Tensor):
        return (item,), {}
    if isinstance(item, dict):
        return (), dict(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple) and isinstance(item[1], dict):
        return item
    raise TransformError(f"tune: a calibration or held-out input is a tensor, a dict of forward arguments or "
                         f"(args, kwargs), not a {type(item).__name__}")


def split_calibration(data: Iterable | None, heldout: Iterable | None) -> tuple[list, list[Sample], str]:
    """``(fit, held_out, where)``: the inputs calibrated methods fit on, the held-out inputs quality is
    measured on, and where those came from, in words.  Without ``heldout``, the last quarter of the
    calibration data (at least one input) is held out and the rest is what methods fit on."""
    items = list(data) if data is not None else []
    if heldout is not None:
        held = [as_sample(x) for x in heldout]
        if not held:
            raise TransformError("tune: heldout= holds no input")
        return items, held, f"{len(held)} held-out input(s) given"
    if not items:
        return [], [], ""
    keep = max(1, len(items) // 4)
    if len(items) == 1:
        return [], [as_sample(items[0])], "the calibration's only input (nothing left to calibrate on)"
    return items[:-keep], [as_sample(x) for x in items[-keep:]], \
        f"the last {keep} of {len(items)} calibration inputs, held out"


def sample_inputs(model: Any, count: int) -> list[Sample]:
    """``count`` of the model's own sample inputs (seeds 0, 1, ...): random, not the model's data."""
    from .. import models

    return [models.sample_inputs(model, seed=seed) for seed in range(count)]


def describe_samples(samples: list[Sample]) -> str:
    return verification.describe_inputs(*samples[0]) + (f" (x{len(samples)})" if len(samples) > 1 else "")


# --------------------------------------------------------------------------- quality


def _labels(sample: Sample) -> torch.Tensor | None:
    args, kwargs = sample
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() == 2 else None


def cross_entropy(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy of ``logits`` on ``ids``, in nats (float64)."""
    logits = logits.detach().double()[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


@dataclass
class Reference:
    """The float model's outputs on the held-out samples, what everything is compared with."""

    samples: list[Sample]
    outputs: list[verification.Output]
    #: The float model's cross-entropy per sample (None: not a language model's logits on token ids).
    entropies: list[float] | None

    @classmethod
    def of(cls, model: Any, samples: list[Sample]) -> Reference:
        outputs = [verification.reference_output(model, s) for s in samples]
        entropies = None
        if all(o.kind == "logits" for o in outputs) and all(_labels(s) is not None for s in samples):
            entropies = [cross_entropy(o.tensor, _labels(s)) for o, s in zip(outputs, samples)]
        return cls(samples, outputs, entropies)

    @property
    def kind(self) -> str:
        return self.outputs[0].kind

    def qualities(self, model: Any) -> dict[str, float]:
        """Every quality of ``model`` against the float outputs (the worst sample's): ``kl`` (logits
        only), ``rms``, ``ppl_ratio`` (logits on token ids only)."""
        outs = [verification.checked_output(model, s, "after transforming").tensor for s in self.samples]
        for out, ref in zip(outs, self.outputs):
            if tuple(out.shape) != tuple(ref.tensor.shape) or not torch.isfinite(out).all():
                return {name: math.inf for name in self.metrics()}
        found = {"rms": max(verification.measure("rms", r.tensor, o) for r, o in zip(self.outputs, outs))}
        if self.kind == "logits":
            found["kl"] = max(verification.measure("kl", r.tensor, o) for r, o in zip(self.outputs, outs))
        if self.entropies is not None:
            found["ppl_ratio"] = max(math.exp(cross_entropy(o, _labels(s)) - e)
                                     for o, s, e in zip(outs, self.samples, self.entropies))
        return found

    def metrics(self) -> list[str]:
        return ["rms"] + (["kl"] if self.kind == "logits" else []) + (["ppl_ratio"] if self.entropies else [])


def amplitude(metric: str, value: float) -> float:
    """The part of a quality that adds up over layers (module docstring)."""
    if not math.isfinite(value):
        return math.inf
    if metric == "kl":
        return max(value, 0.0)
    if metric == "rms":
        return max(value, 0.0) ** 2
    if metric == "ppl_ratio":
        return max(math.log(value), 0.0) if value > 0 else math.inf
    return max(value, 0.0)


# --------------------------------------------------------------------------- size


def state_bytes(module: torch.nn.Module) -> int:
    """Bytes of the tensors in ``module``'s state_dict (what a save writes for it)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if isinstance(t, torch.Tensor))


def saved_bytes(model: Any) -> int:
    """Bytes of the tensor files (``*.safetensors``: data and headers) ``transformdsl.save`` writes for
    ``model`` (the JSON beside them holds the script's text, comments included: not the model's size)."""
    from ..persist import save

    with tempfile.TemporaryDirectory(prefix="transformdsl-tune-") as directory:
        out = Path(directory) / "model"
        save(model, out)
        return sum(p.stat().st_size for p in out.rglob("*.safetensors") if p.is_file())


# --------------------------------------------------------------------------- latency


def _run_all(model: Any, samples: list[Sample]) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        for args, kwargs in samples:
            model(*args, **kwargs)
    return time.perf_counter() - started


@dataclass(frozen=True)
class Latency:
    """The transformed model's time ÷ the float model's, paired round by round in one process."""

    ratio: float
    low: float
    high: float
    rounds: int
    float_s: float

    def text(self) -> str:
        return f"{self.ratio:.2f}x (rounds {self.low:.2f}-{self.high:.2f}, {self.rounds} rounds)"


def paired_latency(reference_model: Any, model: Any, samples: list[Sample], rounds: int = 5) -> Latency:
    """Run the float and the transformed model in turn on ``samples``, ``rounds`` times after one warm-up
    each; the median ratio and its spread."""
    _run_all(reference_model, samples), _run_all(model, samples)
    ratios, floats = [], []
    for index in range(rounds):
        if index % 2:  # alternate which goes first: a warming cache favours neither
            after, before = _run_all(model, samples), _run_all(reference_model, samples)
        else:
            before, after = _run_all(reference_model, samples), _run_all(model, samples)
        ratios.append(after / before)
        floats.append(before)
    return Latency(statistics.median(ratios), min(ratios), max(ratios), rounds, statistics.median(floats))


def layer_seconds(module: torch.nn.Module, x: torch.Tensor, repeat: int) -> float:
    with torch.no_grad():
        started = time.perf_counter()
        for _ in range(repeat):
            module(x)
        return (time.perf_counter() - started) / repeat


def layer_inputs(model: Any, paths: list[str], sample: Sample) -> dict[str, torch.Tensor]:
    """Each layer's input on one forward of ``sample`` (a pre-hook per layer)."""
    from ..planner import module_components

    root = next(iter(module_components(model).values()))
    found: dict[str, torch.Tensor] = {}
    handles = []
    for path in paths:
        def hook(module, args, path=path):
            if path not in found and args and isinstance(args[0], torch.Tensor):
                found[path] = args[0].detach()
        handles.append(root.get_submodule(path).register_forward_pre_hook(hook))
    try:
        verification.model_output(model, sample)
    finally:
        for handle in handles:
            handle.remove()
    return found


# --------------------------------------------------------------------------- modules and the machine


def set_module(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def copied(model: Any) -> Any:
    """A deep copy of ``model`` (a module or a pipeline), what each trial transforms."""
    return copy.deepcopy(model)


def cpu_name() -> str:
    """This CPU's model name (``/proc/cpuinfo``), its core count and what it multiplies fast."""
    from ..capabilities import cpu_text, describe_cpu

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads; {cpu_text(describe_cpu())}"
