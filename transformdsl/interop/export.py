"""``save(model, dir, format="transformers" | "diffusers")``: a directory the stock library loads.

Each transform says how it is carried: its ``export`` classmethod (``Transform.export``, in its family's
folder) renames or splits tensors into the library's layout, adds a note, or asks for the checkpoint's one
``quantization_config``; a transform without one is refused.  spec.md "Interchange" has the matrix:

- ``quantize int8|nf4|fp4`` (``transforms/quantize/export.py``): the library's own bitsandbytes
  serialization, with a skip list checked against the library's rules (:mod:`.rules`); ``hqq`` refused;
- ``fp8 storage|native`` (``transforms/fp8/export.py``): transformers' fp8 format, or compressed-tensors';
- ``fuse qkv`` (``transforms/qkv/export.py``): written back unfused (exact);
- ``fuse bias_*`` and ``compile``: nothing to store; a note says what ``load`` does again.

The script and our metadata are written too, with the key mapping in ``tensors.layout``
(:mod:`.layout`), so :func:`transformdsl.load` restores the transformed model exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from .. import registry
from ..errors import TransformError
from ..history import History, history_of
from ..persist import plain_tensors
from ..persist.format import (
    write_json,
)
from ..persist.write import ShardWriter, collect_tensors, write_module_metadata
from . import CONFIG_FILE, rules
from .hook_types import Exported, QuantizationExport  # noqa: F401  (importable from here, as before)
from .rules import kept_in_float  # noqa: F401  (importable from here, as before)

#: Weight files each library reads (single file, and the sharded index).
WEIGHTS = {"transformers": ("model.safetensors", "model.safetensors.index.json", "model"),
           "diffusers": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
                         "diffusion_pytorch_model")}
#: Tensors the library does not read (non-persistent buffers): in a file of ours.
EXTRA = "transformdsl.extra.safetensors"


def library_of(module: nn.Module) -> str | None:
    library = type(module).__module__.split(".", 1)[0]
    return library if library in WEIGHTS and getattr(module, "config", None) is not None else None


def export(module: nn.Module, fmt: str) -> Exported:
    """``module`` (transformed or not) in format ``fmt``'s layout; a :class:`TransformError` saying
    which statement the format cannot carry, and what to do, when it cannot.

    ``fmt`` is a library (``"transformers"``, ``"diffusers"``), or ``"compressed-tensors"``: a
    transformers model whose fp8 layers are written in compressed-tensors' ``float-quantized``
    format (per output channel), which transformers loads when the compressed-tensors package is
    installed (and vLLM serves)."""
    library = "transformers" if fmt == "compressed-tensors" else fmt
    own = library_of(module)
    if own != library:
        what = f"a {own} model" if own else f"{type(module).__name__}, not a diffusers or transformers model"
        fix = f"use format={own!r}" if own else "save with format='transformdsl'"
        raise TransformError(f"format={library!r}: this is {what}; {fix}")
    history = history_of(module) or History([], [])
    tensors, layout = collect_tensors(module)
    extra = {name: tensors.pop(name) for name in layout["nonpersistent"]}
    # Plain tensor attributes go beside the non-persistent buffers (stock loaders recompute them).
    extra.update({name: tensors.pop(name) for name in plain_tensors.saved_names(layout.get("attributes", {}))})
    aliases = dict(layout["aliases"])
    if library == "diffusers":  # diffusers ties nothing on load: store tied tensors under each name
        for key, target in aliases.items():
            tensors[key] = tensors[target].clone()
        aliases = {}
    out = Exported(library, fmt, tensors, extra, _config(module, library), aliases=aliases,
                   attributes=layout.get("attributes", {}))
    for step in history.steps:
        registry.get(step.key).export(step, out)
    kinds = sorted({q.kind for q in out.quantization})
    if len({q.group for q in out.quantization}) > 1:
        raise TransformError(f"format={library!r}: a {library} checkpoint has one quantization_config, and the "
                             f"script quantizes with {' and '.join(kinds)} (or with different options); use one "
                             "quantize statement's mode and options, or save with format='transformdsl'")
    # The layers as the library names them: fused projections written back as their sources.
    quantized = {path for q in out.quantization for path in q.paths}
    layers = set(rules.convertible(module, conv1d=library == "transformers"
                                   and all(q.conv1d for q in out.quantization)))
    for fused, sources in out.renames.items():
        for paths in (quantized, layers):
            if fused in paths:
                paths.discard(fused)
                paths.update(sources)
    if out.quantization:
        out.config["quantization_config"] = out.quantization[0].config(out, module, layers, quantized)
    return out


def _config(module: nn.Module, library: str) -> dict:
    if library == "diffusers":
        config = json.loads(module.to_json_string())
    else:
        config = json.loads(module.config.to_json_string())
        config["architectures"] = [type(module).__name__]
    config.pop("quantization_config", None)
    return config


def save_library_module(module: nn.Module, directory: Path, fmt: str, max_shard_size: int,
                        save_id: str | None = None) -> list[str]:
    """Write ``module`` into the existing empty ``directory`` in format ``fmt``'s layout, with our
    metadata beside (through the writers of :mod:`transformdsl.persist.write`); returns the notes (how
    each statement was carried)."""
    from safetensors.torch import save_file

    exported = export(module, fmt)
    writer = ShardWriter(directory, max_shard_size, None, names=WEIGHTS[exported.library], aligned=False)
    writer.add(exported.tensors)
    files = writer.finish()
    if exported.extra:
        save_file(exported.extra, str(directory / EXTRA), metadata={"format": "pt"})
        files.append(EXTRA)
    write_json(directory / CONFIG_FILE, exported.config)
    layout = {"aliases": exported.aliases, "layout": exported.layout,
              "nonpersistent": sorted(set(exported.extra) - set(plain_tensors.saved_names(exported.attributes))),
              **({"attributes": exported.attributes} if exported.attributes else {})}
    write_module_metadata(directory, module, files, layout, save_id, interop={"format": fmt, "notes": exported.notes})
    return exported.notes
