"""The transforms, one module each.

To add a transform: write ``passes/<name>.py`` with a registered :class:`Transform`
subclass, add its import to :func:`load_all`, its tests under ``tests/`` and its section
in ``spec.md``, then regenerate the catalog (``python -m transformdsl.catalog --write``).

Importing this package imports no pass (and so no torch): :func:`load_all` does, when the
registry is first asked for a transform.
"""

from __future__ import annotations


def load_all() -> None:
    """Import every pass module (importing one registers its transforms)."""
    from . import compile, elementwise, fp8, qkv, quantize  # noqa: F401
