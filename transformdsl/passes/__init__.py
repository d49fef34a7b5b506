"""The transforms, one module each.  Importing this package registers them all.

To add a transform: write ``passes/<name>.py`` with a registered :class:`Transform`
subclass, add its import here, its tests under ``tests/`` and its section in ``spec.md``.
"""

from . import compile, elementwise, fp8, qkv, quantize  # noqa: F401
