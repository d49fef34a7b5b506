"""The one place transforms are found: registry key (``"verb mode"``) → :class:`~transformdsl.extend.Transform`.

Two sources, one mechanism: the built-in transforms (:data:`BUILTIN`) and third-party ones
installed with an entry point in the group :data:`GROUP` (entry name = the key, value =
``"module:Class"``).  Each is a reference, imported the first time its key is needed, so that
``transformdsl check`` imports only the declarations a script names (torch-free), and a broken
plugin fails only where it is used, naming itself.

- :func:`declaration` gives the class a key names (what validation reads);
- :func:`get` gives the class that runs it: the declaration's
  :attr:`~transformdsl.extend.Transform.implementation` (a subclass, imported on first use), or
  the declaration itself.

>>> sorted(k for k in keys() if k.startswith("compile"))
['compile', 'compile regional']
>>> declaration("compile").__module__
'transformdsl.transforms.compile'
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from .errors import TransformError

if TYPE_CHECKING:  # pragma: no cover
    from .extend import Transform

#: The entry-point group third-party transforms are installed under.
GROUP = "transformdsl.transforms"

#: The built-in transforms: key → ``"module:Class"`` of its (torch-free) declaration; the ``attention``
#: backends, one key each, come from the family's own table (:data:`FAMILY_TABLES`) on first use.
BUILTIN: dict[str, str] = {
    "calibrate": "transformdsl.transforms.calibrate:Calibrate",
    "cache faster": "transformdsl.transforms.cache:FasterCache",
    "cache first_block": "transformdsl.transforms.cache:FirstBlockCache",
    "cache mag": "transformdsl.transforms.cache:MagCache",
    "cache pyramid_broadcast": "transformdsl.transforms.cache:PyramidBroadcastCache",
    "cache sea": "transformdsl.transforms.cache:SeaCache",
    "cache taylorseer": "transformdsl.transforms.cache:TaylorSeerCache",
    "cache text_kv": "transformdsl.transforms.cache:TextKVCache",
    "compile": "transformdsl.transforms.compile:WholeCompile",
    "compile regional": "transformdsl.transforms.compile:RegionalCompile",
    "fp8 dynamic": "transformdsl.transforms.fp8:FP8Dynamic",
    "fp8 native": "transformdsl.transforms.fp8:FP8Native",
    "fp8 storage": "transformdsl.transforms.fp8:FP8Storage",
    "fuse bias_act_dropout": "transformdsl.transforms.elementwise:BiasActDropout",
    "fuse bias_dropout_residual": "transformdsl.transforms.elementwise:BiasDropoutResidual",
    "fuse bias_dropout_residual_layernorm": "transformdsl.transforms.elementwise:BiasDropoutResidualLayerNorm",
    "fuse qkv": "transformdsl.transforms.qkv:QKVFusion",
    "lora": "transformdsl.transforms.lora:Lora",
    "quantize fp4": "transformdsl.transforms.quantize:FP4Quantization",
    "quantize hqq": "transformdsl.transforms.quantize:HQQQuantization",
    "quantize int8": "transformdsl.transforms.quantize:Int8Quantization",
    "quantize nf4": "transformdsl.transforms.quantize:NF4Quantization",
    "quantize int4": "transformdsl.transforms.quantize:Int4Quantization",
    "quantize w8a8": "transformdsl.transforms.quantize:W8A8Quantization",
    "quantize q8_0": "transformdsl.transforms.quantize:Q8_0Quantization",
    "quantize q4_0": "transformdsl.transforms.quantize:Q4_0Quantization",
    "quantize q4_1": "transformdsl.transforms.quantize:Q4_1Quantization",
    "quantize q5_0": "transformdsl.transforms.quantize:Q5_0Quantization",
    "quantize q5_1": "transformdsl.transforms.quantize:Q5_1Quantization",
    "quantize q4_k": "transformdsl.transforms.quantize:Q4_KQuantization",
    "quantize q5_k": "transformdsl.transforms.quantize:Q5_KQuantization",
    "quantize q6_k": "transformdsl.transforms.quantize:Q6_KQuantization",
}


#: Families with a key per value of a list they own (``attention BACKEND``: one per backend of diffusers
#: and transformers): ``"module:NAME"`` of their torch-free ``{key: "module:Class"}`` table, read by name
#: on first use like any reference (the registry imports no family).
FAMILY_TABLES: tuple[str, ...] = ("transformdsl.transforms.attention:KEYS",)


def builtin() -> dict[str, str]:
    """Every built-in key → its reference: :data:`BUILTIN` and the keys of :data:`FAMILY_TABLES`."""
    global _BUILTIN_ALL
    if _BUILTIN_ALL is None:
        tables = {}
        for reference in FAMILY_TABLES:
            module, _, name = reference.partition(":")
            tables.update(getattr(importlib.import_module(module), name))
        _BUILTIN_ALL = {**BUILTIN, **tables}
    return _BUILTIN_ALL


_BUILTIN_ALL: dict[str, str] | None = None


class PluginError(TransformError):
    """An installed transform cannot be used: it fails to import, or two packages claim one key."""


@dataclass(frozen=True)
class Reference:
    """Where a transform is declared, and who said so (for messages)."""

    key: str
    value: str
    origin: str

    def load(self) -> type[Transform]:
        from .extend import Transform

        module_name, _, attribute = self.value.partition(":")
        try:
            module = importlib.import_module(module_name)
            cls = getattr(module, attribute) if attribute else None
        except (Exception, SystemExit) as exc:  # a plugin calling exit() at import must not end the caller
            raise PluginError(f"transform '{self.key}' ({self.origin}: {self.value}) failed to import: "
                              f"{type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Transform)):
            raise PluginError(f"transform '{self.key}' ({self.origin}): {self.value} is not a Transform subclass")
        check_api(cls, f"transform '{self.key}' ({self.origin}: {self.value})")
        options = getattr(cls, "Options", None)
        if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
            raise PluginError(f"transform '{self.key}' ({self.origin}): {self.value}.Options is "
                              f"{type(options).__name__ if not isinstance(options, type) else options.__qualname__}, "
                              "not a dataclass (declare it with @dataclass(frozen=True) and option(...) fields)")
        if cls.key() != self.key:
            raise PluginError(f"transform '{self.key}' ({self.origin}): {self.value} declares verb/mode "
                              f"'{cls.key()}', not '{self.key}'; make the entry point's name its key")
        return cls


_REFERENCES: dict[str, Reference] | None = None
#: Declarations loaded (and registered at run time): key → class.
_TRANSFORMS: dict[str, type[Transform]] = {}
#: Declaration → the class that runs it.
_IMPLEMENTATIONS: dict[type[Transform], type[Transform]] = {}


def _plugin_references() -> list[Reference]:
    from importlib.metadata import entry_points

    found = []
    for entry in entry_points(group=GROUP):
        dist = getattr(entry, "dist", None)
        origin = f"entry point of {dist.name} {dist.version}" if dist is not None else "entry point"
        found.append(Reference(entry.name.strip(), entry.value.strip(), origin))
    return found


def references() -> dict[str, Reference]:
    """Every known transform's reference, built-ins first; two claims on one key are an error."""
    global _REFERENCES
    if _REFERENCES is None:
        known = builtin()
        table = {key: Reference(key, value, "built-in") for key, value in known.items()}
        for ref in _plugin_references():
            if ref.key in known and ref.value == known[ref.key]:
                continue  # transformdsl's own entry point, if the distribution declares one
            if ref.key in table:
                other = table[ref.key]
                raise PluginError(f"two installed transforms claim '{ref.key}': {other.value} ({other.origin}) and "
                                  f"{ref.value} ({ref.origin}); uninstall one of them")
            table[ref.key] = ref
        _REFERENCES = table
    return _REFERENCES


