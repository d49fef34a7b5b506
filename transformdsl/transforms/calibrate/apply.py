"""``calibrate "PATH"`` (implementation): records what the data were; the executor reads them."""

from __future__ import annotations

from ...extend import ApplyContext
from ...tree import ModuleTree
from . import Calibrate as CalibrateDeclaration


class Calibrate(CalibrateDeclaration):
    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        return ["read before any statement runs; the methods fit on all but the held-out part verify= uses"]

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        return {"data": ctx.calibration.record() if ctx.calibration is not None else None}

    @classmethod
    def rebuild(cls, root, record, options) -> None:
        """Nothing to rebuild: the statement changed no module."""
