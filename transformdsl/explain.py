"""Human-readable rendering of a :class:`~transformdsl.planner.Plan` (``transformdsl explain``)."""

from __future__ import annotations

from .units import human_bytes  # noqa: F401  (importable from here, as before it had its module)

SAMPLE = 4


def render_plan(plan) -> str:
    """``plan`` (a :class:`transformdsl.planner.Plan`, whose ``__str__`` calls this: hence no import of it
    here) as the text ``transformdsl explain`` prints."""
    source = plan.script.source
    lines = []
    what = plan.model_name
    if len(plan.components) > 1 or "" not in plan.components:
        parts = ", ".join(f"{k}={v}" for k, v in plan.components.items())
        what += f" ({parts})"
    from .dtypes import describe

    dtype = describe(plan.dtypes)
    lines.append(f"model: {what}: {plan.module_count} modules, {human_bytes(plan.total_bytes)} of parameters"
                 + (f" in {dtype}" if dtype else ""))
    if plan.skeletons:
        which = "" if plan.skeletons == [""] else f" ({', '.join(plan.skeletons)})"
        lines.append(f"weights{which}: on the meta device, none loaded: planned as they will be once loaded "
                     "(transform needs them loaded)")
    if not plan.steps:
        lines.append("plan: nothing to do")
        return "\n".join(lines)
    lines.append(f"plan: {len(plan.steps)} statement(s), in execution order")
    for index, step in enumerate(plan.steps, 1):
        where = f" [{step.component}]" if step.component else ""
        lines.append("")
        lines.append(f"{index}. line {step.statement.line}: {step.text(source)}{where}")
        lines.append(f"   {step.transform.summary}")
        count = len(step.targets)
        lines.append(f"   matched {count} module(s), {human_bytes(step.bytes)} of parameters")
        for path in step.targets[:SAMPLE]:
            lines.append(f"     {path or '<root>'}")
        if count > SAMPLE:
            lines.append(f"     ... and {count - SAMPLE} more")
        if step.excluded:
            parts = ", ".join(f"{n} by {label}" for label, n in step.excluded.items())
            lines.append(f"   excluded: {parts}")
        if step.skipped:
            lines.append(f"   not transformed ({len(step.skipped)}):")
            reasons: dict[str, list[str]] = {}
            for path, reason in step.skipped:
                reasons.setdefault(reason, []).append(path)
            for reason, paths in reasons.items():
                shown = ", ".join(p or "<root>" for p in paths[:2]) + (f" (+{len(paths) - 2})" if len(paths) > 2 else "")
                lines.append(f"     {shown}: {reason}")
        for note in step.notes:
            lines.append(f"   note: {note}")
        if step.device_note:
            lines.append(f"   device: {step.device_note}")
    return "\n".join(lines)


def render_options(validated) -> str:
    """Each statement of ``validated`` (a :class:`transformdsl.validate.ValidatedScript`, in execution
    order) with every option it takes: the value it runs with, the default, the type and range, and what
    the option does (``transformdsl explain --options``; the declarations only, no model)."""
    import dataclasses

    from .formatter import format_value
    from .options import CommonOptions, describe_fields

    lines = []
    for transform in sorted(validated.steps, key=lambda t: t.statement.line):
        statement = transform.statement
        summary = f": {transform.summary}" if transform.summary else ""
        lines.append(f"line {statement.line}: {transform.key()}{summary}")
        if not dataclasses.fields(transform.Options):
            lines.append("  (no options of its own)")
        for cls, values, label in ((transform.Options, transform.options, ""),
                                   (CommonOptions, transform.common, " (common option)")):
            for row in describe_fields(cls):
                value = getattr(values, row["name"], row["default"])
                about = [row["type"], f"default: {format_value(row['default'])}"]
                if row["choices"]:
                    about.append("one of " + ", ".join(format_value(c) for c in row["choices"]))
                if row["min"] is not None:
                    about.append(f">= {row['min']}")
                if row["max"] is not None:
                    about.append(f"<= {row['max']}")
                lines.append(f"  {row['name']}={format_value(value)}{label}: {row['doc']} ({'; '.join(about)})")
    return "\n".join(lines) if lines else "no statement"
