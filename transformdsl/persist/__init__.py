"""Saving and loading transformed models (format documented in spec.md "Save format").

One module per stage, from the foundations up (a module imports only those above it in this list):

- :mod:`.savedir`: a save's directory opened once, every file read through it;
- :mod:`.safetensors_io`: aligned safetensors writing; :mod:`.plain_tensors`: tensors held as module
  attributes; :mod:`.guard`: library calls with the hub offline and standard input closed;
- :mod:`.format`: the format's file names, version and limits; the model description;
- :mod:`.checks`: metadata and configuration checks, before anything is built;
- :mod:`.atomic`: the temporary directory and the swap that make a save atomic;
- :mod:`.write`: the one writer of tensors and metadata (:func:`save_module`);
- :mod:`.read`: the one reader of saved tensors (:func:`load_module`);
- :mod:`transformdsl.interop` (beside this package): saves in a library's layout, and library
  checkpoints read as saves, through the same writer and reader;
- :mod:`.pipelines`: diffusers pipelines, one folder per component;
- :mod:`.placement`: ``load(dir, device_map=...)``: a loaded model placed over devices, CPU and disk;
- :mod:`.api`: :func:`save` and :func:`load`, which choose among the above;
- :mod:`.contents`: :func:`inspect`, from headers only.

:func:`transformdsl.convert` (a checkpoint through a script into a save, unit by unit, through the
same reader and writer) runs transforms, so it stands above both the executor and this package, in
:mod:`transformdsl.streaming`.

A saved module is a directory holding ``transformdsl.json`` (metadata), ``script.tfm`` (the
scripts) and ``model.safetensors`` (or shards plus ``model.safetensors.index.json``).  A
pipeline is saved in the layout diffusers uses; transformed components use the format above,
the others their library's own.

Loading never unpickles or evaluates anything: metadata is JSON checked field by field,
classes are looked up by name among diffusers' and transformers' model classes only,
tensors come from safetensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .checks import read_metadata
from .format import (
    DEFAULT_SHARD_BYTES,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    MAX_META_BYTES,
    MAX_SCHEDULER_NUMBER,
    MAX_TENSOR_FILES,
    META_FILE,
    SCRIPT_FILE,
    WEIGHTS,
)
from .read import load_module, meta_copy
from .write import save_module

if TYPE_CHECKING:  # pragma: no cover
    from .api import load, save
    from .contents import inspect


def __getattr__(name: str):
    """``save``, ``load`` and ``inspect``, imported on first access: they stand above
    :mod:`transformdsl.interop`, which imports this package's foundations; importing those must not
    run the stages above them."""
    if name in ("save", "load"):
        from . import api as module
    elif name == "inspect":
        from . import contents as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value

__all__ = [
    "DEFAULT_SHARD_BYTES", "FORMAT", "FORMAT_VERSION", "INDEX", "MAX_META_BYTES", "MAX_SCHEDULER_NUMBER",
    "MAX_TENSOR_FILES", "META_FILE", "SCRIPT_FILE", "WEIGHTS", "inspect", "load", "load_module", "meta_copy",
    "read_metadata", "save", "save_module",
]
