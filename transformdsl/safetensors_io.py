"""Writing safetensors files whose tensors start on 64-byte boundaries.

The safetensors format places tensors back to back after a JSON header, so their byte
offsets are arbitrary.  Memory-mapped, such tensors are misaligned, and CPU kernels take
different code paths for misaligned data: results change in the last bit.  This writer
produces standard safetensors files (read by the official library, which validates them)
in which every tensor is aligned: the header is padded with spaces (allowed by the
format) and small ``uint8`` padding tensors named ``__pad__.N`` fill the gaps (the format
forbids holes).  A model can then be loaded by mapping the file, with no copy and
bit-identical results.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

ALIGN = 64
PAD_PREFIX = "__pad__."

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


def save_aligned(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
                 ) -> None:
    """Write ``tensors`` (contiguous, CPU) to ``path`` with every tensor 64-byte aligned."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    layout: list[tuple[int, torch.Tensor | None]] = []  # (padding bytes before, tensor)
    offset = 0
    pads = 0
    for name, tensor in tensors.items():
        if name.startswith(PAD_PREFIX):
            raise ValueError(f"tensor name {name!r} is reserved")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"cannot save '{name}': dtype {tensor.dtype} is not supported by safetensors")
        gap = (-offset) % ALIGN
        if gap:
            header[f"{PAD_PREFIX}{pads}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            pads += 1
            offset += gap
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        layout.append((gap, tensor))
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # The data section starts at 8 + len(header): pad the header with spaces to align it.
    encoded += b" " * ((-(8 + len(encoded))) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for gap, tensor in layout:
            if gap:
                f.write(b"\0" * gap)
            if tensor.numel():
                f.write(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))


def is_padding(name: str) -> bool:
    return name.startswith(PAD_PREFIX)


def tensor_names(path: Path) -> list[str]:
    """Names in a file, padding excluded (reads the header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return [k for k in f.keys() if not is_padding(k)]
