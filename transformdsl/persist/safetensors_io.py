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

import contextlib
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
    header = _Header(metadata)
    layout: list[tuple[int, torch.Tensor | None]] = []  # (padding bytes before, tensor)
    for name, tensor in tensors.items():
        layout.append((header.place(name, tensor), tensor))
    encoded = header.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for gap, tensor in layout:
            if gap:
                f.write(b"\0" * gap)
            if tensor.numel():
                f.write(_bytes(tensor))


class StreamingWriter:
    """A safetensors file written tensor by tensor, holding no tensor in memory.

    Each :meth:`add` appends the tensor's bytes (aligned and padded as :func:`save_aligned`
    does) to a data file beside ``path``; :meth:`close` writes ``path``: the header, then the
    data, copied by the kernel where it can.  For the same tensors in the same order the file is
    byte for byte the one :func:`save_aligned` writes.  :meth:`discard` removes what was written.
    """

    def __init__(self, path: str | os.PathLike, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._data_path = self.path.with_name(self.path.name + ".data")
        self._header = _Header(metadata)
        self._data = open(self._data_path, "wb")

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data written so far (padding included)."""
        return self._header.offset

    def add(self, name: str, tensor: torch.Tensor) -> None:
        gap = self._header.place(name, tensor)
        if gap:
            self._data.write(b"\0" * gap)
        if tensor.numel():
            self._data.write(_bytes(tensor))

    def close(self) -> None:
        """Write the file (header, then the data) and remove the data file."""
        self._data.close()
        encoded = self._header.encode()
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            out.flush()
            _copy(data, out, 8 + len(encoded), self._header.offset)
        os.unlink(self._data_path)

    def discard(self) -> None:
        self._data.close()
        for path in (self._data_path, self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class _Header:
    """The header of an aligned file, built tensor by tensor."""

    def __init__(self, metadata: dict[str, str] | None):
        self.entries: dict[str, object] = {}
        if metadata:
            self.entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self.offset = 0  # bytes of data so far
        self.pads = 0

    def place(self, name: str, tensor: torch.Tensor) -> int:
        """Enter ``tensor`` after the data so far, behind a padding entry if it needs one to start
        aligned; returns the padding bytes."""
        if name.startswith(PAD_PREFIX):
            raise ValueError(f"tensor name {name!r} is reserved")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"cannot save '{name}': dtype {tensor.dtype} is not supported by safetensors")
        gap = (-self.offset) % ALIGN
        if gap:
            self.entries[f"{PAD_PREFIX}{self.pads}"] = {"dtype": "U8", "shape": [gap],
                                                         "data_offsets": [self.offset, self.offset + gap]}
            self.pads += 1
            self.offset += gap
        nbytes = tensor.numel() * tensor.element_size()
        self.entries[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self.offset, self.offset + nbytes]}
        self.offset += nbytes
        return gap

    def encode(self) -> bytes:
        encoded = json.dumps(self.entries, separators=(",", ":")).encode()
        # The data section starts at 8 + len(header): pad the header with spaces to align it.
        return encoded + b" " * ((-(8 + len(encoded))) % ALIGN)


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def _copy(source, target, at: int, nbytes: int) -> None:
    """Copy the first ``nbytes`` of ``source`` to ``target`` at offset ``at``."""
    done = 0
    try:  # in the kernel: no user-space buffer
        while done < nbytes:
            copied = os.copy_file_range(source.fileno(), target.fileno(), min(nbytes - done, 1 << 30), done,
                                        at + done)
            if copied == 0:
                break
            done += copied
    except (AttributeError, OSError):
        pass
    source.seek(done)
    target.seek(at + done)
    while done < nbytes:  # no copy_file_range (another platform, file system...): a bounded buffer
        chunk = source.read(min(nbytes - done, 1 << 24))
        if not chunk:
            raise OSError(f"{source.name}: shorter than the {nbytes} bytes written to it")
        target.write(chunk)
        done += len(chunk)


def is_padding(name: str) -> bool:
    return name.startswith(PAD_PREFIX)


def tensor_names(path: Path) -> list[str]:
    """Names in a file, padding excluded (reads the header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return [k for k in f.keys() if not is_padding(k)]
