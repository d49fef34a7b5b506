"""The LoRA file a script names: checked and described from its header alone (torch-free).

A LoRA is read from a safetensors file only: a pickle (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) can run
code when loaded, so it is refused by its name and, whatever its name, by its content (a safetensors
file starts with the length of a JSON header that follows).  Planning opens the file without
blocking, requires a regular file of at most :data:`MAX_FILE_BYTES`, and reads the 8-byte length and
the header (at most :data:`MAX_HEADER_BYTES`): no tensor data.  The header's entries are checked
(known dtypes, shapes, offsets inside the file, back to back) so that reading a tensor later cannot
go outside the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import TransformError

#: The largest LoRA file accepted (LoRAs are megabytes to a few gigabytes).
MAX_FILE_BYTES = 16 << 30
#: The largest header accepted (a LoRA of 10k tensors has a header of about 1 MiB).
MAX_HEADER_BYTES = 64 << 20
#: Tensors a LoRA file may hold.
MAX_TENSORS = 200_000
#: The largest dimension a LoRA tensor may have (ranks and feature counts are far below it; torch
#: cannot even describe a dimension of 2**63).
MAX_DIMENSION = 1 << 31
#: Pickle-based checkpoint suffixes: never loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: Bytes per element of the safetensors dtypes a LoRA may use.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class LoraFileError(TransformError):
    """The file a ``lora`` statement names cannot be used (missing, not safetensors, too big...)."""


@dataclass(frozen=True)
class Header:
    """What the header of a LoRA file says: tensor name → (dtype, shape), and its metadata."""

    path: Path
    size: int
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    metadata: dict[str, str] = field(default_factory=dict)
    #: Tensor name -> (start, end) of its bytes in the file.
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)


def read_header(path: str | os.PathLike) -> Header:
    """Check the LoRA file at ``path`` and read its header (no tensor data); :class:`LoraFileError` if unusable."""
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise LoraFileError(f"{path}: a {path.suffix} file is a pickle, which can run code when loaded; a LoRA "
                            "is read from .safetensors only (convert it once with a tool you trust)")
    if "\0" in str(path):
        raise LoraFileError(f"{printable(str(path))}: a path cannot hold a NUL character")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        reason = "no such file" if exc.errno == errno.ENOENT else exc.strerror or str(exc)
        raise LoraFileError(f"{printable(str(path))}: cannot open the LoRA file: {reason}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise LoraFileError(f"{path}: not a regular file (a LoRA is read from a .safetensors file)")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > MAX_FILE_BYTES:
            raise LoraFileError(f"{path}: {info.st_size} bytes; a LoRA file may have at most {MAX_FILE_BYTES}")
        head = f.read(8)
        if len(head) < 8:
            raise LoraFileError(f"{path}: {info.st_size} bytes, too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > info.st_size:
            what = "a pickle" if head[:2] == b"\x80\x02" or head[:2] == b"PK" else "not a safetensors file"
            raise LoraFileError(f"{path}: {what} (its first 8 bytes do not give the length of a header inside "
                                "the file); a LoRA is read from .safetensors only")
        raw = f.read(length)
    try:
        entries = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraFileError(f"{path}: not a safetensors file (its header is not JSON: {exc})") from None
    except RecursionError:  # a safetensors header is one level of entries (and their short lists)
        raise LoraFileError(f"{path}: not a safetensors file (its header nests deeper than Python's JSON reader "
                            "goes)") from None
    if not isinstance(entries, dict):
        raise LoraFileError(f"{path}: not a safetensors file (its header is not a JSON object)")
    metadata = entries.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise LoraFileError(f"{path}: the header's __metadata__ must map names to strings")
    if len(entries) > MAX_TENSORS:
        raise LoraFileError(f"{path}: {len(entries)} tensors; a LoRA file may hold at most {MAX_TENSORS}")
    data_bytes = info.st_size - 8 - length
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    located: dict[str, tuple[int, int]] = {}
    spans = []
    for name, entry in entries.items():
        dtype, shape, offsets = _entry(path, name, entry)
        count = 1
        for n in shape:
            count *= n
        if offsets[1] - offsets[0] != count * DTYPE_BYTES[dtype] or offsets[1] > data_bytes:
            raise LoraFileError(f"{path}: tensor {name!r}: its offsets {offsets} do not fit its dtype and shape "
                                f"inside the file's {data_bytes} data bytes")
        spans.append(offsets)
        tensors[name] = (dtype, shape)
        located[name] = (8 + length + offsets[0], 8 + length + offsets[1])
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise LoraFileError(f"{path}: tensors overlap in the file (not a valid safetensors file)")
    return Header(path, info.st_size, tensors, dict(metadata), located)


def _entry(path: Path, name: str, entry: object) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list) \
        and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
    ints = ok and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                      for n in [*entry["shape"], *entry["data_offsets"]])
    if not ints or len(entry["shape"]) > 8 or entry["data_offsets"][0] > entry["data_offsets"][1]:
        raise LoraFileError(f"{path}: tensor {name!r}: malformed header entry")
    if any(n > MAX_DIMENSION for n in entry["shape"]):
        raise LoraFileError(f"{path}: tensor {name!r} has shape {entry['shape']}: a LoRA tensor's "
                            f"dimensions are at most {MAX_DIMENSION}")
    if entry["dtype"] not in DTYPE_BYTES:
        raise LoraFileError(f"{path}: tensor {name!r} has dtype {printable(entry['dtype'])}, which a "
                            "LoRA does not use")
    return entry["dtype"], tuple(entry["shape"]), (entry["data_offsets"][0], entry["data_offsets"][1])


def read_tensors(header: Header, largest: int) -> tuple[dict, str]:
    """The file's tensors and its SHA-256, read through one descriptor: the hash streamed over the whole
    file (16 MiB at a time), each tensor's own bytes read once; a tensor holding more values than
    ``largest`` (the model's largest weight: no LoRA factor of it can be bigger) is refused before it
    is read, and a file whose size, inode or modification time changed meanwhile is refused too.

    Memory: the tensors, not the file (a 2 GiB tensor no adapter uses cost 4 GB when the file was read
    whole and then parsed)."""
    import torch

    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
    path = header.path
    for name, (_, shape) in header.tensors.items():
        count = 1
        for n in shape:
            count *= n
        if count > largest:
            raise LoraFileError(f"{path}: tensor {printable(name)!r} holds {count} values, more than the model's "
                                f"largest weight ({largest}): no LoRA factor of this model is that large")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        before = os.fstat(fd)
        if before.st_size != header.size:
            raise LoraFileError(f"{path}: the file changed since its header was read")
        digest = hashlib.sha256()
        position = 0
        while chunk := os.pread(fd, 1 << 24, position):
            digest.update(chunk)
            position += len(chunk)
        tensors = {}
        for name, (dtype, shape) in header.tensors.items():
            start, end = header.spans[name]
            data = bytearray(os.pread(fd, end - start, start)) if end > start else bytearray()
            if len(data) != end - start:
                raise LoraFileError(f"{path}: the file changed while it was read")
            tensors[name] = (torch.frombuffer(data, dtype=dtypes[dtype]).reshape(shape) if data
                             else torch.empty(shape, dtype=dtypes[dtype]))
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if position != header.size or (after.st_size, after.st_mtime_ns, after.st_ino) != (
            before.st_size, before.st_mtime_ns, before.st_ino):
        raise LoraFileError(f"{path}: the file changed while it was read")
    return tensors, digest.hexdigest()


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\x1b``): a key name from a file reaches the terminal
    as text, never as a terminal command."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def sha256(path: str | os.PathLike) -> str:
    """The file's SHA-256 (hex), read in 16 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