def keys() -> list[str]:
    """Every registry key, without importing any transform."""
    return sorted(set(references()) | set(_TRANSFORMS))


def check_api(cls: type[Transform], what: str) -> None:
    """A :class:`PluginError` when ``cls`` requires a newer :data:`~transformdsl.extend.API_VERSION` than
    this transformdsl provides (``Transform.requires_api``)."""
    from .extend import API_VERSION

    needed = getattr(cls, "requires_api", 1)
    if not isinstance(needed, int) or isinstance(needed, bool) or needed > API_VERSION:
        raise PluginError(f"{what} requires transformdsl.extend API version {needed!r}, and this transformdsl "
                          f"provides version {API_VERSION}: upgrade transformdsl (or install a release of the "
                          "plugin written for this version)")


def register(cls: type[Transform]) -> type[Transform]:
    """Add a transform at run time (returns it unchanged); an installed package uses an entry point."""
    check_api(cls, f"transform {cls.key()!r} ({cls.__module__}.{cls.__qualname__})")
    key = cls.key()
    if (key in _TRANSFORMS and _TRANSFORMS[key] is not cls) or (key in references() and key not in _TRANSFORMS):
        raise PluginError(f"transform {key!r} registered twice")
    _TRANSFORMS[key] = cls
    return cls


