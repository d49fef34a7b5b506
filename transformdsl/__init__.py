"""transformdsl: describe how to make a model fast and small, check it, apply it, save it.

>>> import transformdsl
>>> script = transformdsl.parse("fuse qkv in *Attention; quantize int8 except norm")
>>> [s.key for s in script]
['fuse qkv', 'quantize int8']

Public surface: :func:`parse`, :func:`plan`, :func:`transform`, :func:`save`, :func:`load`
and the errors :class:`TransformError`, :class:`ScriptError`, :class:`LoadError`.
"""

from __future__ import annotations

from .errors import LoadError, ScriptError, TransformError
from .parser import parse
from .planner import Plan, plan

__version__ = "0.1.0"


def transform(model, script, **kwargs):
    """Validate, plan and execute ``script`` on ``model``; see :func:`transformdsl.executor.transform`."""
    from .executor import transform as _transform

    return _transform(model, script, **kwargs)


def save(model, directory, **kwargs):
    """Save a transformed model; see :func:`transformdsl.persist.save`."""
    from .persist import save as _save

    return _save(model, directory, **kwargs)


def load(directory, model=None, **kwargs):
    """Load a saved model; see :func:`transformdsl.persist.load`."""
    from .persist import load as _load

    return _load(directory, model=model, **kwargs)


__all__ = ["parse", "plan", "transform", "save", "load", "Plan",
           "TransformError", "ScriptError", "LoadError", "__version__"]
