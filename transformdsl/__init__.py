"""transformdsl: describe how to make a model fast and small, check it, apply it, save it.

>>> import transformdsl
>>> script = transformdsl.parse("fuse qkv in *Attention; quantize int8 except norm")
>>> [s.key for s in script]
['fuse qkv', 'quantize int8']

Public surface: :func:`parse`, :func:`plan`, :func:`transform`, :func:`save`, :func:`load`,
:func:`convert` (a checkpoint through a script into a save, one block at a time),
:func:`set_lora` / :func:`lora_adapters` (switchable LoRAs' scales at run time),
:func:`tune` (the script that meets a quality budget, smallest or fastest here: spec.md "Finding a script: tune")
and the errors :class:`TransformError`, :class:`ScriptError`, :class:`LoadError`.

``import transformdsl`` imports neither torch nor the model libraries: each public name is the
function itself (same signature, same docstring: ``help(transformdsl.transform)`` shows every
parameter), imported from its module the first time it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import quiet
from .errors import LoadError, ScriptError, TransformError
from .version import __version__

quiet.install()  # before anything imports bitsandbytes (diffusers and transformers do): see quiet.py

#: The public names defined in other modules (imported on first access).
_LAZY = ("parse", "plan", "Plan", "transform", "save", "load", "convert", "set_lora", "lora_adapters", "tune")

if TYPE_CHECKING:  # pragma: no cover
    from . import tune
    from .executor import transform
    from .parser import parse
    from .persist import load, save
    from .planner import Plan, plan
    from .streaming import convert
    from .transforms.lora.runtime import lora_adapters, set_lora


def __getattr__(name: str):
    if name == "parse":
        from .parser import parse as value
    elif name == "plan":
        from .planner import plan as value
    elif name == "Plan":
        from .planner import Plan as value
    elif name == "transform":
        from .executor import transform as value
    elif name == "save":
        from .persist import save as value
    elif name == "load":
        from .persist import load as value
    elif name == "convert":
        from .streaming import convert as value
    elif name == "set_lora":
        from .transforms.lora.runtime import set_lora as value
    elif name == "lora_adapters":
        from .transforms.lora.runtime import lora_adapters as value
    elif name == "tune":  # the package, callable as its tune() (transformdsl/tune/__init__.py)
        import transformdsl.tune as value  # not ``from . import tune``: its hasattr() would come back here
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["parse", "plan", "transform", "save", "load", "convert", "set_lora", "lora_adapters", "tune", "Plan",
           "TransformError", "ScriptError", "LoadError", "__version__"]
