"""transformdsl: describe how to make a model fast and small, check it, apply it, save it.

>>> import transformdsl
>>> script = transformdsl.parse("fuse qkv in *Attention; quantize int8 except norm")
>>> [s.key for s in script]
['fuse qkv', 'quantize int8']

Public surface: :func:`parse`, :func:`plan`, :func:`transform`, :func:`save`, :func:`load`
and the errors :class:`TransformError`, :class:`ScriptError`, :class:`LoadError`.

``import transformdsl`` imports neither torch nor the model libraries: each public name is the
function itself (same signature, same docstring: ``help(transformdsl.transform)`` shows every
parameter), imported from its module the first time it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import LoadError, ScriptError, TransformError

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first access).
_LAZY = {
    "parse": "parser",
    "plan": "planner",
    "Plan": "planner",
    "transform": "executor",
    "save": "persist",
    "load": "persist",
}

if TYPE_CHECKING:  # pragma: no cover
    from .executor import transform
    from .parser import parse
    from .persist import load, save
    from .planner import Plan, plan


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["parse", "plan", "transform", "save", "load", "Plan",
           "TransformError", "ScriptError", "LoadError", "__version__"]
