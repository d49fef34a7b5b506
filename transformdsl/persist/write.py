"""Saving a module: the one writer of saved tensors and metadata."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import plain_tensors
from ..errors import TransformError
from ..executor import History, history_of
from ..planner import is_pipeline
from ..safetensors_io import save_aligned
from .atomic import (
    _TMP_MARKER,
    _boot_id,
    _boot_tag,
    _check_target,
    _fsync_tree,
    _remove_stale_temporaries,
    _save_error,
    _swap_into_place,
    _umask,
    _write_manifest,
)
from .format import (
    DEFAULT_SHARD_BYTES,
    FORMAT,
    INDEX,
    META_FILE,
    SCRIPT_FILE,
    WEIGHTS,
    _model_description,
    _versions,
    _write_json,
)


def save(model: Any, directory: str | os.PathLike, *, max_shard_size: int = DEFAULT_SHARD_BYTES,
         format: str = FORMAT) -> Path:
    """Save ``model`` (transformed or not; a module or a pipeline) to ``directory``.

    ``format="transformers"`` or ``"diffusers"`` writes what the library's stock
    ``from_pretrained`` loads without transformdsl (see :mod:`transformdsl.interop`); a
    statement the format cannot carry is a :class:`TransformError` before anything is written.

    The write is atomic: everything is written to a temporary sibling directory, flushed,
    then swapped into place, so an interrupted save leaves any previous save intact and
    no temporary files behind.  ``directory`` must be new, empty, or a previous save (it
    is replaced as a whole).  A failure to write (disk full, permissions) is a
    :class:`TransformError` naming the directory and the cause.
    """
    from ..interop import check_format

    check_format(format)
    directory = Path(directory)
    final = directory.resolve()
    _check_target(final)
    save_id = uuid.uuid4().hex
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(final)
        # The writer's identity is in the name itself, so a kill at any moment (even before
        # the marker below is written, or while a finished swap is being removed) leaves a
        # directory that the next save recognises as ours and removes.
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}.{_boot_tag()}.", dir=final.parent))
    except OSError as exc:
        raise _save_error(final, exc) from exc
    try:
        # mkdtemp makes 0700 folders; a save is shared like any folder the user makes.
        os.chmod(tmp, 0o777 & ~_umask())
        (tmp / _TMP_MARKER).write_text(f"{os.getpid()} {_boot_id()}\n")
        if is_pipeline(model):
            from .pipelines import _save_pipeline

            _save_pipeline(model, tmp, max_shard_size, save_id, format)
        elif isinstance(model, nn.Module) and format != FORMAT:
            from ..interop.export import save_library_module

            save_library_module(model, tmp, format, max_shard_size)
        elif isinstance(model, nn.Module):
            save_module(model, tmp, max_shard_size, save_id)
        else:
            raise TransformError(f"save() takes an nn.Module or a diffusers pipeline, not {type(model).__name__}")
        _write_manifest(tmp)
        _fsync_tree(tmp)
        (tmp / _TMP_MARKER).unlink()
        _swap_into_place(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(final, exc) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory



def save_module(module: nn.Module, directory: Path, max_shard_size: int = DEFAULT_SHARD_BYTES,
                save_id: str | None = None) -> None:
    """Write one module in the transformdsl format into an existing empty ``directory``.

    ``save_id`` (a fresh one by default) is written into the metadata and every tensor
    file, so that a reader can tell files of two saves apart.
    """
    save_id = save_id or uuid.uuid4().hex
    history = history_of(module) or History([], [])
    tensors, layout = _collect_tensors(module)
    shards = _shard(tensors, max_shard_size)
    if len(shards) == 1:
        save_aligned(shards[0], directory / WEIGHTS, metadata={"format": "pt", "save_id": save_id})
        files = [WEIGHTS]
    else:
        files = []
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_aligned(shard, directory / name, metadata={"format": "pt", "save_id": save_id})
            files.append(name)
            weight_map.update({key: name for key in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_json(directory / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    meta = {
        "format": FORMAT,
        "format_version": 2 if plain_tensors.saved_names(layout.get("attributes", {})) else 1,
        "kind": "module",
        "model": _model_description(module),
        "scripts": history.scripts,
        "steps": [s.to_json() for s in history.steps],
        "tensors": {"files": files, **layout},
        "versions": _versions(),
        "save_id": save_id,
    }
    (directory / SCRIPT_FILE).write_text("\n".join(history.scripts) + ("\n" if history.scripts else ""))
    _write_json(directory / META_FILE, meta)


def _collect_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """state_dict plus non-persistent buffers, with shared tensors stored once."""
    state = module.state_dict()
    nonpersistent = []
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if name not in state and buffer is not None:
            state[name] = buffer
            nonpersistent.append(name)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TransformError(f"cannot save '{key}': state_dict value is a {type(tensor).__name__}, not a tensor")
        if tensor.device.type == "meta":
            raise TransformError(f"cannot save '{key}': it is on the meta device (no data)")
        tensor = tensor.detach()
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()), tensor.dtype) if tensor.numel() else None
        if identity is not None and identity in seen:
            aliases[key] = seen[identity]
            continue
        if identity is not None:
            seen[identity] = key
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensors[key] = tensor.contiguous()
    layout = {"nonpersistent": sorted(nonpersistent), "aliases": aliases}
    # Tensors held as plain attributes (not parameters or buffers): see plain_tensors.py.
    attribute_tensors, attributes = plain_tensors.collect(module)
    if attributes:
        clash = sorted(set(attribute_tensors) & (set(tensors) | set(aliases)))
        if clash:
            raise TransformError(f"cannot save attribute tensor '{clash[0]}': its name is also a state_dict key")
        tensors.update({key: t.cpu().contiguous() for key, t in attribute_tensors.items()})
        layout["attributes"] = attributes
    # safetensors refuses tensors sharing memory; distinct views of one storage are copied.
    tensors = _unshare(tensors)
    return tensors, layout


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    by_storage: dict[int, list[str]] = {}
    for key, tensor in tensors.items():
        if tensor.numel():
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(key)
    for keys in by_storage.values():
        for key in keys[1:]:
            tensors[key] = tensors[key].clone()
    return tensors


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards
