"""A per-layer choice as a script a person reads: a few statements, layers grouped under selectors.

Each mode is one statement (the mode most layers take first), written ``except`` the layers of its
candidates that do not take it or ``in`` those that do, whichever needs fewer selectors.  A group of layers is named by the
fewest selectors that name exactly it among the mode's candidates: a whole block
(``model.layers.0``: every candidate below it is in the group), the same layer in every block
(``model.layers.*.mlp.down_proj``), or the layer's path.  :func:`write` plans the script on the model
and keeps it only if every statement changes exactly the layers chosen for it; otherwise each layer is
named by its path (never a script that does something else than what was measured).

>>> universe = [f"m.layers.{i}.{n}" for i in range(3) for n in ("q", "k", "down")]
>>> selectors({"m.layers.0.q", "m.layers.0.k", "m.layers.0.down", "m.layers.2.down", "m.layers.1.down"},
...           universe)
['m.layers.*.down', 'm.layers.0']
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

_INDEX = re.compile(r"^\d+$")


def _blocks(path: str) -> list[str]:
    """The prefixes of ``path`` that end at a numbered segment (``model.layers.0``)."""
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i, part in enumerate(parts[:-1]) if _INDEX.match(part)]


def _pattern(path: str) -> str | None:
    """``path`` with its numbered segments as ``*`` (None if it has none)."""
    parts = path.split(".")
    if not any(_INDEX.match(p) for p in parts):
        return None
    return ".".join("*" if _INDEX.match(p) else p for p in parts)


def selectors(group: set[str], universe: list[str]) -> list[str]:
    """The fewest selectors (by the greedy rule of the module docstring) that name exactly ``group``
    among ``universe``, sorted."""
    if not group:
        return []
    candidates: list[tuple[str, set[str]]] = []
    patterns: dict[str, set[str]] = {}
    for path in universe:
        pattern = _pattern(path)
        if pattern:
            patterns.setdefault(pattern, set()).add(path)
    candidates += [(p, members) for p, members in patterns.items() if len(members) > 1 and members <= group]
    blocks: dict[str, set[str]] = {}
    for path in universe:
        for block in _blocks(path):
            blocks.setdefault(block, set()).add(path)
    candidates += [(b, members) for b, members in blocks.items() if len(members) > 1 and members <= group]
    left, chosen = set(group), []
    while left:
        useful = [(len(members & left), -len(name), name, members) for name, members in candidates
                  if len(members & left) > 1]
        if not useful:
            break
        _, _, name, members = max(useful)
        chosen.append(name)
        left -= members
    return sorted(chosen + sorted(left))


def statements(chosen: dict[str, str], universes: dict[str, list[str]]) -> list[tuple[str, str, list[str]]]:
    """``[(mode, clause, paths)]``: one statement per mode (``clause``: ``"except A, B"``, ``"in A, B"`` or
    ``""``), the mode most layers take first."""
    counts = Counter(chosen.values())
    out = []
    for mode, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        paths = sorted(p for p, m in chosen.items() if m == mode)
        universe = universes[mode]
        inside = selectors(set(paths), universe)
        outside = selectors(set(universe) - set(paths), universe)
        if not outside:
            out.append((mode, "", paths))
        elif len(outside) < len(inside):
            out.append((mode, f"except {', '.join(outside)}", paths))
        else:
            out.append((mode, f"in {', '.join(inside)}", paths))
    return out


def _text(parts: list[tuple[str, str, list[str]]], comments: list[str], notes: dict[str, str]) -> str:
    lines = [f"# {c}" for c in comments]
    for mode, clause, _ in parts:
        if notes.get(mode):
            lines.append(f"# {notes[mode]}")
        lines.append(f"{mode} {clause}".strip())
    return "\n".join(lines) + "\n"


def planned_targets(model: Any, text: str) -> list[set[str]] | None:
    """Each statement's targets when ``text`` is planned on ``model`` (None: it does not plan)."""
    from ..errors import ScriptError, TransformError
    from ..planner import plan

    try:
        return [set(step.targets) for step in plan(model, text, calibration=True).steps]
    except (ScriptError, TransformError):
        return None


def write(model: Any, chosen: dict[str, str], universes: dict[str, list[str]], comments: list[str],
          notes: dict[str, str] | None = None) -> str:
    """The script of ``chosen`` (path -> mode), grouped (module docstring), checked by planning it on
    ``model``; ``comments`` head it, ``notes`` (mode -> text) precede each mode's statement."""
    notes = notes or {}
    if not chosen:
        return _text([], comments, notes)
    parts = statements(chosen, universes)
    text = _text(parts, comments, notes)
    if planned_targets(model, text) == [set(paths) for _, _, paths in parts]:
        return text
    plain = [(mode, f"in {', '.join(paths)}", paths) for mode, _, paths in parts]
    return _text(plain, comments, notes)
