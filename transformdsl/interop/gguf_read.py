"""A bounded GGUF reader: the header, metadata and tensor table of a ``.gguf`` file, checked against
the file's size before anything is allocated; tensor bytes read on request.

The file comes from anywhere, so every count and offset it states is checked first: a string or
array longer than the bytes left, more tensors or keys than the file could hold (or than
:data:`MAX_TENSORS` / :data:`MAX_KEYS`), an array of more than :data:`MAX_ARRAY` elements, an
unknown value or tensor type, a tensor of more than 4 dimensions, a row that is not whole blocks,
an offset that is not aligned or whose data runs past the end, two tensors with one name: each is a
:class:`LoadError` saying what is wrong and where, raised before the rest is read.  Nothing is
executed; the ``gguf`` package is used only for its table of block sizes.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import LoadError

MAGIC = b"GGUF"
#: The file a GGUF save writes in its directory.
GGUF_FILE = "model.gguf"
#: Metadata key every GGUF save carries: a later ``save`` to its directory may replace it (:func:`is_our_save`).
WRITTEN_KEY = "transformdsl.save"
VERSIONS = (2, 3)
#: More tensors or metadata keys than this is refused (real checkpoints: ~1,000 tensors, ~50 keys).
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
#: Elements of one metadata array (a 256k-token vocabulary's token list is 2^18).
MAX_ARRAY = 1 << 22
#: Bytes of a key or tensor name.
MAX_NAME = 1 << 12
MAX_DIMS = 4
#: Elements of one tensor.
MAX_ELEMENTS = 1 << 40
DEFAULT_ALIGNMENT = 32

#: Value type → (struct format, size) for the fixed-size ones; 8 = string, 9 = array.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    #: torch order (outermost first): GGUF lists the innermost dimension first.
    shape: tuple[int, ...]
    #: GGML type number (``gguf.GGMLQuantizationType``).
    type: int
    #: Absolute offset of its bytes in the file.
    offset: int
    nbytes: int


class GGUFFile:
    """An opened, checked GGUF file (use as a context manager; :meth:`close` unmaps it)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = self.size = f.seek(0, 2)
                if size < 24:
                    raise LoadError(f"{self.path}: {size} bytes: too short for a GGUF header")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise LoadError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        self._pos = 0
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            self._map.close()
            self._map = None

    # -- reading with bounds ----------------------------------------------------------

    def _fail(self, what: str) -> LoadError:
        return LoadError(f"{self.path}: not a valid GGUF file: {what} (at byte {self._pos} of {self.size})")

    def _take(self, n: int, what: str) -> bytes:
        if n < 0 or self._pos + n > self.size:
            raise self._fail(f"{what} needs {n} bytes, {self.size - self._pos} left")
        data = self._map[self._pos:self._pos + n]
        self._pos += n
        return data

    def _scalar(self, kind: int, what: str):
        fmt, size = _SCALARS[kind]
        return struct.unpack(fmt, self._take(size, what))[0]

    def _string(self, what: str, limit: int | None = None) -> str:
        n = self._scalar(10, f"{what}'s length")
        if limit is not None and n > limit:
            raise self._fail(f"{what} of {n} bytes (at most {limit})")
        raw = self._take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail(f"{what} is not UTF-8") from None

    def _value(self, kind: int, what: str, depth: int = 0):
        if kind in _SCALARS:
            return self._scalar(kind, what)
        if kind == _STRING:
            return self._string(what)
        if kind != _ARRAY or depth:
            raise self._fail(f"{what} has unknown value type {kind}" if kind != _ARRAY else f"{what}: nested array")
        item = self._array_item = self._scalar(4, f"{what}'s element type")
        count = self._scalar(10, f"{what}'s length")
        if count > MAX_ARRAY:
            raise self._fail(f"{what}: an array of {count} elements (at most {MAX_ARRAY})")
        if item in _NUMPY:
            size = _SCALARS[item][1]
            raw = self._take(count * size, f"{what}'s {count} elements")
            return np.frombuffer(raw, dtype=_NUMPY[item]).tolist()
        if item == _STRING:
            if count * 8 > self.size - self._pos:
                raise self._fail(f"{what}: {count} strings cannot fit in the {self.size - self._pos} bytes left")
            return [self._string(f"{what}[{i}]") for i in range(count)]
        raise self._fail(f"{what} has unknown element type {item}")

    # -- the file ---------------------------------------------------------------------

    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self._take(4, "magic") != MAGIC:
            raise LoadError(f"{self.path}: not a GGUF file (no 'GGUF' magic)")
        self.version = self._scalar(4, "version")
        if self.version not in VERSIONS:
            raise self._fail(f"version {self.version} (this reader takes {', '.join(map(str, VERSIONS))})")
        n_tensors = self._scalar(10, "tensor count")
        n_keys = self._scalar(10, "metadata count")
        left = self.size - self._pos
        if n_tensors > MAX_TENSORS or n_tensors * 28 > left:
            raise self._fail(f"{n_tensors} tensors stated (at most {MAX_TENSORS}, and {left} bytes left)")
        if n_keys > MAX_KEYS or n_keys * 12 > left:
            raise self._fail(f"{n_keys} metadata keys stated (at most {MAX_KEYS}, and {left} bytes left)")
        self.metadata: dict = {}
        #: Each key's GGUF value type and, for an array, its element type (``gguf.GGUFValueType`` numbers):
        #: what writing the value again as it was needs.
        self.value_types: dict[str, tuple[int, int | None]] = {}
        for i in range(n_keys):
            key = self._string(f"metadata key {i}", MAX_NAME)
            kind = self._scalar(4, f"type of {key!r}")
            if key in self.metadata:
                raise self._fail(f"metadata key {key!r} twice")
            self.metadata[key] = self._value(kind, repr(key))
            self.value_types[key] = (kind, self._array_item if kind == _ARRAY else None)
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not (isinstance(alignment, int) and 0 < alignment <= 1 << 16 and alignment & (alignment - 1) == 0):
            raise self._fail(f"general.alignment {alignment!r} is not a power of two up to 65536")
        raw_infos = []
        for i in range(n_tensors):
            name = self._string(f"tensor {i}'s name", MAX_NAME)
            dims = self._scalar(4, f"{name!r}'s dimension count")
            if not 1 <= dims <= MAX_DIMS:
                raise self._fail(f"tensor {name!r} has {dims} dimensions (1 to {MAX_DIMS})")
            shape = [self._scalar(10, f"{name!r}'s dimension") for _ in range(dims)]
            kind = self._scalar(4, f"{name!r}'s type")
            offset = self._scalar(10, f"{name!r}'s offset")
            raw_infos.append((name, shape, kind, offset))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset in raw_infos:
            where = f"tensor {name!r}"
            try:
                qtype = GGMLQuantizationType(kind)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise LoadError(f"{self.path}: {where} has unknown GGML type {kind}") from None
            elements = math.prod(shape)
            if any(d < 1 for d in shape) or elements > MAX_ELEMENTS:
                raise LoadError(f"{self.path}: {where} has shape {shape[::-1]}")
            if shape[0] % block:
                raise LoadError(f"{self.path}: {where}: rows of {shape[0]} values are not whole {qtype.name} "
                                f"blocks of {block}")
            nbytes = elements // block * type_size
            start = data_start + offset
            if offset % alignment or start + nbytes > self.size:
                raise LoadError(f"{self.path}: {where}'s data (offset {offset}, {nbytes} bytes) is "
                                f"{'not aligned' if offset % alignment else 'past the end of the file'}")
            if name in self.tensors:
                raise LoadError(f"{self.path}: tensor {name!r} twice")
            self.tensors[name] = TensorInfo(name, tuple(shape[::-1]), kind, start, nbytes)

    def data(self, info: TensorInfo) -> np.ndarray:
        """A tensor's bytes (a copy, uint8): rows of its innermost dimension, as GGUF stores them."""
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset).copy()
        return raw.reshape(rows, -1)


