"""Saving a module: the one writer of saved tensors and metadata."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import TransformError
from ..history import History, history_of
from . import plain_tensors
from .atomic import TMP_MARKER
from .format import (
    DEFAULT_SHARD_BYTES,
    FORMAT,
    INDEX,
    META_FILE,
    SCRIPT_FILE,
    WEIGHTS,
    library_versions,
    model_description,
    write_json,
)
from .safetensors_io import StreamingWriter, save_aligned


def save_module(module: nn.Module, directory: Path, max_shard_size: int = DEFAULT_SHARD_BYTES,
                save_id: str | None = None) -> None:
    """Write one module in the transformdsl format into an existing empty ``directory``.

    ``save_id`` (a fresh one by default) is written into the metadata and every tensor
    file, so that a reader can tell files of two saves apart.
    """
    save_id = save_id or uuid.uuid4().hex
    tensors, layout = collect_tensors(module)
    writer = ShardWriter(directory, max_shard_size, save_id)
    writer.add(tensors)
    write_module_metadata(directory, module, writer.finish(), layout, save_id)


def write_module_metadata(directory: Path, module: nn.Module, files: list[str], layout: dict, save_id: str | None,
                          history: History | None = None, interop: dict | None = None) -> None:
    """``transformdsl.json`` and ``script.tfm`` of a saved module whose tensor ``files`` are written: the one
    writer of a module's metadata, for every format (``save``, ``convert``, a library's layout).

    ``layout`` is what :func:`collect_tensors` returns beside the tensors (or a library layout's own
    ``tensors`` fields); ``history`` is the module's own (:func:`~transformdsl.history.history_of`) unless
    given; ``interop``: how a library layout carries the steps (``{"format": ..., "notes": [...]}``).
    """
    history = history or history_of(module) or History([], [])
    meta = {
        "format": FORMAT,
        "format_version": format_version(layout),
        "kind": "module",
        "model": model_description(module),
        "scripts": history.scripts,
        "steps": [s.to_json() for s in history.steps],
        "tensors": {"files": files, **layout},
        **({"interop": interop} if interop is not None else {}),
        "versions": library_versions(),
        **({"save_id": save_id} if save_id is not None else {}),
    }
    (directory / SCRIPT_FILE).write_text("\n".join(history.scripts) + ("\n" if history.scripts else ""))
    write_json(directory / META_FILE, meta)


def format_version(layout: dict) -> int:
    """The lowest format version that reads a save of this tensor ``layout`` (spec.md, "Save format"):
    2 when it stores tensors held as plain module attributes, else 1."""
    return 2 if plain_tensors.saved_names(layout.get("attributes", {})) else 1


def write_pipeline_metadata(directory: Path, pipeline_class: str, components: dict[str, str], save_id: str) -> None:
    """The ``transformdsl.json`` of a saved pipeline (``save`` and ``convert``): its class and how each
    component is saved (``"transformdsl"`` or ``"library"``); its components' own metadata say what
    format version they need."""
    write_json(directory / META_FILE, {
        "format": FORMAT, "format_version": 1, "kind": "pipeline", "pipeline_class": pipeline_class,
        "components": components, "versions": library_versions(), "save_id": save_id,
    })


class ShardWriter:
    """The tensor files of one saved module, written in the order tensors are added.

    A shard is closed when the next tensor would take it over ``max_shard_size`` bytes (a
    larger tensor gets a shard of its own).  :meth:`finish` names the files:
    ``model.safetensors`` alone, or ``model-0000i-of-0000N.safetensors`` and the index
    ``model.safetensors.index.json``, and returns their names.

    By default tensors are held until :meth:`finish` writes each shard in one go (``save``:
    the model is in memory anyway).  With ``stream=True`` each tensor's bytes go to disk
    when it is added and nothing is held (``convert``); the files are the same.

    ``names``: the single file, the index and the shards' stem (a library's layout names them its
    own way: ``diffusion_pytorch_model...``); ``aligned=False`` writes plain safetensors files, as
    the library's ``save_pretrained`` does (no alignment padding: its loader reads every key),
    without a ``save_id`` when it is None.
    """

    def __init__(self, directory: Path, max_shard_size: int, save_id: str | None, stream: bool = False, *,
                 names: tuple[str, str, str] = (WEIGHTS, INDEX, "model"), aligned: bool = True):
        self.directory = directory
        self.max_shard_size = max_shard_size
        self.metadata = {"format": "pt", **({"save_id": save_id} if save_id is not None else {})}
        self.stream = stream
        self.names = names
        self.aligned = aligned
        if stream and not aligned:
            raise ValueError("a streamed shard is written aligned")
        self.shards: list[dict[str, torch.Tensor]] = []  # held tensors (or, streaming, their names)
        self.writers: list[StreamingWriter] = []
        self.size = 0  # bytes in the last shard
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if not self.shards or (self.shards[-1] and self.size + nbytes > self.max_shard_size):
                self._new_shard()
            self.shards[-1][key] = None if self.stream else tensor
            if self.stream:
                self.writers[-1].add(key, tensor)
            self.size += nbytes
            self.total += nbytes

    def _new_shard(self) -> None:
        if self.stream and self.writers:
            self.writers[-1].close()
        self.shards.append({})
        self.size = 0
        if self.stream:
            self.writers.append(StreamingWriter(self.directory / f".shard-{len(self.shards):05d}.safetensors",
                                                self.metadata))

    def finish(self) -> list[str]:
        """Write what is left; the files' names, in order."""
        if not self.shards:
            self._new_shard()
        if self.stream:
            self.writers[-1].close()
        count = len(self.shards)
        single, index, stem = self.names
        names = [single] if count == 1 else [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        for i, (name, shard) in enumerate(zip(names, self.shards)):
            if self.stream:
                os.rename(self.writers[i].path, self.directory / name)
            elif self.aligned:
                save_aligned(shard, self.directory / name, metadata=self.metadata)
            else:
                from safetensors.torch import save_file

                save_file(shard, str(self.directory / name), metadata=self.metadata)
        if count > 1:
            weight_map = {key: name for name, shard in zip(names, self.shards) for key in shard}
            write_json(self.directory / index, {"metadata": {"total_size": self.total}, "weight_map": weight_map})
        return names


def collect_tensors(module: nn.Module, only: Callable[[str], bool] | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict]:
    """state_dict plus non-persistent buffers, with shared tensors stored once; and their layout
    (non-persistent names, aliases, plain attributes).

    With ``only``, just the tensors (and plain attributes) whose names it accepts: a part of
    the module (``convert`` writes a model unit by unit; tensors shared with another part must
    be in the same one).
    """
    state = module.state_dict()
    nonpersistent = []
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if name not in state and buffer is not None:
            state[name] = buffer
            nonpersistent.append(name)
    if only is not None:
        state = {key: tensor for key, tensor in state.items() if only(key)}
        nonpersistent = [name for name in nonpersistent if only(name)]
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
    if only is not None:
        attributes = {name: how for name, how in attributes.items() if only(name)}
        attribute_tensors = {key: t for key, t in attribute_tensors.items()
                             if any(key == name or key.startswith(name + ".") for name in attributes)}
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


def write_manifest(directory: Path) -> None:
    """List every file of the save written in ``directory`` in its ``transformdsl.json`` (``manifest``):
    what a later save may replace is exactly that (:mod:`.atomic`).  Runs last, when every file is there
    (``atomic.writing(..., finish=write_manifest)``); a save without our metadata (``format="gguf"``) has
    none."""
    path = directory / META_FILE
    if not path.is_file():
        return
    meta = json.loads(path.read_text())
    meta["manifest"] = sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                              if not p.is_dir() and p != path and p.relative_to(directory) != Path(TMP_MARKER))
    write_json(path, meta)
