"""Saving and loading transformed models (format documented in spec.md "Save format").

One module per stage:

- :mod:`.format`: the format's file names, version and limits; the model description;
- :mod:`.write`: :func:`save` and the one writer of tensors and metadata (:func:`save_module`);
- :mod:`.atomic`: the temporary directory and the swap that make a save atomic;
- :mod:`.read`: :func:`load` and the one reader of saved tensors (:func:`load_module`);
- :mod:`.checks`: metadata and configuration checks, before anything is built;
- :mod:`.pipelines`: diffusers pipelines, one folder per component;
- :mod:`.contents`: :func:`inspect`, from headers only;
- :mod:`.placement`: ``load(dir, device_map=...)``: a loaded model placed over devices, CPU and disk.

A saved module is a directory holding ``transformdsl.json`` (metadata), ``script.tfm`` (the
scripts) and ``model.safetensors`` (or shards plus ``model.safetensors.index.json``).  A
pipeline is saved in the layout diffusers uses; transformed components use the format above,
the others their library's own.

Loading never unpickles or evaluates anything: metadata is JSON checked field by field,
classes are looked up by name among diffusers' and transformers' model classes only,
tensors come from safetensors.
"""

from __future__ import annotations

from .atomic import _boot_id, _renameat2_exchange
from .checks import (
                     _check_config,
                     _check_module_meta,
                     _check_record,
                     _read_json,
                     _rebuild_options,
                     _sanitized,
                     read_metadata,
)
from .contents import inspect
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
                     _model_description,
                     _versions,
                     _write_json,
)
from .read import _model_class, _module_budget, _module_limit, _TensorFiles, load, load_module, meta_copy
from .write import _collect_tensors, _shard, save, save_module

__all__ = [
    "DEFAULT_SHARD_BYTES", "FORMAT", "FORMAT_VERSION", "INDEX", "MAX_META_BYTES", "MAX_SCHEDULER_NUMBER",
    "MAX_TENSOR_FILES", "META_FILE", "SCRIPT_FILE", "WEIGHTS", "inspect", "load", "load_module", "meta_copy",
    "read_metadata", "save", "save_module",
    # used by transformdsl.interop and the tests
    "_TensorFiles", "_boot_id", "_check_config", "_check_module_meta", "_check_record", "_collect_tensors",
    "_model_class", "_model_description", "_module_budget", "_module_limit", "_read_json", "_rebuild_options",
    "_renameat2_exchange", "_sanitized", "_shard", "_versions", "_write_json",
]
