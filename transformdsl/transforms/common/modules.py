"""Small questions about modules that several transforms ask, answered once.

- :func:`is_conv1d`: is this transformers' ``Conv1D`` (GPT-2's linear layer with a transposed weight)?
- :func:`tied_weights`: which weights are held by several modules (an embedding tied to a head)?
- :func:`put_module`: put a module at a path of a skeleton being rebuilt on load.
- :func:`recorded_targets`: the modules a run-time statement's record names, read back on load
  (compile, cache, attention set things up again in ``finalize``), checked against the model.
  (Its options are the checked statement's: ``persist.checks.check_record`` refuses a record whose
  copy of them differs.)

Importing this module imports no torch.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from ...errors import LoadError

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ...tree import ModuleTree


def is_conv1d(cls: type, module: Any = None) -> bool:
    """Whether ``cls`` (the class of ``module``, when it exists) is transformers' ``Conv1D``: a linear layer
    whose weight is stored ``(in_features, out_features)``.  A class of that name elsewhere counts when its
    module has ``Conv1D``'s ``nf`` (output features) attribute, as remote-code copies of GPT-2 do."""
    if cls.__name__ != "Conv1D":
        return False
    return cls.__module__.startswith("transformers.") or (module is not None and hasattr(module, "nf"))


_TIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tied_weights(tree: ModuleTree) -> dict[int, list[str]]:
    """``id(weight)`` → the paths of the live modules holding it, for weights held by more than one
    (computed once per planning snapshot)."""
    if tree not in _TIED:
        owners: dict[int, list[str]] = {}
        for info in tree:
            weight = info.module._parameters.get("weight") if info.module is not None else None
            if weight is not None:
                owners.setdefault(id(weight), []).append(info.path)
        _TIED[tree] = {key: paths for key, paths in owners.items() if len(paths) > 1}
    return _TIED[tree]


def put_module(root: nn.Module, path: str, module: nn.Module, key: str) -> None:
    """Put ``module`` at ``path`` of a skeleton being rebuilt by transform ``key`` (loading: nothing to undo);
    a :class:`LoadError` when the architecture has no module there (the save is of another model)."""
    parent_path, _, name = path.rpartition(".")
    try:
        parent = root.get_submodule(parent_path) if parent_path else root
    except AttributeError:
        parent = None
    if parent is None or name not in parent._modules:
        raise LoadError(f"{key}: the saved model has a changed module at '{path}', which this architecture "
                        "does not have")
    parent._modules[name] = module


def recorded_targets(root: nn.Module, record: dict, key: str) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` for each path of ``record["targets"]`` (``""``: ``root``); a :class:`LoadError`
    naming the path when the record has no such list or the model no such module."""
    targets = record.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoadError(f"the record of '{key}' has no list of module paths (targets): transformdsl.json was "
                        "edited or is corrupt; save the model again")
    found = []
    for path in targets:
        try:
            found.append((path, root.get_submodule(path) if path else root))
        except AttributeError:
            raise LoadError(f"the record of '{key}' names module {path[:200]!r}, which the loaded model does not "
                            "have: transformdsl.json was edited or belongs to another model") from None
    return found