def registered_at_run_time() -> list[type[Transform]]:
    """The transforms added by :func:`register` (not by an entry point or built in)."""
    table = references()
    return [cls for key, cls in _TRANSFORMS.items() if key not in table]


def register_by_name(classes: list[tuple[str, str]]) -> None:
    """Register the classes named ``(module, qualified name)`` (a process's run-time registrations,
    made again in another process), importing their modules; those already registered are kept."""
    for module_name, qualname in classes:
        target = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        if _TRANSFORMS.get(target.key()) is not target:
            register(target)


def declaration(key: str) -> type[Transform] | None:
    """The class declaring ``key`` (importing its module, which imports no torch for the built-ins)."""
    if key not in _TRANSFORMS:
        ref = references().get(key)
        if ref is None:
            return None
        _TRANSFORMS[key] = ref.load()
    return _TRANSFORMS[key]


def get(key: str) -> type[Transform] | None:
    """The class that runs ``key``: its declaration's implementation (imported now), or the declaration."""
    declared = declaration(key)
    if declared is None:
        return None
    if declared not in _IMPLEMENTATIONS:
        _IMPLEMENTATIONS[declared] = _implementation(key, declared)
    return _IMPLEMENTATIONS[declared]


def _implementation(key: str, declared: type[Transform]) -> type[Transform]:
    value = declared.implementation
    if not value:
        return declared
    if value.startswith("."):  # relative to the declaring module's package
        module = sys.modules[declared.__module__]
        package = module.__name__ if hasattr(module, "__path__") else module.__name__.rpartition(".")[0]
        name, _, attribute = value.partition(":")
        value = f"{importlib.util.resolve_name(name, package)}:{attribute}"
    cls = Reference(key, value, f"implementation of {declared.__module__}.{declared.__qualname__}").load()
    if not issubclass(cls, declared):
        raise PluginError(f"transform '{key}': its implementation {value} does not subclass its declaration "
                          f"{declared.__qualname__} (it must: then the two cannot disagree)")
    return cls


class _View(Mapping):
    """Key → class, loading each class on first access (``declarations()``/``transforms()``)."""

    def __init__(self, load):
        self._load = load

    def __getitem__(self, key: str) -> type[Transform]:
        cls = self._load(key)
        if cls is None:
            raise KeyError(key)
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(keys())

    def __len__(self) -> int:
        return len(keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in keys()


def declarations() -> Mapping[str, type[Transform]]:
    """Key → declaration, each imported when looked up (what ``transformdsl check`` validates with)."""
    return _View(declaration)


def transforms() -> dict[str, type[Transform]]:
    """Key → implementation of every transform (imports them all, and torch)."""
    return {key: get(key) for key in keys()}


def verbs() -> dict[str, list[str | None]]:
    """verb → its modes (``None`` for the mode-less form), from the keys alone."""
    return verbs_of(keys())


def verbs_of(transforms) -> dict[str, list[str | None]]:
    """verb → its modes, among ``transforms`` (registry keys, or a mapping keyed by them)."""
    out: dict[str, list[str | None]] = {}
    for key in transforms:
        verb, _, mode = key.partition(" ")
        out.setdefault(verb, []).append(mode or None)
    return out


def key_matches(key: str, patterns: tuple[str, ...]) -> bool:
    """Whether a registry key (``"quantize int8"``) matches any of the glob ``patterns``."""
    return any(fnmatchcase(key, p) for p in patterns)
