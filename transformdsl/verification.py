"""The numerical guard: ``transform(model, script, verify=...)`` (spec.md "Numerical guard").

The model runs on sample inputs before and after the script; the two outputs are compared with a
*metric* whose value does not grow with the input's length, against the script's *bound* in that
metric (the sum of its statements' declared ``error_bound``, composed the way the metric's errors
add up), or against the bound the caller gave.  What was measured is a :class:`Report`: the metric,
the value (the worst sample's), the bound and where it came from, the inputs.

Metrics (:data:`METRICS`):

* ``kl``: the mean over tokens of KL(before ‖ after) between the softmax distributions of the output's
  last dimension, in nats: what a quantized language model loses in its predictions (its mean is the
  rise of the cross-entropy on text the float model would generate).  The default for logits.
* ``top1``: the share of tokens whose most likely entry changed (a change within float rounding of a
  tie does not count).
* ``rms``: the relative RMS error ``‖after - before‖ / ‖before‖`` over all elements: any output.
  The default for outputs that are not logits.
* ``max``: ``max|after - before| / max|before|``, the guard's earlier metric, kept for comparison: it
  grows with the input's length and with a trained model's logit scale, and ranks schemes differently
  from what they cost.

>>> import torch
>>> before = torch.tensor([[2.0, 0.0, -2.0]])
>>> round(measure("rms", before, before * 1.01), 4)
0.01
>>> measure("top1", before, before.flip(-1))
1.0
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import TransformError

#: Float rounding allowed on top of the script's bound, in units of the output dtype's
#: epsilon: exact transforms (fusing projections) may still change summation order.
ROUNDING_EPS = 16

#: How a Python caller gives ``verify`` an input (the command line says it its own way).
VERIFY_INPUTS_HINT = "pass verify_inputs=(args, kwargs)"

#: Verbs of the transforms that ``verify`` runs before rather than after: they change no weight and
#: compile at the first call, so checking after them would compile (and time) every verify sample
#: (353 s against 25 s on a Flux) to measure what compiling does not change beyond float rounding.
VERIFIED_BEFORE = ("compile",)


# --------------------------------------------------------------------------- metrics


def relative_error(before: torch.Tensor, after: torch.Tensor) -> float:
    """``max|after - before| / max|before|`` in float32 (the absolute error if ``before`` is all zeros)."""
    before, after = before.detach().float().cpu(), after.detach().float().cpu()
    scale = before.abs().max().item() if before.numel() else 0.0
    difference = (after - before).abs().max().item() if before.numel() else 0.0
    return difference / scale if scale > 0 else difference


def relative_rms(before: torch.Tensor, after: torch.Tensor) -> float:
    """``‖after - before‖ / ‖before‖`` over all elements, in float64 (the RMS of the difference if
    ``before`` is all zeros)."""
    before, after = before.detach().double().cpu(), after.detach().double().cpu()
    if not before.numel():
        return 0.0
    norm = before.norm().item()
    difference = (after - before).norm().item()
    return difference / norm if norm > 0 else difference / math.sqrt(before.numel())


def token_kl(before: torch.Tensor, after: torch.Tensor) -> float:
    """Mean over tokens (every position but the last dimension) of KL(softmax(before) ‖ softmax(after))
    over the last dimension, in nats, computed in float64."""
    before, after = before.detach().double().cpu(), after.detach().double().cpu()
    if not before.numel():
        return 0.0
    p_log, q_log = before.log_softmax(-1), after.log_softmax(-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return max(kl.mean().item(), 0.0)


def top1_changed(before: torch.Tensor, after: torch.Tensor, slack: float = 0.0) -> float:
    """Share of tokens whose largest entry of the last dimension changed.  A token counts only when
    the entry ``after`` picks is more than ``slack`` below the one ``before`` picks, read in ``before``
    (a near tie resolved the other way by float rounding is no change)."""
    before, after = before.detach().double().cpu(), after.detach().double().cpu()
    if not before.numel():
        return 0.0
    chosen = after.argmax(-1, keepdim=True)
    loss = before.amax(-1, keepdim=True) - before.gather(-1, chosen)
    return (loss > slack).double().mean().item()


@dataclass(frozen=True)
class Metric:
    """A way to compare two outputs; ``combine`` says how statements' bounds add up: ``"sum"`` (the
    errors of successive approximations add to first order: the triangle inequality), or
    ``"amplitude"`` (KL grows with the square of a perturbation: the square roots add)."""

    name: str
    description: str
    combine: str

    def measure(self, before: torch.Tensor, after: torch.Tensor) -> float:
        if self.name == "rms":
            return relative_rms(before, after)
        if self.name == "kl":
            return token_kl(before, after)
        if self.name == "top1":
            return top1_changed(before, after, _rounding(before))
        return relative_error(before, after)

    def combined(self, bounds: list[float]) -> float:
        if self.combine == "amplitude":
            return sum(math.sqrt(b) for b in bounds) ** 2
        return sum(bounds)

    def tolerance(self, bound: float, reference: torch.Tensor) -> float:
        """``bound`` plus float rounding of the output (:data:`ROUNDING_EPS` epsilons): relative for
        ``rms`` and ``max``; for ``kl`` a rounding of the logits by up to that much of their largest
        magnitude, added to the bound's amplitude (KL ≈ variance of the logits' change / 2)."""
        eps = ROUNDING_EPS * _eps(reference)
        if self.name == "kl":
            scale = reference.detach().abs().max().item() if reference.numel() else 0.0
            return (math.sqrt(bound) + eps * scale / math.sqrt(2)) ** 2
        if self.name == "top1":
            return bound  # near ties are not counted (top1_changed's slack)
        return bound + eps


METRICS: dict[str, Metric] = {
    "kl": Metric("kl", "mean KL(before ‖ after) per token of the softmax over the last dimension, nats",
                 "amplitude"),
    "top1": Metric("top1", "share of tokens whose most likely entry changed", "sum"),
    "rms": Metric("rms", "relative RMS error ‖after - before‖ / ‖before‖", "sum"),
    "max": Metric("max", "max|after - before| / max|before|", "sum"),
}


def measure(metric: str, before: torch.Tensor, after: torch.Tensor) -> float:
    """``metric`` (a name in :data:`METRICS`) between two outputs of the same shape."""
    return METRICS[metric].measure(before, after)


def _eps(reference: torch.Tensor) -> float:
    return torch.finfo(reference.dtype if reference.is_floating_point() else torch.float32).eps


def _rounding(reference: torch.Tensor) -> float:
    """What float rounding may move an output entry by: 16 epsilons of its largest magnitude."""
    scale = reference.detach().abs().max().item() if reference.numel() else 0.0
    return ROUNDING_EPS * _eps(reference) * scale


# --------------------------------------------------------------------------- bounds


def declared_bound(transform: Any, metric: str) -> float | None | bool:
    """A statement's bound in ``metric``: its ``error_bound`` is ``0`` (exact: 0 in every metric),
    ``None`` (no bound), a number (a relative RMS bound: ``rms`` only) or a mapping metric -> bound.
    ``False`` when it declares none for this metric."""
    bound = transform.error_bound
    if bound is None:
        return None
    if isinstance(bound, Mapping):
        if metric not in bound:
            return False
        return None if bound[metric] is None else float(bound[metric])
    if float(bound) == 0.0:
        return 0.0
    return float(bound) if metric == "rms" else False


def script_error_bound(transforms: list, metric: str = "rms") -> float | None:
    """The bound of a script in ``metric``: its steps' ``error_bound`` combined the way the metric's
    errors add up (:class:`Metric`); ``None`` if a step has none (in this metric or at all).

    Errors of successive approximations add up to first order, so the sum is the bound that holds
    whatever order the steps run in; a maximum would understate two lossy steps.
    """
    bounds = []
    for step in transforms:
        bound = declared_bound(step, metric)
        if bound is None or bound is False:
            return None
        bounds.append(bound)
    return METRICS[metric].combined(bounds)


def _describe_bound(transform: Any, metric: str) -> str:
    bound = declared_bound(transform, metric)
    return "none" if bound is None or bound is False else f"{bound:g}"


# --------------------------------------------------------------------------- what verify= asks


@dataclass(frozen=True)
class Check:
    """One comparison ``verify=`` asks for: a metric (``None``: the default for the output) and a
    bound (``None``: the script's)."""

    metric: str | None = None
    bound: float | None = None


def checks(verify: Any) -> list[Check]:
    """``verify=`` as a list of checks (empty: no verification).

    ``True``: the default metric against the script's bound; a number: that bound on the default
    metric; a metric name (``"kl"``, ``"top1"``, ``"rms"``, ``"max"``): that metric against the
    script's bound in it; a mapping ``{metric: bound}``: each metric against its bound (``None``: the
    script's).
    """
    if verify is None or verify is False:
        return []
    if verify is True:
        return [Check()]
    if isinstance(verify, str):
        return [Check(_metric_name(verify))]
    if isinstance(verify, (int, float)):
        return [Check(None, _bound_value(verify, "verify"))]
    if isinstance(verify, Mapping) and verify:
        return [Check(_metric_name(k), None if v is None else _bound_value(v, f"verify[{k!r}]"))
                for k, v in verify.items()]
    raise TransformError(f"verify={verify!r}: expected True, a bound (verify=0.05), a metric "
                         f"(verify={_names()}) or a mapping {{metric: bound}} (nothing was changed)")


def _names() -> str:
    return "|".join(f"'{name}'" for name in METRICS)


def _metric_name(name: Any) -> str:
    if isinstance(name, str) and name in METRICS:
        return name
    raise TransformError(f"verify: {name!r} is not a metric; one of {', '.join(METRICS)} (nothing was changed)")


def _bound_value(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TransformError(f"{where}={value!r}: a bound is a finite number >= 0 (nothing was changed)")
    return float(value)


def parse_cli(text: str | None) -> Any:
    """The command line's ``--verify-with METRIC|BOUND|METRIC=BOUND`` as ``transform``'s ``verify=``."""
    if text is None or text == "":
        return True
    name, _, value = text.partition("=")
    try:
        return {name: float(value)} if value else float(name)
    except ValueError:
        return {name: value} if value else name  # checks() names what is wrong


# --------------------------------------------------------------------------- running the model


@dataclass
class Output:
    """A model's output tensor and what it is (``"logits"``, or ``"tensor"``)."""

    tensor: torch.Tensor
    kind: str
    inputs: str


def _one_output(raw: Any) -> tuple[torch.Tensor, str]:
    from .models.inputs import one_tensor

    logits = getattr(raw, "logits", None)
    if isinstance(logits, torch.Tensor) and getattr(raw, "sample", None) is None:
        return logits, "logits"
    return one_tensor(raw), "tensor"


def describe_inputs(args: tuple, kwargs: dict) -> str:
    """Short text of a sample input: its tensors' names and shapes (``input_ids 1x512``)."""
    parts = []
    for name, value in [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            parts.append(f"{name} {'x'.join(map(str, value.shape)) or 'scalar'}")
        elif isinstance(value, str):
            parts.append(repr(value[:40]))
    return ", ".join(parts[:4]) + (", ..." if len(parts) > 4 else "")


def model_output(model: Any, inputs: tuple[tuple, dict] | None = None) -> Output:
    """The model's output on ``inputs`` (default: :func:`transformdsl.models.sample_inputs`, seed 0).

    Modules run in eval mode (no dropout, no batch-norm statistics updated: the run must
    not change the model it checks); their training flags are restored afterwards.
    """
    from .models.inputs import sample_inputs
    from .planner import module_components

    roots = list(module_components(model).values())
    flags = [(m, m.training) for root in roots for m in root.modules()]
    try:
        for root in roots:
            root.eval()
        args, kwargs = sample_inputs(model, seed=0) if inputs is None else inputs
        with torch.no_grad(), fresh_run(roots):
            tensor, kind = _one_output(model(*args, **kwargs))
        described = describe_inputs(args, kwargs)
        return Output(tensor, kind, f"the sample input ({described})" if inputs is None else described)
    finally:
        for module, training in flags:
            module.training = training


@contextlib.contextmanager
def fresh_run(roots: list[torch.nn.Module]):
    """One call of the model as if it were the first: each module a run-time technique that keeps state
    between calls attached to (a step cache: a fresh denoising loop) runs inside that technique's
    :meth:`~transformdsl.extend.RuntimeTransform.fresh_run`, which also leaves no state behind."""
    from .extend import FRESH_RUN

    with contextlib.ExitStack() as stack:
        for root in roots:
            for module in root.modules():
                fresh = module.__dict__.get(FRESH_RUN)
                if fresh is not None:
                    stack.enter_context(fresh(module))
        yield


def sample_output(model: Any, inputs: tuple[tuple, dict] | None = None) -> torch.Tensor:
    """The model's output tensor on ``inputs`` (:func:`model_output`)."""
    return model_output(model, inputs).tensor


def checked_output(model: Any, inputs, when: str) -> Output:
    """:func:`model_output`, any failure explained as a TransformError."""
    try:
        return model_output(model, inputs)
    except Exception as exc:
        hint = f"; {VERIFY_INPUTS_HINT}" if inputs is None else ""
        raise TransformError(f"verify: cannot run the model on its sample input {when}: {type(exc).__name__}: "
                             f"{exc}{hint} (the model was left unchanged)") from exc


def reference_output(model: Any, inputs) -> Output:
    """The output to compare against, checked before anything is changed."""
    reference = checked_output(model, inputs, "before transforming")
    if not torch.isfinite(reference.tensor).all():
        raise TransformError("verify: the model's output is not finite before transforming; cannot verify "
                             "(the model was left unchanged)")
    return reference


# --------------------------------------------------------------------------- the verdict


@dataclass
class Report:
    """What one check measured: the worst sample's value in ``metric`` against ``bound``."""

    metric: str
    value: float
    bound: float | None
    #: ``"the script's"`` (each statement's declared bound, in :attr:`statements`) or ``"verify="``.
    source: str
    #: (statement as written, its declared bound as text) for each statement of the script.
    statements: list[tuple[str, str]] = field(default_factory=list)
    #: One value per sample, in the order given, and the samples' descriptions.
    values: list[float] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    tolerance: float | None = None

    @property
    def passed(self) -> bool:
        return self.tolerance is None or self.value <= self.tolerance

    def where(self) -> str:
        """The sample(s) measured: the worst one named when there are several."""
        if len(self.inputs) == 1:
            return f"on {self.inputs[0]}"
        worst = max(range(len(self.values)), key=self.values.__getitem__)
        return f"worst of {len(self.inputs)} samples: #{worst + 1}, {self.inputs[worst]}"

    def statements_text(self) -> str:
        return ", ".join(f"{text}: {bound}" for text, bound in self.statements) or "no statement"

    def __str__(self) -> str:
        what = f"({self.metric}: {METRICS[self.metric].description}; {self.where()})"
        if self.bound is None:
            return f"verify: {self.metric} {self.value:.3g} {what}, no bound ({self.statements_text()})"
        given = self.source == "verify="
        if self.passed:
            whose = "given to verify" if given else f"the script's: {self.statements_text()}"
            return f"verify: {self.metric} {self.value:.3g} {what} within the bound {self.bound:g} ({whose})"
        whose = f"the bound {self.bound:g} given to verify" if given else \
            f"the script's bound {self.bound:g} ({self.statements_text()})"
        return f"verify: the output changed by {self.value:.3g} {what}, more than {whose}"


class VerifyError(TransformError):
    """``verify`` refused the transformed model; :attr:`report` says what was measured."""

    def __init__(self, message: str, report: Report):
        super().__init__(message)
        self.report = report


def verify(model: Any, references: list[Output], samples: list, statements: list[tuple[str, Any]],
           requested: list[Check], log, before: str | None = None) -> list[Report]:
    """Compare the transformed ``model``'s outputs with ``references`` (one per sample) for each check;
    raise :class:`VerifyError` (the caller rolls back) if one is past its bound.  ``statements``:
    (statement as written, its transform) in execution order; ``before``: the verb of the statement
    the check runs before (:data:`VERIFIED_BEFORE`; a note in the log line)."""
    outputs = []
    for reference, inputs in zip(references, samples):
        output = checked_output(model, inputs, "after transforming")
        if tuple(output.tensor.shape) != tuple(reference.tensor.shape):
            raise TransformError(f"verify: the output's shape changed from {tuple(reference.tensor.shape)} to "
                                 f"{tuple(output.tensor.shape)}; the model was left unchanged")
        if not torch.isfinite(output.tensor).all():
            raise TransformError("verify: the transformed model's output is not finite; the model was left unchanged")
        outputs.append(output)
    transforms = [transform for _, transform in statements]
    reports = []
    for check in requested:
        metric = check.metric or default_metric(references[0].kind, transforms, check.bound is not None)
        values = [METRICS[metric].measure(r.tensor, o.tensor) for r, o in zip(references, outputs)]
        worst = max(range(len(values)), key=values.__getitem__)
        bound = check.bound if check.bound is not None else script_error_bound(transforms, metric)
        report = Report(metric, values[worst], bound, "verify=" if check.bound is not None else "the script's",
                        [(text, _describe_bound(t, metric)) for text, t in statements], values,
                        [r.inputs for r in references])
        if bound is not None:
            report.tolerance = METRICS[metric].tolerance(bound, references[worst].tensor)
        reports.append(report)
        if not report.passed:
            raise VerifyError(f"{report}; the model was left unchanged", report)
        if log is not None:
            when = f" (checked before {before}: it changes no weight, and would compile every sample)" if before \
                else ""
            log(f"{report}{when}")
    return reports


def default_metric(kind: str, transforms: list, bound_given: bool = False) -> str:
    """``kl`` for logits when every statement declares a KL bound (or a bound was given), else ``rms``."""
    if kind == "logits" and (bound_given or all(declared_bound(t, "kl") is not False for t in transforms)):
        return "kl"
    return "rms"
