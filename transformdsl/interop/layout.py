"""How saved tensors move between a library's key layout and ours.

A save written with ``format="transformers"`` or ``"diffusers"`` holds the tensors under the
names the library expects; the metadata's ``tensors.layout`` lists, for each of our tensors
stored otherwise, how to get it back:

- ``{"key": ours, "from": [saved], "op": "rename", "shape": [...]}``: the same values under another
  name and shape (fp8 ``weight_scale`` is stored as transformers' ``weight_scale_inv``);
- ``{"key": ours, "from": [saved, ...], "op": "cat"}``: the concatenation along dimension 0
  (a fused ``qkv_proj`` stored as its ``q_proj``/``k_proj``/``v_proj``); with ``"zeros": [[position,
  rows], ...]``, zero rows inserted at those positions of the concatenation (the fused bias of a
  projection that has none, Whisper's ``k_proj``);
- ``{"key": ours, "from": [saved, ...], "op": "same"}``: equal copies, one kept (a per-tensor
  scale or format tag stored once per unfused projection);
- ``{"key": ours, "from": [saved], "op": "view", "dtype": "uint8", "shape": [...]}``: the same bytes
  read as another dtype (int4 nibbles stored as compressed-tensors' int32 ``weight_packed``);
- ``{"key": ours, "from": [saved], "op": "cast", "dtype": "bfloat16"}``: the values in another dtype,
  refused unless the cast is exact (a bfloat16 scale stored as float32);
- ``{"key": ours, "from": [saved], "op": "zeros", "dtype": ..., "shape": [...]}``: zeros of the model's
  own shape for that tensor, the saved one dropped (int4's zero points of a symmetric layer, which
  compressed-tensors does not store; ``saved`` is its ``weight_shape``).

Every operation is exact: reloading gives our tensors bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LoadError

OPS = ("rename", "cat", "same", "view", "cast", "zeros")
#: The dtypes a ``view``/``cast``/``zeros`` entry may name.
DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "float32": torch.float32}


def check(path: Path, layout: object) -> list[dict]:
    """The ``tensors.layout`` field of a metadata file, checked entry by entry (it comes from a file)."""
    if not isinstance(layout, list):
        raise LoadError(f"{path}: 'tensors.layout' is malformed (got {type(layout).__name__})")
    for entry in layout:
        ok = (isinstance(entry, dict) and isinstance(entry.get("key"), str) and entry.get("op") in OPS
              and isinstance(entry.get("from"), list) and entry["from"]
              and all(isinstance(k, str) for k in entry["from"]))
        if ok and "zeros" in entry:
            zeros = entry["zeros"]
            ok = entry["op"] == "cat" and isinstance(zeros, list) and all(
                isinstance(z, list) and len(z) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                            for v in z) for z in zeros)
        if ok and entry["op"] in ("rename", "view", "zeros"):
            shape = entry.get("shape")
            ok = len(entry["from"]) == 1 and isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        if ok and entry["op"] in ("view", "cast", "zeros"):
            ok = len(entry["from"]) == 1 and entry.get("dtype") in DTYPES
        if not ok:
            raise LoadError(f"{path}: malformed 'tensors.layout' entry: {str(entry)[:200]}")
    return layout  # type: ignore[return-value]


def to_own(tensors: dict[str, torch.Tensor], layout: list[dict], directory: Path,
           expected: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """Our tensors from the saved ones (``tensors`` is modified and returned); the entries are
    undone in reverse order (an fp8 scale renamed after its projection was unfused).

    ``expected``: the model's tensor shapes by name.  A tensor an entry builds (a concatenation with
    zero rows inserted) is checked against it before it is allocated; without it, zero rows are at
    most the rows of the parts (they stand for a missing part)."""
    for entry in reversed(layout):
        key, sources, op = entry["key"], entry["from"], entry["op"]
        missing = [s for s in sources if s not in tensors]
        if missing:
            raise LoadError(f"{directory}: tensor '{missing[0]}' (part of '{key}') is missing")
        if key in tensors and key not in sources:
            raise LoadError(f"{directory}: tensor '{key}' is stored and also rebuilt from {sources}")
        parts = [tensors.pop(s) for s in sources]
        if op == "rename":
            shape = tuple(entry["shape"])
            if parts[0].numel() != _numel(shape):
                raise LoadError(f"{directory}: tensor '{sources[0]}' has {parts[0].numel()} values; "
                                f"'{key}' needs shape {list(shape)}")
            tensors[key] = parts[0].reshape(shape)
        elif op == "view":
            shape, dtype = tuple(entry["shape"]), DTYPES[entry["dtype"]]
            part = parts[0].contiguous()
            if part.numel() * part.element_size() != _numel(shape) * dtype.itemsize:
                raise LoadError(f"{directory}: tensor '{sources[0]}' has {part.numel() * part.element_size()} bytes; "
                                f"'{key}' needs shape {list(shape)} of {entry['dtype']}")
            tensors[key] = part.reshape(-1).view(torch.uint8).view(dtype).reshape(shape)
        elif op == "cast":
            dtype = DTYPES[entry["dtype"]]
            cast = parts[0].to(dtype)
            if not torch.equal(cast.to(parts[0].dtype), parts[0]):
                raise LoadError(f"{directory}: tensor '{sources[0]}' does not hold {entry['dtype']} values exactly "
                                f"(it should, as '{key}')")
            tensors[key] = cast
        elif op == "zeros":
            shape, want = tuple(entry["shape"]), (expected or {}).get(key)
            if want is None or tuple(want) != shape:
                raise LoadError(f"{directory}: 'tensors.layout' builds '{key}' as zeros of {list(shape)}"
                                + (f"; the model expects {list(want)}" if want is not None else
                                   ", a tensor the model does not have") + "; refusing to allocate it")
            tensors[key] = torch.zeros(shape, dtype=DTYPES[entry["dtype"]], device=parts[0].device)
        elif op == "cat":
            if len({(p.dtype, p.shape[1:]) for p in parts}) != 1 or any(p.dim() == 0 for p in parts):
                raise LoadError(f"{directory}: tensors {sources} cannot be concatenated into '{key}'")
            zeros = sorted(entry.get("zeros", ()))
            shape = (sum(p.shape[0] for p in parts) + sum(rows for _, rows in zeros), *parts[0].shape[1:])
            want = (expected or {}).get(key)
            if want is not None and tuple(want) != shape or want is None and zeros and \
                    sum(rows for _, rows in zeros) > sum(p.shape[0] for p in parts):
                raise LoadError(f"{directory}: 'tensors.layout' builds '{key}' as {list(shape)}"
                                + (f"; the model expects {list(want)}" if want is not None else
                                   ", more zero rows than saved ones") + "; refusing to allocate it")
            for position, rows in zeros:
                if position > len(parts):
                    raise LoadError(f"{directory}: malformed 'tensors.layout' entry for '{key}': zeros at {position}")
                parts.insert(position, parts[0].new_zeros((rows, *parts[0].shape[1:])))
            tensors[key] = torch.cat(parts, dim=0)
        else:
            if any(not torch.equal(parts[0], p) for p in parts[1:]):
                raise LoadError(f"{directory}: tensors {sources} should be equal copies of '{key}'")
            tensors[key] = parts[0]
    return tensors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
