"""An undo log that makes a transform atomic without copying weights.

Passes never change a module or tensor in place.  They build new modules and tensors and
make every change to an existing module through an :class:`Edit`, which saves the
module's attribute dictionaries the first time it is touched.  If anything fails,
:meth:`Edit.rollback` restores each touched module's attributes (parameters, buffers,
submodules, plain attributes, in their original order), so the model is exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_DICTS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
          "_forward_hooks", "_forward_pre_hooks")


class Edit:
    """Records changes to modules so that they can be undone."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[object, dict, dict]] = {}
        self._undo: list[Callable[[], None]] = []

    def touch(self, obj: object) -> None:
        """Save ``obj``'s attributes before its first change (idempotent)."""
        if id(obj) in self._saved:
            return
        state = dict(obj.__dict__)
        inner = {}
        for name in _DICTS:
            value = state.get(name)
            if value is not None:
                inner[name] = value.copy()
        self._saved[id(obj)] = (obj, state, inner)

    def setattr(self, obj: object, name: str, value: object) -> None:
        self.touch(obj)
        setattr(obj, name, value)

    def delattr(self, obj: object, name: str) -> None:
        self.touch(obj)
        delattr(obj, name)

    def replace(self, root: nn.Module, path: str, new: nn.Module) -> nn.Module:
        """Put ``new`` at ``path`` (keeping its position among siblings); return the old module."""
        parent_path, _, name = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        self.touch(parent)
        old = parent._modules[name]
        parent._modules[name] = new
        return old

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Register an extra undo step for a change made outside module attributes
        (a module's class, say).  Register it *before* making the change, so that a failure
        between the two cannot leave the change without its undo."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo every change.  A failing undo step (a bug in a pass) does not stop the others:
        everything else is restored, then its exception is raised."""
        failure: BaseException | None = None
        for undo in reversed(self._undo):
            try:
                undo()
            except BaseException as exc:  # noqa: BLE001 - restore the rest first
                failure = failure or exc
        for obj, state, inner in self._saved.values():
            obj.__dict__.clear()
            obj.__dict__.update(state)
            for name, value in inner.items():
                container = obj.__dict__[name]
                container.clear()
                container.update(value)
        self._saved.clear()
        self._undo.clear()
        if failure is not None:
            raise failure

    def commit(self) -> None:
        """Forget the saved state (frees the replaced modules' tensors)."""
        self._saved.clear()
        self._undo.clear()
