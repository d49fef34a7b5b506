"""The save format's names and limits, and the metadata every save describes its model with.

See spec.md "Save format".  A saved module is a directory holding:

- ``transformdsl.json``: metadata (format version, scripts, the applied steps and their
  records, the base model's class and configuration, library versions, tensor layout);
- ``script.tfm``: the script(s) as written;
- ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` plus
  ``model.safetensors.index.json`` above ``max_shard_size``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..version import __version__

FORMAT = "transformdsl"
#: The newest format this version reads.  A save writes the lowest version that can read it:
#: 2 only when it stores tensors held as plain module attributes (``tensors.attributes``).
FORMAT_VERSION = 2
META_FILE = "transformdsl.json"
SCRIPT_FILE = "script.tfm"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: Metadata files larger than this are refused before parsing.
MAX_META_BYTES = 64 * 1024 * 1024
DEFAULT_SHARD_BYTES = 5 * 1024**3



#: Largest number (and longest list) a scheduler configuration may hold: real ones
#: count training steps in thousands.
MAX_SCHEDULER_NUMBER = 1e6
#: Files a module's metadata may list.
MAX_TENSOR_FILES = 10_000



def model_description(module: nn.Module) -> dict:
    """Library, class and configuration: enough for load() to rebuild the architecture."""
    cls = type(module)
    library = cls.__module__.split(".", 1)[0]
    config = getattr(module, "config", None)
    if library == "diffusers" and config is not None:
        described = json.loads(json.dumps(dict(config), default=_json_default))
        if isinstance(described.get("_use_default_values"), list):  # diffusers makes it from a set: sorted
            described["_use_default_values"] = sorted(described["_use_default_values"], key=str)
        return {"library": "diffusers", "class": cls.__name__, "config": described}
    if library == "transformers" and config is not None and hasattr(config, "to_json_string"):
        return {"library": "transformers", "class": cls.__name__, "config": json.loads(config.to_json_string())}
    return {"library": None, "class": cls.__name__, "config": None}


def _json_default(value):
    if isinstance(value, set):  # a set's order changes from process to process: the save's bytes must not
        return sorted(value, key=str)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def library_versions() -> dict:
    from importlib import metadata

    out = {"transformdsl": __version__}
    for name in ("torch", "safetensors", "diffusers", "transformers", "bitsandbytes", "hqq"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out



def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=False, default=_json_default))



def clipped(value: Any, limit: int = 80) -> str:
    """``repr(value)``, shortened: hostile files may hold megabytes in one field."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
