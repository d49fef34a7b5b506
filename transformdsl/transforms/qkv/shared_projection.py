"""A shared fused projection: one Linear that q, k and v (or k and v) read as slices.

``fuse qkv`` uses this for every attention module that has no exact fused path of its own
(all of transformers but Llama, and diffusers processors without a fused counterpart): the
fused ``nn.Linear`` (``qkv_proj``, ``to_qkv``, ...) holds the concatenated weight, and the old
attributes (``q_proj``, ``k_proj``, ``v_proj``) become parameter-free :class:`ProjectionSlice`
modules, so the attention's own ``forward`` runs unchanged.

What users may rely on:

- A slice returns exactly what the projection it replaces returned, up to float rounding
  (one wider matmul instead of three), as a contiguous tensor of the same shape and dtype.
- The first slice called with an input computes the fused projection once; the others,
  called with *the very same tensor* (identity, unchanged since: ``_version``), return their
  part of that result.  Called with another tensor, a slice computes the fused projection of
  that tensor afresh: correctness never depends on call order or inputs (only speed does,
  which is why a cross-attention's q, reading other states than k/v, is never fused with
  them).  A result is held until every slice has taken its part, or until the next call
  that cannot use it.
- The fused layer is looked up on the attention module at call time, so it may be replaced
  afterwards (``quantize int8``, ``fp8 storage``: the ONE fused layer is quantized).
- ``.weight`` / ``.bias`` are views of the fused layer's rows (no copy) while it is an
  ``nn.Linear``; ``in_features`` and ``out_features`` are those of the replaced projection.
  A slice of a projection that had no bias (its rows of the fused bias are zeros) has
  ``.bias`` None, as the projection had.
"""

from __future__ import annotations

import torch
from torch import nn


class SharedOutput:
    """What the slices of one fused layer share: where the layer is and its last output.

    Not a module (no parameters, not in the module tree): the owner holds the slices, the
    slices hold this, and this refers back to the owner by attribute name.
    """

    __slots__ = ("owner", "name", "parts", "cache")

    def __init__(self, owner: nn.Module, name: str, parts: int):
        self.owner = owner
        self.name = name
        self.parts = parts
        #: ``(input, input._version, fused output, frozenset of slice indices still to serve)``
        self.cache: tuple | None = None

    def __getstate__(self):
        return {"owner": self.owner, "name": self.name, "parts": self.parts}

    def __setstate__(self, state):
        self.owner, self.name, self.parts, self.cache = state["owner"], state["name"], state["parts"], None

    def __deepcopy__(self, memo):
        import copy

        new = SharedOutput.__new__(SharedOutput)
        memo[id(self)] = new
        new.owner = copy.deepcopy(self.owner, memo)
        new.name, new.parts, new.cache = self.name, self.parts, None
        return new


class ProjectionSlice(nn.Module):
    """Rows ``start:stop`` of the fused projection ``owner.<name>``; holds no tensor."""

    def __init__(self, shared: SharedOutput, index: int, start: int, stop: int, in_features: int,
                 has_bias: bool = True):
        super().__init__()
        self.has_bias = has_bias
        self.shared = shared
        self.index = index
        self.start = start
        self.stop = stop
        self.in_features = in_features
        self.out_features = stop - start

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shared = self.shared
        cache = shared.cache          # one read: a concurrent call replaces the tuple, never edits it
        if cache is not None and cache[0] is input and self.index in cache[3] \
                and (torch.compiler.is_compiling() or cache[1] == input._version):
            left = cache[3] - {self.index}
            shared.cache = (cache[0], cache[1], cache[2], left) if left else None
            return cache[2][..., self.start:self.stop].contiguous()
        fused = getattr(shared.owner, shared.name)
        output = fused(input)
        if shared.parts > 1:
            others = frozenset(i for i in range(shared.parts) if i != self.index)
            shared.cache = (input, 0 if torch.compiler.is_compiling() else input._version, output, others)
        return output[..., self.start:self.stop].contiguous()

    def _rows(self, name: str) -> torch.Tensor | None:
        fused = getattr(self.shared.owner, self.shared.name)
        tensor = getattr(fused, name, None)
        if tensor is None:
            return None
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1 or tensor.shape[0] != fused.out_features:
            raise AttributeError(f"{type(fused).__name__} {self.shared.name!r} keeps no row-sliceable {name}: "
                                 f"this slice of it has no .{name}")
        return tensor[self.start:self.stop]

    @property
    def weight(self) -> torch.Tensor:
        """Rows of the fused weight (a view)."""
        return self._rows("weight")

    @property
    def bias(self) -> torch.Tensor | None:
        return self._rows("bias") if self.has_bias else None

    def extra_repr(self) -> str:
        return (f"{self.shared.name}[{self.start}:{self.stop}], in_features={self.in_features}, "
                f"out_features={self.out_features}")


def install(edit, module: nn.Module, name: str, sources: tuple[str, ...], splits: tuple[int, ...],
            fused: nn.Linear, zero_bias: tuple[str, ...] = ()) -> None:
    """Put ``fused`` at ``module.<name>`` and a :class:`ProjectionSlice` at each of ``sources``
    (``zero_bias``: sources that had no bias, whose rows of the fused bias are zeros)."""
    shared = SharedOutput(module, name, len(sources))
    start = 0
    slices = []
    for index, (source, size) in enumerate(zip(sources, splits)):
        slices.append(ProjectionSlice(shared, index, start, start + size, fused.in_features,
                                      has_bias=source not in zero_bias))
        start += size
    for source, view in zip(sources, slices):
        edit.setattr(module, source, view)    # same place among the children; the Linear goes away
    edit.setattr(module, name, fused)
