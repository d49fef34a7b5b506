"""A printable snapshot of a module tree: what planning reads instead of the live model.

One walk of ``named_modules()`` records, per module, its path, class (with base-class
names for selector matching) and the bytes of its own parameters and buffers.  Planning
then works on the snapshot, so transforms can describe their structural effect (``fuse
qkv`` replaces ``to_q/to_k/to_v`` with ``to_qkv``) and later statements are resolved
against the tree as it will be when they run, without touching the model.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z]|\d|\b)|[A-Z]?[a-z]+|[A-Z]+|\d+")
_SEGMENT_TOKENS = re.compile(r"[a-z]+|[A-Z][a-z]*|\d+")


@functools.lru_cache(maxsize=4096)
def class_names(cls: type) -> tuple[str, ...]:
    """The class's name and all its bases' names, ``nn.Module`` and ``object`` excepted.

    Mixins listed after ``nn.Module`` count too (diffusers' ``FluxAttention(nn.Module,
    AttentionModuleMixin)``).
    """
    return tuple(k.__name__ for k in cls.__mro__ if k not in (nn.Module, object))


@functools.lru_cache(maxsize=65536)
def name_tokens(segment: str) -> tuple[str, ...]:
    """``norm_added_k`` → (norm, added, k); ``norm1`` → (norm, 1)."""
    return tuple(t.lower() for t in _SEGMENT_TOKENS.findall(segment))


@functools.lru_cache(maxsize=4096)
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
    #: The last path segment (set from ``path``: selectors read it for every module).
    name: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.name = self.path.rpartition(".")[2]

    @property
    def class_names(self) -> tuple[str, ...]:
        return class_names(self.cls)


def module_facts(module: nn.Module) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    if weight is not None:
        facts["weight_shape"] = tuple(weight.shape)
        facts["dtype"] = weight.dtype
        if weight.is_meta:
            facts["meta"] = True
    for attr in ("in_features", "out_features", "nf"):
        value = module.__dict__.get(attr)
        if isinstance(value, int):
            facts[attr] = value
    return facts


def tensor_bytes(module: nn.Module, recurse: bool = False) -> int:
    if recurse:
        tensors = list(module.parameters()) + list(module.buffers())
    else:
        # The module's own tensors: what parameters(recurse=False) and buffers(recurse=False)
        # yield, read from the dictionaries directly (the snapshot does this for every module).
        tensors = list(module._parameters.values()) + list(module._buffers.values())
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


#: Set (true) in a module's ``__dict__`` while its weights, on the meta device, are still to be read,
#: to the CPU, before any statement applies (``convert`` reads each block just before transforming it).
WEIGHTS_PENDING = "_transformdsl_weights_pending"


class ModuleTree:
    """Ordered snapshot of a module tree (pre-order, as ``named_modules()`` yields it).

    Besides the path -> info dictionary and the order of the paths, the tree keeps each path's
    direct children (in tree order), so that a subtree costs its own size, not a scan of the
    whole tree, and an insertion does not copy the tree.
    """

    def __init__(self, infos: list[ModuleInfo]):
        self._infos: dict[str, ModuleInfo] = {}
        #: Paths in tree order; removed paths stay listed (and skipped) until the next read.
        self._order: list[str] = []
        self._removed: set[str] = set()
        self._kids: dict[str, list[str]] = {}
        self._positions: dict[str, int] | None = None
        #: Whether the order is a pre-order of the children lists (then a subtree needs no sort).
        self._preorder = True
        self._groups: dict[tuple[str, type], list[ModuleInfo]] | None = None
        self._depths: dict[int, list[ModuleInfo]] | None = None
        #: Of the module the snapshot was taken of (``of``): modules, and bytes of distinct tensors.
        self.module_count = 0
        self.total_bytes = 0
        #: Whether meta-device weights will be read before the statements apply (:data:`WEIGHTS_PENDING`).
        self.weights_pending = False
        #: Whether every parameter of the model is on the meta device (none loaded: a skeleton to plan on).
        self.all_meta = False
        for info in infos:
            if info.path not in self._infos:
                self._order.append(info.path)
                self._kids.setdefault(_parent(info.path), []).append(info.path)
            self._infos[info.path] = info

    @classmethod
    def of(cls, root: nn.Module) -> ModuleTree:
        infos = []
        seen: set[int] = set()
        total = 0
        for path, module in root.named_modules(remove_duplicate=True):
            # tensor_bytes(module) and the model's total, in one pass over the module's own tensors.
            own = 0
            mine: set[int] = set()
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if tensor is None or id(tensor) in mine:
                    continue
                mine.add(id(tensor))
                size = tensor.numel() * tensor.element_size()
                own += size
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += size
            infos.append(ModuleInfo(path, type(module), module, own, module_facts(module)))
        tree = cls(infos)
        tree.module_count, tree.total_bytes = len(infos), total
        tree.weights_pending = bool(root.__dict__.get(WEIGHTS_PENDING))
        tree.all_meta = is_skeleton(root)
        return tree

    def copy(self) -> ModuleTree:
        """An independent copy of the snapshot, to plan on again (its edits leave this one as it is).

        The :class:`ModuleInfo` objects are shared: the edits below replace them, never change one."""
        tree = ModuleTree.__new__(ModuleTree)
        tree.__dict__.update(self.__dict__)
        tree._infos = dict(self._infos)
        tree._order = list(self._order)
        tree._removed = set(self._removed)
        tree._kids = {path: list(kids) for path, kids in self._kids.items()}
        return tree

    def _paths(self) -> list[str]:
        if self._removed:
            self._order = [p for p in self._order if p not in self._removed]
            self._removed.clear()
        return self._order

    def __iter__(self):
        return map(self._infos.__getitem__, self._paths())

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, path: str) -> bool:
        return path in self._infos

    def __getitem__(self, path: str) -> ModuleInfo:
        return self._infos[path]

    def get(self, path: str) -> ModuleInfo | None:
        return self._infos.get(path)

    def position(self, path: str) -> int:
        """Index of ``path`` in tree order."""
        if self._positions is None:
            self._positions = {p: i for i, p in enumerate(self._paths())}
        return self._positions[path]

    def groups(self) -> dict[tuple[str, type], list[ModuleInfo]]:
        """The modules grouped by (last path segment, class), each group in tree order.

        Models repeat a few names and classes in every block: a selector that depends on
        nothing else (class, name and word selectors) is decided once per group.
        """
        if self._groups is None:
            groups: dict[tuple[str, type], list[ModuleInfo]] = {}
            for info in self:
                groups.setdefault((info.name, info.cls), []).append(info)
            self._groups = groups
        return self._groups

    def depths(self) -> dict[int, list[ModuleInfo]]:
        """The modules by number of path segments (the root has 0), each list in tree order."""
        if self._depths is None:
            depths: dict[int, list[ModuleInfo]] = {}
            for info in self:
                depths.setdefault(info.path.count(".") + 1 if info.path else 0, []).append(info)
            self._depths = depths
        return self._depths

    def subtree(self, path: str) -> list[ModuleInfo]:
        """``path`` and everything below it (pre-order)."""
        if path == "":
            return list(self)
        infos = self._infos
        found = [infos[path]] if path in infos else []
        stack = list(reversed(self._kids.get(path, ())))
        while stack:
            child = stack.pop()
            found.append(infos[child])
            stack.extend(reversed(self._kids.get(child, ())))
        if not self._preorder:
            found.sort(key=lambda info: self.position(info.path))
        return found

    def within(self, roots) -> list[ModuleInfo]:
        """The modules at or below any of ``roots``, each once, in tree order."""
        given = set(roots)
        if "" in given:
            return list(self)
        tops = [r for r in given if not below_any(_parent(r) or "\x00", given)]
        if len(tops) == 1:
            return self.subtree(tops[0])
        found = [info for top in tops for info in self.subtree(top)]
        found.sort(key=lambda info: self.position(info.path))
        return found

    def children(self, path: str) -> list[ModuleInfo]:
        return [self._infos[p] for p in self._kids.get(path, ()) if p != path]

    def subtree_bytes(self, path: str) -> int:
        return sum(i.own_bytes for i in self.subtree(path))

    # -- structural edits used by transforms' plan effects --------------------------------

    def replace(self, path: str, cls: type, own_bytes: int | None = None, **facts) -> None:
        """Record that the module at ``path`` becomes a ``cls`` (children kept)."""
        old = self._infos[path]
        new_facts = dict(old.facts)
        new_facts.update(facts)
        self._infos[path] = ModuleInfo(path, cls, None, old.own_bytes if own_bytes is None else own_bytes, new_facts)
        self._groups = None

    def remove(self, path: str) -> None:
        """Remove ``path`` and its subtree."""
        for info in self.subtree(path):
            del self._infos[info.path]
            self._kids.pop(info.path, None)
            self._removed.add(info.path)
        siblings = self._kids.get(_parent(path))
        if siblings is not None and path in siblings:
            siblings.remove(path)
        self._positions = self._groups = self._depths = None

    def add(self, path: str, cls: type, own_bytes: int = 0, after: str | None = None, **facts) -> None:
        """Add a module (placed after ``after``'s subtree when given, to keep a readable order)."""
        info = ModuleInfo(path, cls, None, own_bytes, facts)
        self._groups = self._depths = None
        if path in self._infos:  # already there: a new description, same place
            self._infos[path] = info
            return
        if path in self._removed:
            self._paths()  # drop the old place before taking a new one
        self._infos[path] = info
        self._positions = None
        siblings = self._kids.setdefault(_parent(path), [])
        if after is None or after not in self._infos:
            if self._preorder and _parent(path) is not None and self._order:
                # Appending keeps a pre-order only if the parent's subtree ends the tree.
                self._preorder = self._last_of_subtree(_parent(path)) == self._paths()[-1]
            self._order.append(path)
            siblings.append(path)
            return
        if _parent(path) not in (after, _parent(after)):
            self._preorder = False
        last = self._last_of_subtree(after)
        self._order.insert(self._order.index(last) + 1, path)
        siblings.append(path)
        if len(siblings) > 1 and siblings[-2] != last and not is_below(last, siblings[-2]):
            siblings.sort(key=self.position)

    def _last_of_subtree(self, path: str) -> str:
        """The last path of ``path``'s subtree in tree order."""
        while self._kids.get(path):
            path = self._kids[path][-1]
        return path


def _parent(path: str) -> str | None:
    """``a.b.c`` -> ``a.b``; ``a`` -> ``""`` (the root); the root has no parent."""
    if path == "":
        return None
    return path.rpartition(".")[0]


def below_any(path: str, roots: frozenset[str] | set[str]) -> bool:
    """``path`` is one of ``roots`` or lies in the subtree of one (``"" in roots``: everything)."""
    if path in roots or "" in roots:
        return True
    end = path.rfind(".")
    while end > 0:
        if path[:end] in roots:
            return True
        end = path.rfind(".", 0, end)
    return False


def is_below(path: str, ancestor: str) -> bool:
    """``path`` is ``ancestor`` or lies in its subtree."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def is_skeleton(module: nn.Module) -> bool:
    """Whether ``module`` has parameters and every one is on the meta device (an architecture built
    under ``torch.device("meta")`` or accelerate's ``init_empty_weights``: no weight loaded)."""
    found = False
    for param in module.parameters():
        if not param.is_meta:
            return False
        found = True
    return found


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of all distinct parameters and buffers of ``module``."""
    return tensor_bytes(module, recurse=True)


def dtype_of(module: nn.Module) -> torch.dtype | None:
    for p in module.parameters():
        return p.dtype
    return None
