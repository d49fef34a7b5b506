"""Calibration: data for the methods that learn from it, and the block-by-block pass that fits them.

- :mod:`.data`: :class:`~.data.CalibrationData` from ``transform(..., calibration=DATA)`` or a
  script's ``calibrate "PATH"`` statement, checked against the model before anything runs;
- :mod:`.sequential`: the pass over the model one block at a time (each block fitted on the
  outputs of the blocks before it, already quantized);
- :mod:`.gptq`, :mod:`.scales` (AWQ's and SmoothQuant's per-channel scales): the numerics;
- :mod:`.record`: :func:`record_inputs`, a diffusers pipeline's denoiser inputs written to a
  safetensors file while the pipeline runs (what ``calibrate "FILE.safetensors"`` reads).

:func:`for_run` is what :func:`transformdsl.transform` and :func:`transformdsl.convert` call: the
data a plan's statements need, or ``None`` when none does.
"""

from __future__ import annotations

from typing import Any

from ..errors import TransformError

__all__ = ["for_run", "needs_data", "missing_data_message", "record_inputs"]


def needs_data(steps) -> list:
    """The transforms of ``steps`` (declarations) that learn from calibration data."""
    return [t for t in steps if getattr(t, "needs_calibration", False)]


def missing_data_message(transform) -> str:
    what = next((f"{o.name}={o.value.text if hasattr(o.value, 'text') else o.value}"
                 for o in transform.statement.options if o.name in ("method", "smooth")), "its method")
    return (f"'{transform.key()}' with {what} learns from calibration data, and none is given: add a line "
            "calibrate \"calibration.txt\" samples=128 seqlen=512 (text, or a safetensors file of inputs) to the "
            "script, or pass calibration=[inputs, ...] to transform()/convert()")


def for_run(the_plan, components: dict, calibration: Any = None, tokenizer: Any = None):
    """The :class:`~.data.CalibrationData` of a run of ``the_plan`` on the model whose modules by
    component are ``components`` (``planner.module_components``), or ``None``.

    ``calibration`` (the API's) or the script's ``calibrate`` statement, read and checked against
    the component the methods run on; both at once is an error naming the statement."""
    statements = [step for step in the_plan.steps if step.transform.verb == "calibrate"]
    users = [step for step in the_plan.steps if getattr(step.transform, "needs_calibration", False)]
    if calibration is None and not statements:
        if users:
            raise TransformError(missing_data_message(users[0].transform) + "; nothing was changed")
        return None
    if not users and not statements:
        import warnings

        warnings.warn("calibration= is given, but no statement of the script learns from data (method=gptq, "
                      "method=awq, smooth=...): it is not used", UserWarning, stacklevel=3)
        return None
    from . import data as calibration_data

    component = components[(users or statements)[0].component]
    if calibration is not None and statements:
        raise TransformError(f"line {statements[0].statement.line}: a calibrate statement and calibration= both give "
                             "calibration data: drop one (nothing was changed)")
    if calibration is not None:
        result = calibration_data.from_api(calibration, component)
    else:
        step = statements[0]
        options = step.transform.options
        result = calibration_data.from_path(step.statement.argument.text, options.samples, options.seqlen,
                                            component, tokenizer, options.seed)
        result.activations = options.activations
    result.samples = [_with_defaults(component, s) for s in result.samples]
    result.check_for(component)
    return result


def _with_defaults(model, sample):
    """A transformers model runs without its KV cache while calibrating (nothing reads it)."""
    import inspect

    args, kwargs = sample
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if takes and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


def record_inputs(*args, **kwargs):
    """See :func:`transformdsl.calibration.record.record_inputs`."""
    from .record import record_inputs as record

    return record(*args, **kwargs)
