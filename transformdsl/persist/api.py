"""``save`` and ``load``: the entry points, choosing among the formats a directory may hold.

They sit above everything else in :mod:`transformdsl.persist` and :mod:`transformdsl.interop`: a module
in transformdsl's format goes through :mod:`.write`/:mod:`.read`, a pipeline through :mod:`.pipelines`,
a library's own layout through :mod:`transformdsl.interop` (which writes and reads through the same
writer and reader), and ``device_map=`` through :mod:`.placement`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import LoadError, TransformError
from ..interop import check_format
from ..interop.export import save_library_module
from ..interop.gguf_export import save_gguf
from ..interop.gguf_import import gguf_path, load_gguf
from ..interop.imports import load_library_directory
from ..planner import is_pipeline
from .atomic import writing
from .checks import read_metadata
from .format import DEFAULT_SHARD_BYTES, FORMAT, META_FILE
from .guard import loading
from .pipelines import load_pipeline, save_pipeline
from .placement import place
from .read import load_module
from .savedir import SaveDir, Vanished
from .write import save_module, write_manifest


def save(model: Any, directory: str | os.PathLike, *, max_shard_size: int = DEFAULT_SHARD_BYTES,
         format: str = FORMAT, tokenizer: Any = None) -> Path:
    """Save ``model`` (transformed or not; a module or a pipeline) to ``directory``.

    ``format="transformers"`` or ``"diffusers"`` writes what the library's stock
    ``from_pretrained`` loads without transformdsl (see :mod:`transformdsl.interop`);
    ``format="gguf"`` writes ``directory/model.gguf`` for llama.cpp (and transformers'
    ``from_pretrained(directory, gguf_file="model.gguf")``, :mod:`transformdsl.interop.gguf_export`); a
    statement the format cannot carry is a :class:`TransformError` before anything is written.
    ``tokenizer`` (``format="gguf"`` only): the Hugging Face tokenizer to write into the file; without
    it, the GGUF file the model was imported from, or the tokenizer saved beside the model, gives it.

    The write is atomic: everything is written to a temporary sibling directory, flushed,
    then swapped into place, so an interrupted save leaves any previous save intact and
    no temporary files behind.  ``directory`` must be new, empty, or a previous save (it
    is replaced as a whole).  A failure to write (disk full, permissions) is a
    :class:`TransformError` naming the directory and the cause.
    """
    check_format(format)
    if tokenizer is not None and format != "gguf":
        raise TransformError(f"save(tokenizer=...): only format='gguf' writes a tokenizer (format={format!r} saves "
                             "the model; save the tokenizer with its own save_pretrained)")
    if getattr(model, "tensor_parallel", None) is not None:
        raise TransformError("save(): this model holds one rank's tensor-parallel shards (loaded with tp_plan=); "
                             "save the model loaded without tp_plan")
    directory = Path(directory)
    with writing(directory, finish=write_manifest) as (tmp, save_id):
        if format == "gguf":
            save_gguf_model(model, tmp, tokenizer)
        elif is_pipeline(model):
            save_pipeline(model, tmp, max_shard_size, save_id, format)
        elif isinstance(model, nn.Module) and format != FORMAT:
            save_library_module(model, tmp, format, max_shard_size, save_id)
        elif isinstance(model, nn.Module):
            save_module(model, tmp, max_shard_size, save_id)
        else:
            raise TransformError(f"save() takes an nn.Module or a diffusers pipeline, not {type(model).__name__}")
    return directory


def save_gguf_model(model: Any, directory: Path, tokenizer: Any = None) -> None:
    """``save(..., format="gguf")``: one language model as ``directory/model.gguf``."""
    if not isinstance(model, nn.Module) or is_pipeline(model):
        raise TransformError(f"format='gguf' writes one language model (an nn.Module), not {type(model).__name__}")
    save_gguf(model, directory, tokenizer=tokenizer)


def load(directory: str | os.PathLike, model: nn.Module | Callable[[], nn.Module] | None = None, *,
         device: str | torch.device | None = None, mmap: bool = True, device_map: str | dict | None = None,
         max_memory: dict | None = None, offload_folder: str | os.PathLike | None = None,
         tp_plan: str | dict | None = None, distributed_config: Any = None) -> Any:
    """Load a model saved by :func:`save`; returns a new module (or pipeline).

    ``directory`` may also be a GGUF file (llama.cpp's), or a ``format="gguf"`` save's directory:
    its Q8_0/Q4_0 linear layers are kept as ``quantize q8_0``/``q4_0`` layers, the rest read as
    float32 (:mod:`transformdsl.interop.gguf_import`).

    The architecture is rebuilt from the saved configuration (diffusers and transformers
    models), or from ``model``: a module used as a template (it is not modified: its
    structure is copied onto the meta device) or a factory called with no arguments.
    Each transform's structure is replayed without recomputation and the saved tensors
    are loaded as they are.  Any problem raises :class:`LoadError` saying what is wrong.

    The directory is opened once and every file is read through that descriptor (see
    :mod:`.savedir`), so a load sees one save, never a mix of two; if a concurrent
    :func:`save` replaces it while it is read, the load starts over on the new one.
    Library calls run with the hub offline and standard input closed (:mod:`.guard`);
    nothing from the directory is imported or executed.

    With ``mmap=True`` (the default) tensors on the CPU are memory-mapped from the saved
    files (copy on write): do not truncate or rewrite those files in place while the model
    is in use (:func:`save` never does; it writes a new directory and swaps it in).

    ``device_map`` (instead of ``device``) spreads the model over devices, CPU and disk the way
    ``from_pretrained(device_map=...)`` does: ``"auto"`` (accelerate computes the map from
    ``max_memory``, never splitting a transformed layer or a module of ``_no_split_modules``) or a
    dict ``{module path: device | "cpu" | "disk" | "meta"}``; ``"disk"`` modules are kept in
    ``offload_folder`` and read from there at each call.  Quantized layers stay quantized where
    they land.  See :mod:`.placement` and spec.md "Placing a model over devices".

    ``tp_plan="auto"`` (or a dict ``{module pattern: style}``, or transformers'
    ``distributed_config=DistributedConfig(tp_plan=...)``), in each process of ``torchrun
    --nproc-per-node N``: the model is sharded tensor-parallel over the ranks as the model's
    transformers plan shards it, transformed layers included; a layer that cannot be sharded is a
    LoadError naming it, in every rank.  See :mod:`transformdsl.parallel` and spec.md "Past one device".
    """
    directory = Path(directory)
    if tp_plan is not None or distributed_config is not None:
        if device_map is not None or max_memory is not None or offload_folder is not None:
            raise LoadError("load(tp_plan=..., device_map=...): give one of them (tensor parallelism places "
                            "each rank's shards on that rank's device)")
        from ..parallel.runtime import load_tensor_parallel

        return load_tensor_parallel(lambda on: _load(directory, model, on, mmap), tp_plan, distributed_config, device)
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            raise LoadError("load(max_memory=..., offload_folder=...): these place a model with device_map=; "
                            "add device_map='auto'")
        return _load(directory, model, _check_device(device or "cpu"), mmap)
    if device is not None:
        raise LoadError("load(device=..., device_map=...): give one of device= and device_map= "
                        "(device_map={'': 'cuda:0'} is device='cuda:0')")
    if offload_folder is not None and Path(offload_folder).resolve().is_relative_to(directory.resolve()):
        raise LoadError(f"load(offload_folder={str(offload_folder)!r}): inside the directory being loaded, "
                        f"{directory}; offloading there would write into it: give a directory of its own")
    loaded = _load(directory, model, torch.device("cpu"), mmap)
    if not isinstance(loaded, nn.Module):
        raise LoadError(f"{directory}: device_map= places one model; this is a pipeline: load it, then place "
                        "its components with transformdsl.persist.placement.place(component, device_map, ...)")
    return place(loaded, device_map, max_memory=max_memory, offload_folder=offload_folder)


def _load(directory: Path, model: Any, device: torch.device, mmap: bool) -> Any:
    """:func:`load` on one device."""
    gguf_file = gguf_path(directory)
    if gguf_file is not None:
        if model is not None:
            raise LoadError(f"{gguf_file}: a GGUF checkpoint is rebuilt from its metadata; drop model=")
        with loading():
            return load_gguf(gguf_file).to(device)
    for attempt in range(_LOAD_ATTEMPTS):
        try:
            with loading(), SaveDir.open(directory) as folder:
                if not folder.exists(META_FILE) and folder.exists("config.json"):
                    return load_library_directory(folder, model, device, mmap)
                meta = read_metadata(folder)
                if meta["kind"] == "pipeline":
                    if model is not None:
                        raise LoadError(f"{directory}: a saved pipeline is loaded from its files alone; drop model=")
                    return load_pipeline(folder, meta, device, mmap)
                return load_module(folder, meta, model, device, mmap)
        except Vanished:
            if attempt == _LOAD_ATTEMPTS - 1:
                raise
        except OSError as exc:  # anything the checks above did not name
            raise LoadError(f"{directory}: cannot read the save: {exc.strerror or exc}") from None
    raise AssertionError("unreachable")  # pragma: no cover


#: A load restarts when a concurrent save replaces the directory under it; this often.
_LOAD_ATTEMPTS = 5


def _check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device that exists on this machine, else a LoadError naming it."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise LoadError(f"load(device={device!r}): not a device: {exc}") from None
    kind, index = parsed.type, parsed.index
    if kind == "cpu":
        if index not in (None, 0):
            raise LoadError(f"load(device={device!r}): this machine has one CPU device, 'cpu'")
        return parsed
    if kind == "meta":
        raise LoadError(f"load(device={device!r}): the meta device holds no data; load to 'cpu' or an accelerator")
    backend = getattr(torch, kind, None)
    available = getattr(backend, "is_available", None)
    count = getattr(backend, "device_count", None)
    if not (callable(available) and available()):
        raise LoadError(f"load(device={device!r}): no {kind} device on this machine; use device='cpu'")
    if index is not None and callable(count) and index >= count():
        raise LoadError(f"load(device={device!r}): this machine has {count()} {kind} device(s) "
                        f"({kind}:0 to {kind}:{count() - 1})")
    return parsed



