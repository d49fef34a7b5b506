"""The one place transforms are registered: ``verb mode`` → :class:`Transform` subclass."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .passes.base import Transform

_TRANSFORMS: dict[str, type[Transform]] = {}


def register(cls: type[Transform]) -> type[Transform]:
    """Class decorator: add a transform to the registry (returns it unchanged)."""
    key = cls.key()
    if key in _TRANSFORMS and _TRANSFORMS[key] is not cls:
        raise ValueError(f"transform {key!r} registered twice")
    _TRANSFORMS[key] = cls
    return cls


_loaded = False


def _load() -> dict[str, type[Transform]]:
    global _loaded
    if not _loaded:
        from .passes import load_all

        load_all()  # importing a pass module registers its transforms
        _loaded = True
    return _TRANSFORMS


def transforms() -> dict[str, type[Transform]]:
    return dict(_load())


def get(key: str) -> type[Transform] | None:
    return _load().get(key)


def verbs() -> dict[str, list[str | None]]:
    """verb → its modes (``None`` for the mode-less form)."""
    return verbs_of(_load())


def verbs_of(transforms: dict[str, type[Transform]]) -> dict[str, list[str | None]]:
    """verb → its modes, among ``transforms`` (registry key → class)."""
    out: dict[str, list[str | None]] = {}
    for cls in transforms.values():
        out.setdefault(cls.verb, []).append(cls.mode)
    return out


def key_matches(key: str, patterns: tuple[str, ...]) -> bool:
    """Whether a registry key (``"quantize int8"``) matches any of the glob ``patterns``."""
    return any(fnmatchcase(key, p) for p in patterns)
