"""The tune's plot: quality against the goal's figure, the chosen script marked (PNG, matplotlib).

matplotlib is imported here only, when a plot is asked for (``import transformdsl`` never imports it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: ``tune.api``'s result and candidate types (not imported: the api imports this module).
TuneResult = Candidate = Any


def _value(result: TuneResult, c: Candidate) -> float:
    return c.qualities.get(result.metric, math.inf) if c.qualities else c.predicted


def _figure(result: TuneResult, c: Candidate) -> float | None:
    if result.goal == "latency":
        return c.latency.ratio if c.latency else None
    return c.size_ratio if c.size_ratio is not None else c.predicted_size


def plot(result: TuneResult, path: Path) -> Path:
    """Write ``path`` (PNG): the knapsack's predicted frontier (line), the uniform scripts (predicted,
    grey), the scripts measured end to end (dots), the bound (dashed) and the chosen script (star)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
    xlabel = "latency / float model (measured)" if result.goal == "latency" else "saved size / float model"
    if result.goal == "size":
        line = sorted((_figure(result, c), _value(result, c)) for c in result.frontier)
        if line:
            axes.plot([x for x, _ in line], [y for _, y in line], "-", color="tab:blue", alpha=0.6,
                      label="per-layer choice (predicted)")
        for index, c in enumerate(result.uniform):
            axes.scatter(_figure(result, c), _value(result, c), color="grey", marker="s", s=18,
                         label="uniform script (predicted)" if index == 0 else None)
            axes.annotate(c.label.replace("uniform ", ""), (_figure(result, c), _value(result, c)), fontsize=6,
                          color="grey", xytext=(3, 2), textcoords="offset points")
    measured = [(c, _figure(result, c)) for c in result.evaluated if _figure(result, c) is not None]
    if measured:
        axes.scatter([x for _, x in measured], [_value(result, c) for c, _ in measured], color="tab:orange",
                     zorder=3, label="whole script (measured)")
    chosen = result.chosen
    if chosen is not None and _figure(result, chosen) is not None:
        axes.scatter([_figure(result, chosen)], [_value(result, chosen)], marker="*", s=220, color="tab:red",
                     zorder=4, label="chosen")
    axes.axhline(result.bound, linestyle="--", color="tab:red", linewidth=1, label=f"bound {result.bound:g}")
    axes.set_xlabel(xlabel)
    axes.set_ylabel(f"{result.metric} on held-out inputs")
    if result.metric == "kl":
        values = [v for v in [_value(result, c) for c in result.frontier + result.evaluated + result.uniform]
                  if v > 0 and math.isfinite(v)]
        if values and max(values) / min(values) > 50:
            axes.set_yscale("log")
    axes.set_title(f"transformdsl tune: goal {result.goal}, {result.metric} <= {result.bound:g}", fontsize=10)
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
