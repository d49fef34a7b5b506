"""A printable snapshot of a module tree: what planning reads instead of the live model.

One walk of ``named_modules()`` records, per module, its path, class (with base-class
names for selector matching) and the bytes of its own parameters and buffers.  Planning
then works on the snapshot, so transforms can describe their structural effect (``fuse
qkv`` replaces ``to_q/to_k/to_v`` with ``to_qkv``) and later statements are resolved
against the tree as it will be when they run, without touching the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z]|\d|\b)|[A-Z]?[a-z]+|[A-Z]+|\d+")
_SEGMENT_TOKENS = re.compile(r"[a-z]+|[A-Z][a-z]*|\d+")


def class_names(cls: type) -> tuple[str, ...]:
    """The class's name and its bases' names, up to (excluding) ``nn.Module``."""
    names = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        names.append(klass.__name__)
    return tuple(names)


def name_tokens(segment: str) -> tuple[str, ...]:
    """``norm_added_k`` → (norm, added, k); ``norm1`` → (norm, 1)."""
    return tuple(t.lower() for t in _SEGMENT_TOKENS.findall(segment))


def class_tokens(name: str) -> tuple[str, ...]:
    """``AdaLayerNormZero`` → (ada, layer, norm, zero); ``LlamaRMSNorm`` → (llama, rms, norm)."""
    return tuple(t.lower() for t in _CAMEL.findall(name))


@dataclass
class ModuleInfo:
    """One module as planning sees it."""

    path: str
    cls: type
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    own_bytes: int = 0
    #: Free-form facts a transform may read at plan time (``in_features``, ``weight_shape``...).
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def class_names(self) -> tuple[str, ...]:
        return class_names(self.cls)


def module_facts(module: nn.Module) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    if weight is not None:
        facts["weight_shape"] = tuple(weight.shape)
        facts["dtype"] = weight.dtype
    for attr in ("in_features", "out_features", "nf"):
        value = module.__dict__.get(attr)
        if isinstance(value, int):
            facts[attr] = value
    return facts


def tensor_bytes(module: nn.Module, recurse: bool = False) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse)):
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


class ModuleTree:
    """Ordered snapshot of a module tree (pre-order, as ``named_modules()`` yields it)."""

    def __init__(self, infos: list[ModuleInfo]):
        self._infos: dict[str, ModuleInfo] = {info.path: info for info in infos}

    @classmethod
    def of(cls, root: nn.Module) -> ModuleTree:
        infos = []
        for path, module in root.named_modules(remove_duplicate=True):
            infos.append(ModuleInfo(path, type(module), module, tensor_bytes(module), module_facts(module)))
        return cls(infos)

    def __iter__(self):
        return iter(self._infos.values())

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, path: str) -> bool:
        return path in self._infos

    def __getitem__(self, path: str) -> ModuleInfo:
        return self._infos[path]

    def get(self, path: str) -> ModuleInfo | None:
        return self._infos.get(path)

    def subtree(self, path: str) -> list[ModuleInfo]:
        """``path`` and everything below it."""
        if path == "":
            return list(self._infos.values())
        prefix = path + "."
        return [i for p, i in self._infos.items() if p == path or p.startswith(prefix)]

    def children(self, path: str) -> list[ModuleInfo]:
        depth = 0 if path == "" else path.count(".") + 1
        return [i for i in self.subtree(path) if i.path and i.path.count(".") == depth and i.path != path]

    def subtree_bytes(self, path: str) -> int:
        return sum(i.own_bytes for i in self.subtree(path))

    # -- structural edits used by transforms' plan effects --------------------------------

    def replace(self, path: str, cls: type, own_bytes: int | None = None, **facts) -> None:
        """Record that the module at ``path`` becomes a ``cls`` (children kept)."""
        old = self._infos[path]
        new_facts = dict(old.facts)
        new_facts.update(facts)
        self._infos[path] = ModuleInfo(path, cls, None, old.own_bytes if own_bytes is None else own_bytes, new_facts)

    def remove(self, path: str) -> None:
        """Remove ``path`` and its subtree."""
        for info in self.subtree(path):
            del self._infos[info.path]

    def add(self, path: str, cls: type, own_bytes: int = 0, after: str | None = None, **facts) -> None:
        """Add a module (placed after ``after`` when given, to keep a readable order)."""
        info = ModuleInfo(path, cls, None, own_bytes, facts)
        if after is None or after not in self._infos:
            self._infos[path] = info
            return
        items = list(self._infos.items())
        index = [p for p, _ in items].index(after) + len(self.subtree(after))
        items.insert(index, (path, info))
        self._infos = dict(items)


def is_below(path: str, ancestor: str) -> bool:
    """``path`` is ``ancestor`` or lies in its subtree."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of all distinct parameters and buffers of ``module``."""
    return tensor_bytes(module, recurse=True)


def dtype_of(module: nn.Module) -> torch.dtype | None:
    for p in module.parameters():
        return p.dtype
    return None
