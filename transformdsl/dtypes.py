"""Which floating dtype a model is read in, and which one it holds.

``--model DIR`` keeps the checkpoint's dtype unless ``--dtype`` says otherwise, as :func:`load` and
``convert`` do (diffusers' ``from_pretrained`` would read a bf16 checkpoint in float32: twice the
memory, and a "quantized" result larger than its input).  The checkpoint's dtype is read from the
safetensors headers alone (bounded: nothing is mapped, no tensor is read).

Importing this module imports no torch.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Any

#: ``--dtype`` values (and their short spellings) -> torch dtype name.
CHOICES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
#: safetensors' names of the floating dtypes a model is read in.
_FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
#: A header larger than this is not read (safetensors' own limit is 100 MB).
_MAX_HEADER = 100 * 2**20
#: At most this many weight files are read per directory.
_MAX_FILES = 1000


def parse_dtype(text: str):
    """``--dtype`` text -> a torch dtype, or None for ``auto`` (the checkpoint's own)."""
    name = text.strip().lower()
    if name == "auto":
        return None
    if name not in CHOICES:
        raise ValueError(f"--dtype {text}: expected auto, float32, bfloat16 or float16")
    import torch

    return getattr(torch, CHOICES[name])


def checkpoint_dtype(directory: str | os.PathLike) -> str | None:
    """The floating dtype holding most elements in ``directory``'s ``*.safetensors`` files (``"bfloat16"``),
    or None when it holds none (or none can be read: the loader then says why)."""
    directory = Path(directory)
    counts: Counter = Counter()
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))[:_MAX_FILES]
    except OSError:
        return None
    for name in names:
        path = directory / name
        if path.is_symlink() or not path.is_file():
            continue  # the loader decides about links; a dtype is not worth following one
        for dtype, elements in _header_counts(path).items():
            counts[dtype] += elements
    return counts.most_common(1)[0][0] if counts else None


def _header_counts(path: Path) -> Counter:
    counts: Counter = Counter()
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return counts
            (size,) = struct.unpack("<Q", head)
            if size > _MAX_HEADER:
                return counts
            header = json.loads(f.read(size))
    except (OSError, ValueError, RecursionError):  # RecursionError: a header `[[[[...` thousands deep
        return counts
    if not isinstance(header, dict):
        return counts
    for key, entry in header.items():
        if key == "__metadata__" or not isinstance(entry, dict):
            continue
        dtype = _FLOAT_NAMES.get(entry.get("dtype"))
        shape = entry.get("shape")
        if dtype and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape):
            elements = 1
            for d in shape:
                elements *= d
            counts[dtype] += elements
    return counts


def model_dtypes(model: Any) -> dict[str, str]:
    """Component name (``""`` for a plain module) -> the floating dtype holding most of its parameters."""
    from torch import nn

    modules = {"": model} if isinstance(model, nn.Module) else {
        k: v for k, v in getattr(model, "components", {}).items() if isinstance(v, nn.Module)}
    result = {}
    for name, module in modules.items():
        counts: Counter = Counter()
        for tensor in module.parameters():
            if tensor.dtype.is_floating_point:
                counts[str(tensor.dtype).removeprefix("torch.")] += tensor.numel()
        if counts:
            result[name] = counts.most_common(1)[0][0]
    return result


def describe(dtypes: dict[str, str]) -> str:
    """``{"": "bfloat16"}`` -> ``"bfloat16"``; a pipeline's: the most common, then the exceptions."""
    if not dtypes:
        return ""
    main = Counter(dtypes.values()).most_common(1)[0][0]
    others = ", ".join(f"{k}: {v}" for k, v in dtypes.items() if v != main)
    return f"{main} ({others})" if others else main


def cast(model: Any, dtype) -> Any:
    """``model`` (a module or a pipeline's modules) with its floating tensors in ``dtype``."""
    from torch import nn

    modules = [model] if isinstance(model, nn.Module) else [
        v for v in getattr(model, "components", {}).values() if isinstance(v, nn.Module)]
    for module in modules:
        module.to(dtype=dtype)
    return model


def meta_parameters_to(module: Any, dtype_name: str) -> None:
    """Give ``module``'s floating meta-device parameters the dtype ``dtype_name`` (a skeleton whose
    weights are read later, as they are: so that its plan counts the bytes the checkpoint holds).
    Tied parameters stay tied; buffers (computed by the constructor) are left alone."""
    import torch
    from torch import nn

    dtype = getattr(torch, dtype_name)
    replaced: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta or not param.dtype.is_floating_point or param.dtype == dtype:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(torch.empty_like(param, device="meta", dtype=dtype),
                                                   requires_grad=param.requires_grad)
            sub._parameters[name] = replaced[id(param)]
