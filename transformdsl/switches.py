"""Runtime switches: what a transformed model may change at run time without being transformed again.

Every transform that has one uses this class, so every switch is driven the same way::

    from transformdsl.transforms.elementwise import FUSED
    FUSED.set(False)            # off for the process (None: back to its default)
    with FUSED.turned(False):   # off within the block, then as it was
        model(x)

A switch is read in ``forward`` as one attribute (``SWITCH.enabled``), which ``torch.compile`` guards
on: flipping it recompiles instead of going stale.  It is declared in the transform's torch-free
declaration module, and listed in its ``Transform.switches`` (spec.md names each).

>>> s = Switch("example", "an example", default=True, environment="TRANSFORMDSL_EXAMPLE_OFF", when_set=False)
>>> s.enabled
True
>>> with s.turned(False):
...     s.enabled
False
>>> s.enabled
True
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: Environment values that mean "set".
TRUE_WORDS = ("1", "true", "yes", "on")


class Switch:
    """One runtime switch: ``enabled`` (a bool), its default, and the environment variable that sets it."""

    def __init__(self, name: str, doc: str, *, default: bool, environment: str | None = None,
                 when_set: bool = True):
        self.name = name
        self.doc = doc
        self.default = default
        #: A variable that, set to 1/true/yes/on when the process starts (or at :meth:`set` (None)),
        #: gives the switch the value ``when_set``.
        self.environment = environment
        self.when_set = when_set
        self.enabled = self._initial()

    def _initial(self) -> bool:
        if self.environment and os.environ.get(self.environment, "").strip().lower() in TRUE_WORDS:
            return self.when_set
        return self.default

    def set(self, enabled: bool | None) -> None:
        """Turn the switch on or off for the process; ``None``: back to its default (the environment's)."""
        self.enabled = self._initial() if enabled is None else bool(enabled)

    @contextlib.contextmanager
    def turned(self, enabled: bool) -> Iterator[None]:
        """Within the block the switch is ``enabled``; afterwards it is as it was."""
        previous = self.enabled
        self.set(enabled)
        try:
            yield
        finally:
            self.enabled = previous

    def __bool__(self) -> bool:
        return self.enabled

    def __repr__(self) -> str:
        return f"Switch({self.name!r}, enabled={self.enabled})"
