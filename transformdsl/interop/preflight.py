"""A library directory's configuration checked against its safetensors headers before the model is
built for real.

A model's constructor allocates what its configuration says: buffers computed at build time
(position ids, positional tables) are real tensors even when the weights are left empty, and
``from_pretrained`` allocates every weight before it reads the files.  A ``config.json`` edited to
``max_position_embeddings: 1e8`` (BERT: 2.3 GB) or ``pos_embed_max_size: 2048`` (SD3: 2.1 GB) cost that
memory before the mismatch with the weights was noticed.  :func:`check_shapes` builds the model on
the meta device first (nothing is allocated; the number of modules is bounded) and compares every
floating tensor the headers hold with the shape the configuration gives it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..errors import LoadError

#: safetensors dtypes whose shapes are the model's own (packed or quantized data is not compared).
_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: Elements a configuration may describe beyond what the files hold (buffers computed at build time).
_UNBACKED_SLACK = 64 * 2**20


def check_shapes(cls: type, library: str, config: Any, shapes: dict[str, tuple[str, list[int]]], path: Path,
                 max_modules: int) -> None:
    """Refuse (:class:`LoadError`) a configuration that gives a saved floating tensor another shape, or
    describes far more elements than the files hold (over theirs plus 64 Mi).  ``shapes``: tensor name →
    (safetensors dtype, shape), from the headers.  A configuration the library cannot build on the
    meta device is left to the real build to report."""
    from ..persist.read import module_limit, no_weight_init

    try:
        with torch.device("meta"), module_limit(max_modules, path), no_weight_init():
            if library == "diffusers":
                model = cls.from_config(config)
            else:
                model = cls(cls.config_class.from_dict(config) if isinstance(config, dict) else config)
    except LoadError:
        raise
    except Exception:
        return
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    saved = sum(math.prod(shape) for _, shape in shapes.values())
    unbacked = 0
    for key, tensor in (*model.named_parameters(), *model.named_buffers()):
        found = _lookup(shapes, key, prefix)
        if found is None:
            unbacked += tensor.numel()
            continue
        dtype, shape = found
        if dtype in _FLOATS and tensor.is_floating_point() and list(tensor.shape) != list(shape):
            name = _FLOATS[dtype]  # the file's precision on both sides: the model is read in it
            raise LoadError(f"{path}: tensor '{key}' is {name}{list(shape)} in the file but the model expects "
                            f"{name}{list(tensor.shape)} (from the configuration, checked before building it); was "
                            "the configuration edited, or does it belong to another checkpoint?")
    if unbacked > saved + _UNBACKED_SLACK:
        raise LoadError(f"{path}: the configuration describes {unbacked:,} elements that the weights files do not "
                        f"hold (they hold {saved:,}); refusing to build it")


def _lookup(shapes: dict, key: str, prefix: str):
    if key in shapes:
        return shapes[key]
    if prefix:  # a base model's weights read into a model with a head, or the reverse
        if key.startswith(prefix + "."):
            return shapes.get(key[len(prefix) + 1:])
        return shapes.get(f"{prefix}.{key}")
    return None
