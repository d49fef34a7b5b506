"""An undo log that makes a transform atomic without copying weights.

Passes never change a module or tensor in place.  They build new modules and tensors and
make every change to an existing module through an :class:`Edit`, which saves the
module's attribute dictionaries the first time it is touched.  If anything fails,
:meth:`Edit.rollback` restores each touched module's attributes (parameters, buffers,
submodules, plain attributes, in their original order), so the model is exactly as it was.

Given an :class:`~transformdsl.spill.UndoStore`, the edit offers it every original it detaches
from the model (a replaced module, a removed tensor), so that originals past a memory budget wait
on disk (or in the file they are memory-mapped from) instead of in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from .spill import UndoStore

_DICTS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
          "_forward_hooks", "_forward_pre_hooks")


class Edit:
    """Records changes to modules so that they can be undone."""

    def __init__(self, store: UndoStore | None = None) -> None:
        self._saved: dict[int, tuple[object, dict, dict]] = {}
        self._undo: list[Callable[[], None]] = []
        self.store = store

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
        old = self._original(obj, name)
        setattr(obj, name, value)
        self._detached(old)

    def delattr(self, obj: object, name: str) -> None:
        self.touch(obj)
        old = self._original(obj, name)
        delattr(obj, name)
        self._detached(old)

    def replace(self, root: nn.Module, path: str, new: nn.Module) -> nn.Module:
        """Put ``new`` at ``path`` (keeping its position among siblings); return the old module."""
        parent_path, _, name = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        self.touch(parent)
        old = parent._modules[name]
        parent._modules[name] = new
        if self.store is not None and self._saved[id(parent)][2]["_modules"].get(name) is old:
            self.store.offer(old)
        return old

    def _original(self, obj: object, name: str) -> object:
        """The value of ``obj.name`` if it is one the log keeps (was there before the edit), else None."""
        if self.store is None:
            return None
        _, state, inner = self._saved[id(obj)]
        for container in ("_parameters", "_buffers", "_modules"):
            saved = inner.get(container)
            if saved is not None and name in saved:
                current = obj.__dict__[container].get(name)
                return current if current is saved[name] else None
        current = obj.__dict__.get(name)
        return current if current is not None and current is state.get(name) else None

    def _detached(self, old: object) -> None:
        if old is not None:
            self.store.offer(old)

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Register an extra undo step for a change made outside module attributes
        (a module's class, say).  Register it *before* making the change, so that a failure
        between the two cannot leave the change without its undo."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo every change.  A failing undo step (a bug in a pass) does not stop the others:
        everything else is restored, then its exception is raised."""
        failure: BaseException | None = None
        if self.store is not None:
            try:
                self.store.restore()
            except BaseException as exc:  # noqa: BLE001 - restore the rest first
                failure = exc
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
