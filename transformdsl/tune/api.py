"""``tune(model, ...)``: the script that meets a quality budget, smallest or fastest on this machine.

The search (spec.md "Finding a script: tune"):

1. **candidates**: the modes the registry declares (:mod:`.candidates`), each planned on the model
   (a mode that does not plan, or changes nothing, is pruned with the planner's reason);
2. **per-layer pass**: for each mode, a copy of the model is transformed once, and each of its layers
   in turn is put into the float model alone: the quality with that layer alone changed, its saved
   bytes (and, for ``goal="latency"``, its call time on the input it saw);
3. **knapsack** (:mod:`.search`): the per-layer modes with the least cost whose summed quality
   amplitudes stay within the budget's;
4. **verification**: at most ``evaluations`` whole scripts are applied and measured end to end (the
   quality on the held-out inputs, the saved bytes, the latency paired with the float model); when
   the measured quality differs from the summed prediction, the knapsack's capacity is corrected by
   their ratio and solved again.

Everything measured is kept in an optuna study (:mod:`.study`), so an interrupted tune resumes without
measuring again and several workers can share one storage.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ScriptError, TransformError
from ..explain import human_bytes
from . import measure, search
from . import script as script_writer
from .candidates import Mode, calibrated_script, declared_modes, parse_modes
from .measure import QUALITIES, Latency, Reference
from .study import Study, study_name

#: Bumped when what a study holds changes meaning (a stored result of another version is not reused).
STUDY_VERSION = 2
GOALS = ("size", "latency")
#: A layer counts as faster in a mode only when its call measured at least this share faster than
#: the float layer's (below that, timing noise on a shared machine decides).
LAYER_GAIN = 0.05
#: Statements tried on the whole model after the per-layer choice, for ``goal="latency"``: they change
#: no layer's bytes or rounding one layer at a time, so the knapsack has nothing to weigh them by; each
#: is kept only when the whole script measured with it is faster by :data:`LAYER_GAIN` and within the
#: budget.  (``cache`` acts across a denoiser's steps and tune times one forward: not searched.)
WHOLE_MODEL = ("fuse qkv", "compile")
#: The machine-readable line of a tuned script (read back by :func:`check`).
CERTIFICATE = re.compile(r"^#\s*tune:\s*(.*)$", re.M)


class OutOfTime(Exception):
    """The time budget ran out (internal: the tune returns what it measured, marked partial)."""


@dataclass
class Candidate:
    """A whole script: predicted by the per-layer pass, and measured end to end when ``measured``."""

    label: str
    chosen: dict[str, str]
    #: The predicted quality (from the summed per-layer amplitudes) and the predicted size ratio.
    predicted: float
    predicted_size: float
    text: str = ""
    #: Measured end to end (None: predicted only).
    qualities: dict[str, float] | None = None
    saved_bytes: int | None = None
    size_ratio: float | None = None
    latency: Latency | None = None
    passed: bool | None = None
    #: Whole-model statements after the per-layer ones (``fuse qkv``, ``compile``: :data:`WHOLE_MODEL`).
    statements: list[str] = field(default_factory=list)

    @property
    def measured(self) -> bool:
        return self.qualities is not None

    def summary(self) -> str:
        """``int4 g64 x20, int8 wo x6`` (layers per mode), or ``float`` when nothing changes."""
        counts: dict[str, int] = {}
        for mode in self.chosen.values():
            counts[mode] = counts.get(mode, 0) + 1
        layers = ", ".join(f"{mode} x{n}" for mode, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "float"
        return " + ".join([layers, *self.statements])


@dataclass
class TuneResult:
    """What :func:`tune` found: the script, what it measured, and how it searched."""

    #: The chosen script (comments with the measured figures included); ``""`` when nothing was found.
    script: str
    metric: str
    bound: float
    goal: str
    #: The chosen script's measured quality, saved size ratio and latency (None: not measured).
    value: float | None
    size_ratio: float | None
    latency: Latency | None
    #: Whether the chosen script was measured within the bound (False: an impossible budget, or a partial
    #: tune that verified nothing).
    passed: bool
    chosen: Candidate | None
    #: The whole scripts measured end to end, in the order measured.
    evaluated: list[Candidate]
    #: The knapsack's choices over a range of budgets (predicted), for the table and the plot.
    frontier: list[Candidate]
    #: Uniform scripts (one mode on every layer), predicted from the per-layer pass.
    uniform: list[Candidate]
    modes: list[str]
    pruned: list[tuple[str, str]]
    layers: int
    float_bytes: int
    inputs: str
    cpu: str
    study: str
    storage: str | None
    #: Units measured here and read back from the study.
    measured_units: list[str] = field(default_factory=list)
    reused_units: list[str] = field(default_factory=list)
    partial: bool = False
    reason: str = ""
    elapsed_s: float = 0.0

    @property
    def evaluations(self) -> int:
        """Whole-model evaluations after the per-layer pass."""
        return len(self.evaluated)

    def pareto(self) -> list[Candidate]:
        """The measured scripts no other measured one beats on both quality and the goal's figure,
        then the predicted ones likewise, each sorted by quality."""
        def figure(c: Candidate) -> float:
            if self.goal == "latency" and c.latency is not None:
                return c.latency.ratio
            return c.size_ratio if c.size_ratio is not None else c.predicted_size

        def value(c: Candidate) -> float:
            return c.qualities.get(self.metric, math.inf) if c.qualities else c.predicted

        def front(items: list[Candidate]) -> list[Candidate]:
            keep = [c for c in items if not any((value(o) <= value(c) and figure(o) < figure(c)) or
                                                (value(o) < value(c) and figure(o) <= figure(c)) for o in items)]
            return sorted(keep, key=value)

        return front(self.evaluated) + front([c for c in self.frontier + self.uniform
                                              if not any(c.chosen == e.chosen for e in self.evaluated)])

    def table(self) -> str:
        """The Pareto-optimal candidates as a text table (``*``: the chosen script)."""
        rows = [("", "measured", self.metric, "size x", "latency x", "script")]
        for c in self.pareto():
            value = c.qualities.get(self.metric) if c.qualities else c.predicted
            rows.append(("*" if c is self.chosen else "", "yes" if c.measured else "predicted", f"{value:.4g}",
                         f"{c.size_ratio if c.size_ratio is not None else c.predicted_size:.3f}",
                         c.latency.text() if c.latency else "-", f"{c.label}: {c.summary()}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5] for r in rows)

    def plot(self, path: str | Path) -> Path:
        """Write the plot (PNG): quality against the goal's figure, the chosen point marked."""
        from .report import plot

        return plot(self, Path(path))

    def __str__(self) -> str:
        lines = []
        if self.partial:
            lines.append(f"partial: {self.reason}")
        elif not self.passed:
            lines.append(self.reason)
        if self.chosen is not None:
            lines.append(f"chosen: {self.chosen.summary()}")
            if self.value is not None:
                lines.append(f"  {self.metric} {self.value:.4g} (bound {self.bound:g}) on {self.inputs}")
            if self.size_ratio is not None:
                lines.append(f"  saved size {self.size_ratio:.3f}x of the float model's {human_bytes(self.float_bytes)}")
            if self.latency is not None:
                lines.append(f"  latency {self.latency.text()} against the float model, this process")
        lines.append(f"search: {len(self.modes)} mode(s) x {self.layers} layer(s) measured one layer at a time "
                     f"({len(self.pruned)} pruned), then {self.evaluations} whole-model evaluation(s); "
                     f"{len(self.reused_units)} unit(s) read back from the study, {len(self.measured_units)} measured; "
                     f"{self.elapsed_s:.1f} s")
        return "\n".join(lines)