def contents(path: str | Path) -> dict:
    """``inspect`` on a GGUF file: its architecture, scripts (``transformdsl.scripts``) and tensors by
    GGML type, from the header only (no tensor data is read).  The keys of
    :func:`transformdsl.persist.contents.inspect`'s answer for a module."""
    from gguf import GGMLQuantizationType

    with GGUFFile(path) as gf:
        by_type: dict[str, dict[str, int]] = {}
        for info in gf.tensors.values():
            entry = by_type.setdefault(GGMLQuantizationType(info.type).name, {"tensors": 0, "elements": 0, "bytes": 0})
            entry["tensors"] += 1
            entry["elements"] += math.prod(info.shape)
            entry["bytes"] += info.nbytes
        arch = gf.metadata.get("general.architecture")
        scripts = gf.metadata.get("transformdsl.scripts")
        return {
            "kind": "module",
            "format_version": f"GGUF v{gf.version}",
            "model": str(arch)[:80],
            "library": "gguf",
            "scripts": [scripts] if isinstance(scripts, str) else [],
            "steps": [],
            "files": [Path(path).name],
            "tensors": by_type,
            "versions": {},
            "interop": {"format": "gguf", "notes": [
                f"{len(gf.tensors)} tensors, {len(gf.metadata)} metadata keys; transformdsl.load keeps Q8_0/Q4_0/Q4_1/"
                "Q5_0/Q5_1/Q4_K/Q5_K/Q6_K linear layers as 'quantize q8_0'/'q4_0'/'q4_1'/'q5_0'/'q5_1'/'q4_k'/'q5_k'/'q6_k' "
                "layers and "
                "dequantizes other block types"]},
        }


def is_our_save(directory: Path) -> bool:
    """Whether ``directory`` holds exactly a GGUF save of ours (``model.gguf`` carrying :data:`WRITTEN_KEY`),
    which ``save()`` may replace as it replaces its own saves."""
    try:
        if [p.name for p in directory.iterdir()] != [GGUF_FILE] or (directory / GGUF_FILE).is_symlink():
            return False
        with GGUFFile(directory / GGUF_FILE) as gf:
            return gf.metadata.get(WRITTEN_KEY) == GGUF_FILE
    except Exception:  # unreadable or not GGUF: not ours
        return False
