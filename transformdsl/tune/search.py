"""The per-layer choice: a multiple-choice knapsack over the measured layers.

Each layer may stay as it is or take one of the modes measured on it; a choice has a *cost* (the
bytes it adds to the save, negative when it saves some; or the seconds it adds to the layer's call)
and a *weight* (its quality amplitude: :func:`transformdsl.tune.measure.amplitude` of the metric
with that layer alone changed).  :func:`choose` minimises the summed cost with the summed weight
within the capacity (the budget's amplitude), by dynamic programming over the capacity cut into
``bins`` steps (a weight is rounded up: the sum is never understated).

>>> layers = {"a": {"int4": (-30.0, 0.5), "int8": (-20.0, 0.1)}, "b": {"int4": (-30.0, 0.1)}}
>>> chosen, cost, weight = choose(layers, capacity=0.3)
>>> chosen, cost
({'a': 'int8', 'b': 'int4'}, -50.0)
>>> choose(layers, capacity=1.0)[0]
{'a': 'int4', 'b': 'int4'}
"""

from __future__ import annotations

import math

import numpy as np

#: Steps the capacity is cut into.
BINS = 512


def choose(layers: dict[str, dict[str, tuple[float, float]]], capacity: float, bins: int = BINS,
           allowed: set[str] | None = None) -> tuple[dict[str, str], float, float]:
    """``(chosen, cost, weight)``: the mode of each layer that changes (layers left as they are are
    absent), the summed cost and the summed (unrounded) weight.  ``layers``: path -> mode -> (cost,
    weight); ``allowed``: the modes that may be used (default: all)."""
    names = list(layers)
    if capacity <= 0 or not math.isfinite(capacity):
        capacity = 0.0
    best = np.zeros(bins + 1)  # best[b]: least cost with the rounded weights summing to at most b
    picks = []
    for name in names:
        options = [(mode, cost, weight) for mode, (cost, weight) in sorted(layers[name].items())
                   if (allowed is None or mode in allowed) and math.isfinite(weight) and math.isfinite(cost)]
        new = best.copy()  # leaving the layer as it is: no cost, no weight
        pick = np.full(bins + 1, -1, dtype=np.int64)
        for index, (_, cost, weight) in enumerate(options):
            steps = 0 if weight <= 0 else (bins + 1 if capacity == 0 else math.ceil(weight / capacity * bins - 1e-9))
            if steps > bins:
                continue
            shifted = np.full(bins + 1, np.inf)
            shifted[steps:] = best[: bins + 1 - steps] + cost
            better = shifted < new - 1e-12
            new = np.where(better, shifted, new)
            pick = np.where(better, index, pick)
        picks.append((name, options, pick, _steps_of(options, capacity, bins)))
        best = new
    chosen: dict[str, str] = {}
    remaining, cost, weight = bins, 0.0, 0.0
    for name, options, pick, steps in reversed(picks):
        index = int(pick[remaining])
        if index >= 0:
            mode, c, w = options[index]
            chosen[name] = mode
            cost, weight = cost + c, weight + w
            remaining -= steps[index]
    return {n: chosen[n] for n in names if n in chosen}, cost, weight


def _steps_of(options, capacity: float, bins: int) -> list[int]:
    return [0 if w <= 0 else (bins + 1 if capacity == 0 else math.ceil(w / capacity * bins - 1e-9))
            for _, _, w in options]


def uniform(layers: dict[str, dict[str, tuple[float, float]]], mode: str) -> tuple[dict[str, str], float, float]:
    """Every layer that was measured in ``mode`` takes it: ``(chosen, cost, weight)``."""
    chosen = {n: mode for n, options in layers.items() if mode in options}
    return chosen, sum(layers[n][mode][0] for n in chosen), sum(layers[n][mode][1] for n in chosen)


def frontier(layers: dict[str, dict[str, tuple[float, float]]], capacities: list[float]) -> list[tuple]:
    """The knapsack's choice at each capacity: ``[(capacity, chosen, cost, weight)]``, duplicates dropped."""
    seen, out = set(), []
    for capacity in capacities:
        chosen, cost, weight = choose(layers, capacity)
        key = tuple(sorted(chosen.items()))
        if key not in seen:
            seen.add(key)
            out.append((capacity, chosen, cost, weight))
    return out