# --------------------------------------------------------------------------- helpers


def _budget(max_kl, max_rms, max_ppl_ratio) -> tuple[str, float]:
    given = [(name, value) for name, value in (("kl", max_kl), ("rms", max_rms), ("ppl_ratio", max_ppl_ratio))
             if value is not None]
    if len(given) != 1:
        raise TransformError("tune: give exactly one quality budget: max_kl=, max_rms= or max_ppl_ratio= "
                             f"(got {', '.join(n for n, _ in given) or 'none'})")
    name, value = given[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or \
            (name == "ppl_ratio" and value < 1):
        floor = "1" if name == "ppl_ratio" else "0"
        raise TransformError(f"tune: max_{name}={value!r}: a budget is a finite number >= {floor}")
    return name, float(value)


def _inverse(metric: str, amplitude: float) -> float:
    if metric == "rms":
        return math.sqrt(max(amplitude, 0.0))
    if metric == "ppl_ratio":
        return math.exp(amplitude)
    return amplitude


def _fingerprint(value: Any) -> str:
    digest = hashlib.sha256()

    def add(item):
        if isinstance(item, torch.Tensor):
            flat = item.detach().cpu().reshape(-1)
            if flat.numel() > 65536:
                flat = flat[:: max(1, flat.numel() // 65536)]
            digest.update(f"{item.dtype}{tuple(item.shape)}".encode())
            digest.update(flat.clone().contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(item, dict):
            for k in sorted(item):
                digest.update(str(k).encode())
                add(item[k])
        elif isinstance(item, (list, tuple)):
            for x in item:
                add(x)
        else:
            digest.update(repr(item).encode())

    add(value)
    return digest.hexdigest()[:20]


def _model_fingerprint(model: Any) -> str:
    from ..planner import module_components

    return _fingerprint({name: {"class": type(root).__name__, **root.state_dict()}
                         for name, root in module_components(model).items()})


def _takes_calibration() -> bool:
    from ..executor import transform

    return "calibration" in inspect.signature(transform).parameters


def _apply(model: Any, text: str, fit: list, calibrated: bool) -> Any:
    from ..executor import transform

    work = measure.copied(model)
    kwargs = {"calibration": fit} if calibrated and _takes_calibration() else {}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transform(work, text, **kwargs)


class _Clock:
    def __init__(self, budget_s: float | None):
        self.started = time.perf_counter()
        self.deadline = None if budget_s is None else self.started + budget_s

    def check(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise OutOfTime

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


# --------------------------------------------------------------------------- the tune


def tune(model: Any, *, max_kl: float | None = None, max_rms: float | None = None,
         max_ppl_ratio: float | None = None, goal: str = "size", calibration: Any = None, heldout: Any = None,
         modes: list[str] | None = None, budget_s: float | None = None, storage: str | None = None,
         study: str | None = None, evaluations: int = 5, rounds: int = 5, progress: bool = False,
         statements: list[str] | tuple[str, ...] | None = None, log=None) -> TuneResult:
    """Find the script whose output stays within the quality budget (exactly one of ``max_kl``,
    ``max_rms``, ``max_ppl_ratio``) with the smallest save (``goal="size"``) or the lowest latency on
    this machine (``goal="latency"``); the model is not changed.

    ``calibration``: an iterable of model inputs (a tensor for the first positional argument, or a
    dict of forward arguments): the last quarter is held out to measure quality on, the rest is what
    calibrated methods fit on.  ``heldout``: the inputs to measure on instead.  Without either, the
    model's own sample inputs are used (random inputs: said so in the result and the script).
    ``modes``: the statements to try (default: every mode the registry declares, :mod:`.candidates`).
    ``budget_s``: a time limit; when it runs out, the best found so far is returned, ``partial``.
    ``storage``: where the study is kept (a SQLite path or a database URL; None: in memory), so that
    a tune run again resumes without measuring again, and several workers can share it; ``study``:
    its name (default: one derived from the model, the inputs and the modes).  ``evaluations``: the
    most whole scripts measured end to end after the per-layer pass.  ``rounds``: latency rounds.
    ``statements``: with ``goal="latency"``, the whole-model statements tried on the chosen script
    within the same ``evaluations`` (default :data:`WHOLE_MODEL`: ``fuse qkv``, ``compile``; ``()``: none),
    each kept only when measured faster within the budget.
    Ctrl-C stops the search: what was measured is kept in the study and the result is ``partial``.

    Raises :class:`TransformError` for a wrong budget, or a model no mode applies to.
    """
    from ..planner import module_components, plan

    metric, bound = _budget(max_kl, max_rms, max_ppl_ratio)
    if goal not in GOALS:
        raise TransformError(f"tune: goal={goal!r}: one of {', '.join(GOALS)}")
    if not isinstance(evaluations, int) or evaluations < 1:
        raise TransformError(f"tune: evaluations={evaluations!r}: at least 1")
    clock = _Clock(budget_s)
    say = log or (lambda line: None)

    fit, held, where = measure.split_calibration(calibration, heldout)
    if not held:
        try:
            held = measure.sample_inputs(model, 2)
        except Exception as exc:
            raise TransformError(f"tune: no calibration data was given and the model has no sample inputs "
                                 f"({type(exc).__name__}: {exc}); pass calibration=[...]") from None
        where = "the model's own sample inputs (random: no calibration data was given)"
    where = f"{where}: {measure.describe_samples(held)}"
    reference = Reference.of(model, held)
    if metric not in reference.metrics():
        need = "logits" if metric == "kl" else "logits on token ids (input_ids)"
        raise TransformError(f"tune: max_{metric} needs the model's output to be {need}; use max_rms")

    pruned: list[tuple[str, str]] = []
    candidates = parse_modes(modes) if modes is not None else declared_modes(pruned=pruned)
    usable: list[Mode] = []
    universes: dict[str, list[str]] = {}
    component = None
    for mode in candidates:
        if mode.calibrated and not fit:
            pruned.append((mode.text, "it calibrates, and no calibration data is left after the held-out part"))
            continue
        try:
            the_plan = plan(model, mode.text, calibration=mode.calibrated)
        except (ScriptError, TransformError) as exc:
            pruned.append((mode.text, str(exc).splitlines()[0]))
            continue
        step = the_plan.steps[0]
        if not step.targets:
            pruned.append((mode.text, "it changes nothing on this model"))
            continue
        if component is not None and step.component != component:
            pruned.append((mode.text, f"it works on component {step.component!r}, not {component!r}"))
            continue
        component = step.component
        usable.append(mode)
        universes[mode.text] = list(step.targets)
    if not usable:
        reasons = "; ".join(f"{t}: {r}" for t, r in pruned[:6]) or "no mode was given"
        raise TransformError(f"tune: no mode applies to this model ({reasons})")
    root = module_components(model)[component]

    name = study or study_name(STUDY_VERSION, _model_fingerprint(model), _fingerprint(held), _fingerprint(fit))
    store = Study(storage, name)
    float_bytes = store.run("float", lambda: {"saved": measure.saved_bytes(model)}, lambda r: r["saved"])["saved"]

    # ---------------------------------------------------------------- per-layer pass
    per_layer: dict[str, dict[str, dict]] = {}
    partial, reason = False, ""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(usable), desc="tune: per-layer pass", unit="mode", leave=False)
    try:
        for mode in usable:
            clock.check()

            def layers_of(mode=mode):
                work = _apply(model, mode.text, fit, mode.calibrated)
                new_root = module_components(work)[component]
                found = {}
                for path in universes[mode.text]:
                    clock.check()
                    original, changed = root.get_submodule(path), new_root.get_submodule(path)
                    measure.set_module(root, path, changed)
                    try:
                        qualities = reference.qualities(model)
                    finally:
                        measure.set_module(root, path, original)
                    found[path] = {**qualities, "bytes_before": measure.state_bytes(original),
                                   "bytes_after": measure.state_bytes(changed)}
                return found

            per_layer[mode.text] = store.run(f"layers|{mode.text}", layers_of, lambda r: len(r))
            if goal == "latency":
                def seconds_of(mode=mode):
                    work = _apply(model, mode.text, fit, mode.calibrated)
                    new_root = module_components(work)[component]
                    inputs = measure.layer_inputs(model, universes[mode.text], held[0])
                    out = {}
                    for path, x in inputs.items():
                        clock.check()
                        original, changed = root.get_submodule(path), new_root.get_submodule(path)
                        repeat = max(3, min(200, int(0.002 / max(measure.layer_seconds(original, x, 1), 1e-7))))
                        before = min(measure.layer_seconds(original, x, repeat) for _ in range(3))
                        after = min(measure.layer_seconds(changed, x, repeat) for _ in range(3))
                        out[path] = {"before": before, "after": after}
                    return out

                for path, seconds in store.run(f"seconds|{mode.text}", seconds_of, lambda r: len(r)).items():
                    per_layer[mode.text][path].update(seconds_before=seconds["before"], seconds_after=seconds["after"])
            if bar is not None:
                bar.update(1)
    except OutOfTime:
        partial, reason = True, f"the time budget ({budget_s:g} s) ran out during the per-layer pass"
    except KeyboardInterrupt:
        partial, reason = True, "interrupted (Ctrl-C) during the per-layer pass; what was measured is kept"
    finally:
        if bar is not None:
            bar.close()
    measured_modes = [m for m in usable if m.text in per_layer and
                      (goal == "size" or all("seconds_before" in v for v in per_layer[m.text].values()))]
    by_text = {m.text: m for m in measured_modes}

    # ---------------------------------------------------------------- the knapsack's table
    capacity = measure.amplitude(metric, bound)
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for text in by_text:
        for path, figures in per_layer[text].items():
            if goal == "size":
                cost = figures["bytes_after"] - figures["bytes_before"]
            else:  # faster only when measured clearly faster (timing noise is not a gain)
                before, after = figures["seconds_before"], figures["seconds_after"]
                cost = after - before if after < (1 - LAYER_GAIN) * before else max(after - before, 0.0) + 1e-9
            table.setdefault(path, {})[text] = (float(cost), measure.amplitude(metric, figures.get(metric, math.inf)))
    def predicted_size(chosen: dict[str, str]) -> float:
        saved = sum(per_layer[m][p]["bytes_after"] - per_layer[m][p]["bytes_before"] for p, m in chosen.items())
        return (float_bytes + saved) / float_bytes

    def candidate(label: str, chosen: dict[str, str]) -> Candidate:
        weight = sum(table[p][m][1] for p, m in chosen.items())
        return Candidate(label, dict(chosen), _inverse(metric, weight), predicted_size(chosen))

    uniform = [candidate(f"uniform {text}", search.uniform(table, text)[0]) for text in by_text]
    grid = [capacity * 2 ** (k / 2) for k in range(-8, 7)] if capacity > 0 else [0.0]
    frontier = [candidate(f"knapsack at {metric} {_inverse(metric, cap):.3g}", chosen)
                for cap, chosen, _, _ in search.frontier(table, grid)]

    # ---------------------------------------------------------------- verification
    evaluated: list[Candidate] = []
    calibrated_texts = {m.text for m in measured_modes if m.calibrated}

    def evaluate(found: Candidate) -> Candidate:
        text = script_writer.write(model, found.chosen, universes, []) + "".join(f"{s}\n" for s in found.statements)
        found.text = text
        uses_data = any(m in calibrated_texts for m in found.chosen.values())

        def whole():
            work = _apply(model, text, fit, uses_data)
            return {"qualities": reference.qualities(work), "saved": measure.saved_bytes(work),
                    "latency": list(vars(measure.paired_latency(model, work, held, rounds)).values())}

        key = "script|" + hashlib.sha256(text.encode()).hexdigest()[:24]
        result = store.run(key, whole, lambda r: r["qualities"].get(metric, math.inf))
        found.qualities = result["qualities"]
        found.saved_bytes = result["saved"]
        found.size_ratio = result["saved"] / float_bytes
        found.latency = Latency(*result["latency"])
        found.passed = found.qualities.get(metric, math.inf) <= bound
        evaluated.append(found)
        say(f"tune: measured {found.summary()}: {metric} {found.qualities.get(metric, math.inf):.4g}, "
            f"size {found.size_ratio:.3f}x, latency {found.latency.text()}")
        return found

    def figure(c: Candidate) -> float:
        return c.latency.ratio if goal == "latency" else c.size_ratio

    scale, tried = 1.0, set()
    try:
        if not partial:
            for _ in range(evaluations):
                clock.check()
                chosen, _, weight = search.choose(table, capacity * scale)
                key = tuple(sorted(chosen.items()))
                if key in tried or not chosen:
                    break
                tried.add(key)
                found = evaluate(candidate(f"knapsack at {metric} {_inverse(metric, capacity * scale):.3g}", chosen))
                measured_amp = measure.amplitude(metric, found.qualities.get(metric, math.inf))
                if not math.isfinite(measured_amp):
                    scale *= 0.5
                    continue
                # measured ~ ratio x predicted: the next capacity is the one whose prediction, so
                # corrected, meets the bound (with 2% to spare)
                following = (weight / measured_amp) * 0.98 if measured_amp > 0 and weight > 0 else scale * 2
                if found.passed:
                    if following <= scale * 1.02:
                        break
                    scale = min(following, scale * 4)
                else:
                    scale = min(following, scale * 0.9)
    except OutOfTime:
        partial, reason = True, f"the time budget ({budget_s:g} s) ran out during the whole-model evaluations"
    except KeyboardInterrupt:
        partial, reason = True, "interrupted (Ctrl-C) during the whole-model evaluations; what was measured is kept"

    def float_model() -> Candidate:
        return Candidate("the float model", {}, 0.0, 1.0, qualities={metric: 0.0}, saved_bytes=float_bytes,
                         size_ratio=1.0, passed=True)

    nothing_faster = (goal == "latency" and not partial and not evaluated and table
                      and not search.choose(table, capacity)[0])
    passing = [c for c in evaluated if c.passed]
    chosen_candidate: Candidate | None = min(passing, key=lambda c: (figure(c), c.qualities[metric])) \
        if passing else None
    passed = chosen_candidate is not None
    if chosen_candidate is None:
        if evaluated:
            chosen_candidate = min(evaluated, key=lambda c: c.qualities.get(metric, math.inf))
            reason = reason or (f"no script met {metric} <= {bound:g}: the best reached was "
                                f"{chosen_candidate.qualities.get(metric, math.inf):.4g}, by {chosen_candidate.summary()}")
        elif nothing_faster:
            chosen_candidate = float_model()
            passed = True
            reason = (f"no mode made a layer at least {LAYER_GAIN:.0%} faster than the float layer on this machine: "
                      f"within {metric} <= {bound:g} the fastest model is the float model (no statement)")
        elif table and not partial:
            least = min(((t, p, w) for p, options in table.items() for t, (_, w) in options.items()),
                        key=lambda x: x[2])
            reason = (f"no layer can change within {metric} <= {bound:g}: the least sensitive change measured, "
                      f"{least[0]} on {least[1]} alone, gives {metric} {_inverse(metric, least[2]):.4g}")
        elif table:
            chosen, _, _ = search.choose(table, capacity)
            if chosen:
                chosen_candidate = candidate("knapsack (not verified)", chosen)
                chosen_candidate.text = script_writer.write(model, chosen, universes, [])
    if goal == "latency" and passed and chosen_candidate.latency is not None and chosen_candidate.latency.ratio >= 1.0:
        # the float model is then the pick (no statement), not the slower script measured
        reason = (f"no script measured was faster than the float model on this machine (the best: "
                  f"{chosen_candidate.summary()}, {chosen_candidate.latency.text()}): within {metric} <= {bound:g} "
                  f"the fastest model is the float model (no statement)")
        chosen_candidate = float_model()

    if goal == "latency" and passed and not partial and chosen_candidate is not None:
        try:
            chosen_candidate = _whole_model(model, chosen_candidate, WHOLE_MODEL if statements is None else statements,
                                            evaluate, evaluated, evaluations, pruned, clock, say)
            if chosen_candidate.statements and not chosen_candidate.chosen:
                reason = (f"within {metric} <= {bound:g} the fastest model measured is the float model with "
                          f"{' and '.join(chosen_candidate.statements)} ({chosen_candidate.latency.text()}): no "
                          f"layer's mode made it {LAYER_GAIN:.0%} faster")
        except OutOfTime:
            partial, reason = True, f"the time budget ({budget_s:g} s) ran out while trying whole-model statements"
        except KeyboardInterrupt:
            partial, reason = True, "interrupted (Ctrl-C) while trying whole-model statements; what was measured is kept"

    cpu = measure.cpu_name()
    result = TuneResult("", metric, bound, goal,
                        chosen_candidate.qualities.get(metric) if chosen_candidate and chosen_candidate.qualities
                        else None,
                        chosen_candidate.size_ratio if chosen_candidate else None,
                        chosen_candidate.latency if chosen_candidate else None,
                        passed, chosen_candidate, evaluated, frontier, uniform,
                        [m.text for m in measured_modes], pruned, len(table), float_bytes, where, cpu, name,
                        store.storage, list(store.measured), list(store.reused), partial, reason, clock.elapsed())
    if chosen_candidate is not None:
        result.script = _annotated(model, result, chosen_candidate, universes, per_layer, capacity)
    return result


def _whole_model(model: Any, base: Candidate, statements, evaluate, evaluated: list[Candidate], evaluations: int,
                 pruned: list[tuple[str, str]], clock: _Clock, say) -> Candidate:
    """``base`` with each of ``statements`` added in turn where the planner takes it, it changes something
    and the whole script measured with it is within the budget and :data:`LAYER_GAIN` faster; each
    measured one is a whole-model evaluation of the same ``evaluations``."""
    from ..planner import plan

    for statement in statements:
        if len(evaluated) >= evaluations:
            pruned.append((statement, f"no whole-model evaluation left of {evaluations} (evaluations=)"))
            continue
        tried = [*base.statements, statement]
        text = base.text + f"{statement}\n"  # planned with the per-layer statements: they may not combine
        line = text.count("\n")
        try:
            steps = plan(model, text, calibration=True).steps
        except (ScriptError, TransformError) as exc:
            pruned.append((statement, str(exc).splitlines()[0]))
            continue
        if not any(step.targets for step in steps if step.statement.span and step.statement.span.line == line):
            pruned.append((statement, "it changes nothing on this model"))
            continue
        clock.check()
        found = evaluate(Candidate(f"{base.label} + {statement}", dict(base.chosen), base.predicted,
                                   base.predicted_size, statements=tried))
        before = base.latency.ratio if base.latency is not None else 1.0
        if found.passed and found.latency.ratio < (1 - LAYER_GAIN) * before:
            base = found
        else:
            say(f"tune: {statement} not kept ({'outside the budget' if not found.passed else 'not faster'})")
    if base.statements and base.chosen and len(evaluated) < evaluations:
        # The per-layer modes were chosen on the float forward; under the whole-model statements (a
        # compiled graph) their gain may vanish: the statements alone are measured too, and the layers'
        # modes kept only if they still make the model LAYER_GAIN faster.
        clock.check()
        try:
            alone = evaluate(Candidate(f"the float model + {' + '.join(base.statements)}", {}, 0.0, 1.0,
                                       statements=list(base.statements)))
        except (ScriptError, TransformError) as exc:
            say(f"tune: {' + '.join(base.statements)} alone did not apply ({str(exc).splitlines()[0]})")
            return base
        if alone.passed and base.latency.ratio >= (1 - LAYER_GAIN) * alone.latency.ratio:
            say(f"tune: the per-layer modes not kept: {alone.summary()} measured {alone.latency.text()}, "
                f"with them {base.latency.text()}")
            base = alone
    return base


def _annotated(model: Any, result: TuneResult, chosen: Candidate, universes, per_layer, capacity: float) -> str:
    """The chosen script with its certificate: what was measured, on what, against which bound."""
    from ..version import __version__

    metric = result.metric
    head = [f"transformdsl tune: goal {result.goal}, {metric} <= {result.bound:g}, on {result.inputs}"]
    if chosen.measured:
        value = chosen.qualities.get(metric, math.inf)
        latency = f"latency {chosen.latency.text()} against the float model" if chosen.latency else \
            "no statement: the float model itself"
        head.append(f"measured: {metric} {value:.4g} (bound {result.bound:g}), saved size {chosen.size_ratio:.3f}x "
                    f"({human_bytes(result.float_bytes)} -> {human_bytes(chosen.saved_bytes)}), {latency}")
    else:
        head.append(f"NOT VERIFIED ({result.reason}): predicted {metric} {chosen.predicted:.4g}, size "
                    f"{chosen.predicted_size:.3f}x")
    head.append(f"on {result.cpu}; torch {torch.__version__}, transformdsl {__version__}")
    head.append(f"search: {len(result.modes)} mode(s) x {result.layers} layer(s) one layer at a time, "
                f"{result.evaluations} whole-model evaluation(s); study {result.study}")
    if result.partial:
        head.append(f"PARTIAL: {result.reason}")
    elif not result.passed:
        head.append(f"BUDGET NOT MET: {result.reason}")
    figures = [f"metric={metric}", f"bound={result.bound:g}", f"goal={result.goal}"]
    if chosen.measured:
        figures += [f"size={chosen.size_ratio:.4f}"] + ([f"latency={chosen.latency.ratio:.3f}"] if chosen.latency else [])
    head.append("tune: " + " ".join(figures))
    notes = {}
    for mode in set(chosen.chosen.values()):
        paths = [p for p, m in chosen.chosen.items() if m == mode]
        amp = sum(measure.amplitude(metric, per_layer[mode][p].get(metric, math.inf)) for p in paths)
        saved = sum(per_layer[mode][p]["bytes_before"] - per_layer[mode][p]["bytes_after"] for p in paths)
        notes[mode] = (f"{len(paths)} layer(s), saving {human_bytes(saved)}; their {metric} one layer at a time "
                       f"adds up to {_inverse(metric, amp):.3g}")
    text = script_writer.write(model, chosen.chosen, universes, head, notes)
    for statement in chosen.statements:
        text += f"# {statement}: kept, the whole script measured {LAYER_GAIN:.0%} or more faster with it\n{statement}\n"
    return text


# --------------------------------------------------------------------------- re-measuring a script


@dataclass
class CheckResult:
    """What :func:`check` re-measured, and whether the script's budget still holds."""

    passed: bool
    lines: list[str]

    def __str__(self) -> str:
        return "\n".join(self.lines)


def certificate(text: str) -> dict[str, str]:
    """The ``# tune: metric=kl bound=0.05 goal=size size=0.31 latency=1.8`` line of a tuned script."""
    found = CERTIFICATE.findall(text)
    return dict(part.split("=", 1) for part in found[-1].split() if "=" in part) if found else {}


#: How much slower than recorded a ``goal latency`` script may run before :func:`check` fails it
#: (timings on a shared machine move by 10-20% between runs).
LATENCY_SLACK = 1.25


def check(model: Any, script: str | Path, *, max_kl: float | None = None, max_rms: float | None = None,
          max_ppl_ratio: float | None = None, calibration: Any = None, heldout: Any = None,
          rounds: int = 5) -> CheckResult:
    """Re-measure a tuned script on ``model`` against its budget (the ``# tune:`` line, or the bound
    given): the quality on the held-out inputs must stay within the bound, the saved size must not
    exceed the recorded one (+1%), and a ``goal latency`` script must not run more than
    :data:`LATENCY_SLACK` times slower than recorded.  The model is not changed."""
    text = Path(script).read_text() if isinstance(script, Path) or (
        isinstance(script, str) and "\n" not in script and Path(script).is_file()) else str(script)
    recorded = certificate(text)
    if max_kl is None and max_rms is None and max_ppl_ratio is None:
        if recorded.get("metric") not in QUALITIES or "bound" not in recorded:
            raise TransformError("tune --check: the script has no '# tune:' line naming its budget; give one "
                                 "(--max-kl, --max-rms or --max-ppl-ratio)")
        metric, bound = recorded["metric"], float(recorded["bound"])
    else:
        metric, bound = _budget(max_kl, max_rms, max_ppl_ratio)
    fit, held, where = measure.split_calibration(calibration, heldout)
    if not held:
        held = measure.sample_inputs(model, 2)
        where = "the model's own sample inputs (random)"
    reference = Reference.of(model, held)
    uses_data = calibrated_script(text)
    work = _apply(model, text, fit, uses_data)
    value = reference.qualities(work).get(metric, math.inf)
    float_bytes, saved = measure.saved_bytes(model), measure.saved_bytes(work)
    latency = measure.paired_latency(model, work, held, rounds)
    lines, passed = [], True
    ok = value <= bound
    passed &= ok
    lines.append(f"{'ok' if ok else 'FAILED'}: {metric} {value:.4g} {'<=' if ok else '>'} {bound:g} on {where}")
    ratio = saved / float_bytes
    if "size" in recorded:
        ok = ratio <= float(recorded["size"]) * 1.01
        passed &= ok
        lines.append(f"{'ok' if ok else 'FAILED'}: saved size {ratio:.4f}x (recorded {float(recorded['size']):.4f}x)")
    else:
        lines.append(f"saved size {ratio:.4f}x")
    if recorded.get("goal") == "latency" and "latency" in recorded:
        ok = latency.ratio <= float(recorded["latency"]) * LATENCY_SLACK
        passed &= ok
        lines.append(f"{'ok' if ok else 'FAILED'}: latency {latency.text()} (recorded {float(recorded['latency']):.3f}x, "
                     f"slack {LATENCY_SLACK}x)")
    else:
        lines.append(f"latency {latency.text()}")
    lines.append(f"on {measure.cpu_name()}")
    return CheckResult(passed, lines)
