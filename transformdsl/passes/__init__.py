"""The transforms, one module each.

To add a transform: write ``passes/<name>.py`` with a registered :class:`Transform`
subclass, add its module name to :data:`MODULES`, its tests under ``tests/`` and its section
in ``spec.md``, then regenerate the catalog (``python -m transformdsl.catalog --write``).

Importing this package imports no pass (and so no torch): :func:`load_all` does, when the
registry is first asked for a transform.
"""

from __future__ import annotations

import importlib

#: The modules that register transforms (importing each registers its transforms).
MODULES = ("compile", "elementwise", "fp8", "qkv", "quantize")


def load_all() -> None:
    """Import every pass module (registering its transforms)."""
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}")
