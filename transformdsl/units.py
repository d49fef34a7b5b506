"""Quantities as people read them: :func:`human_bytes` (``"47.5 KiB"``), for plans, logs and messages.

Imports nothing; :mod:`transformdsl.extend` exports it for transforms' notes and errors.
"""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (binary units), one decimal above bytes: ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover
