"""Where a LoRA goes in a (possibly fused or quantized) model, and the switchable adapter.

**Targets.**  A LoRA names a module as the library does (``attn.to_q``).  If the model still has
it, the LoRA goes there.  If ``fuse qkv`` replaced it (``attn.to_qkv`` holds q, k and v
concatenated along its output rows), it goes to the rows of the fused layer that were ``to_q``'s:
a merged LoRA adds ``B_q @ A_q`` to those rows; a switchable one joins the fused layer's adapter,
whose ``A`` stacks the parts' ``A`` (``[A_q; A_k; A_v]``, rank ``r_q + r_k + r_v``) and whose
``B`` is block-diagonal (``B_q`` in q's rows and q's rank columns...).  Then ``B @ A`` is exactly
the concatenation of the parts' deltas, and one adapter call costs two matmuls for all three.

**Adapters.**  A switchable LoRA leaves the layer in place (its class, tensors and state_dict keys)
and adds a child ``lora_adapters`` (name → :class:`LoraAdapter`); the layer's class becomes a
subclass (``Linear4bitWithLora``...) whose ``forward`` adds each enabled adapter's output to the
layer's: ``y = layer(x) + ((x @ A.T) * scale) @ B.T``, computed in the adapter's dtype.  ``scale``
is a buffer (saved; changed in place at run time, which a compiled graph reads without
recompiling); ``enabled`` a plain attribute (a compiled graph recompiles when it changes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

#: Attribute (child module) holding a layer's adapters.
ADAPTERS = "lora_adapters"


@dataclass(frozen=True)
class Target:
    """Where one module's LoRA goes: ``layer`` (a path), rows ``start:stop`` of its output
    (all rows: ``start == 0, stop == out_features``), and the module the LoRA named."""

    named: str
    layer: str
    start: int
    stop: int
    in_features: int
    fused: bool

    def to_json(self) -> dict:
        return {"named": self.named, "layer": self.layer, "start": self.start, "stop": self.stop}


def features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer of any kind (nn.Linear, bnb, hqq, fp8, int8 weight-only)."""
    inf, outf = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(inf, int) and isinstance(outf, int):
        return inf, outf
    return None


def fused_rows(parent: nn.Module, leaf: str) -> tuple[str, int, int] | None:
    """``(fused layer name, start, stop)`` when ``parent.<leaf>`` was fused by ``fuse qkv``, else None."""
    from ..qkv.analysis import PROJECTIONS
    from ..qkv.shared_projection import ProjectionSlice

    current = parent._modules.get(leaf)
    if isinstance(current, ProjectionSlice):
        return current.shared.name, current.start, current.stop
    if current is not None:
        return None
    for row in PROJECTIONS:
        for fused, sources in ((row.qkv, row.names), (row.kv, (row.k, row.v))):
            layer = parent._modules.get(fused)
            if leaf not in sources or layer is None or any(s in parent._modules for s in sources):
                continue
            sizes = features(layer)
            if sizes is None:
                continue
            split = parent.__dict__.get("qkv_split")
            if split is not None and fused == row.qkv and len(split) == len(sources):
                splits = tuple(split)
            elif sizes[1] % len(sources) == 0:
                splits = (sizes[1] // len(sources),) * len(sources)
            else:
                continue
            index = sources.index(leaf)
            start = sum(splits[:index])
            return fused, start, start + splits[index]
    return None


def resolve(root: nn.Module, named: str) -> Target | str:
    """Where the LoRA of ``named`` goes in ``root``, or why it cannot go anywhere."""
    parent_path, _, leaf = named.rpartition(".")
    try:
        parent = root.get_submodule(parent_path) if parent_path else root
    except AttributeError:
        return "no such module"
    rows = fused_rows(parent, leaf)
    if rows is not None:
        name, start, stop = rows
        layer = parent._modules[name]
        sizes = features(layer)
        return Target(named, f"{parent_path}.{name}" if parent_path else name, start, stop, sizes[0], True)
    module = parent._modules.get(leaf)
    if module is None:
        return "no such module"
    sizes = features(module)
    if sizes is None:
        if isinstance(module, nn.Conv2d):
            return Target(named, named, 0, module.out_channels, module.in_channels, False)
        return f"a {type(module).__name__}, not a linear layer"
    return Target(named, named, 0, sizes[1], sizes[0], False)


# --------------------------------------------------------------------------- merged


def delta(A: torch.Tensor, B: torch.Tensor, factor: float, weight_shape: torch.Size) -> torch.Tensor:
    """``factor * B @ A`` in float32, shaped as the weight (a convolution's 1x1 ``B`` included)."""
    a, b = A.float(), B.float()
    if a.dim() == 4:  # conv: A (r, in, kh, kw), B (out, r, 1, 1), as PEFT merges it
        if b.shape[2:] != (1, 1):
            raise ValueError(f"a convolution LoRA whose B has a {tuple(b.shape[2:])} kernel")
        product = (b.flatten(1) @ a.flatten(1)).view(b.shape[0], *a.shape[1:])
    else:
        product = b @ a
    if product.shape != weight_shape:
        raise ValueError(f"the LoRA's B @ A is {tuple(product.shape)}, the weight {tuple(weight_shape)}")
    return product * factor


# --------------------------------------------------------------------------- switchable


class LoraAdapter(nn.Module):
    """``((x @ A.T) * scale) @ B.T``: one named LoRA beside one layer (or its parts' beside a fused one)."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, scale: float):
        super().__init__()
        self.A = nn.Parameter(A, requires_grad=False)
        self.B = nn.Parameter(B, requires_grad=False)
        self.register_buffer("scale", torch.tensor(float(scale), dtype=torch.float32, device=A.device))
        self.enabled = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The scale multiplies the rank-r intermediate, not the output: r values per token instead of
        # out_features (PEFT scales the output; ours then adds 0.77x PEFT's time beside float layers:
        # benchmarks/results/lora.md).  A 0-dim float32 buffer keeps the intermediate's dtype.
        x = input.to(self.A.dtype)
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.A) * self.scale, self.B)

    def extra_repr(self) -> str:
        return f"rank={self.A.shape[0]}, in={self.A.shape[1]}, out={self.B.shape[0]}, enabled={self.enabled}"


class LoraLayerMixin:
    """Mixed in before a layer's class: its output plus each enabled adapter's."""

    def forward(self, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        output = super().forward(input, *args, **kwargs)
        for adapter in self._modules[ADAPTERS].values():
            if adapter.enabled:
                output = output + adapter(input).to(output.dtype)
        return output


@functools.cache
def with_lora(base: type) -> type:
    """The subclass of ``base`` that adds its adapters' outputs (one per base class)."""
    if issubclass(base, LoraLayerMixin):
        return base
    return type(f"{base.__name__}WithLora", (LoraLayerMixin, base), {"__module__": __name__})


def base_class(cls: type) -> type:
    """The layer's class before :func:`with_lora`."""
    return cls.__mro__[2] if issubclass(cls, LoraLayerMixin) else cls


def stacked(parts: list[tuple[int, int, torch.Tensor, torch.Tensor, float]], out_features: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter for a layer from LoRAs of row ranges of it: ``parts`` are ``(start, stop, A, B,
    factor)``; returns ``A`` (the parts' A stacked) and ``B`` (block-diagonal, the factors folded in),
    so that ``B @ A`` puts each part's ``factor * B_i @ A_i`` in its rows and zeros elsewhere."""
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == out_features:
        _, _, A, B, factor = parts[0]
        return A, B * factor
    rank = sum(p[2].shape[0] for p in parts)
    A = torch.cat([p[2] for p in parts])
    B = torch.zeros(out_features, rank, dtype=parts[0][3].dtype, device=parts[0][3].device)
    column = 0
    for start, stop, a, b, factor in parts:
        B[start:stop, column:column + a.shape[0]] = b * factor
        column += a.shape[0]
    return A, B
