"""One layer's local shard: new layers made from a slice of a layer's stored tensors.

A *row* shard keeps some output features (column-parallel: transformers' ``colwise``); a *column*
shard keeps some input features (row-parallel: ``rowwise``; its bias is handed back apart, to be
added once after the partial outputs are summed); a *vocabulary* shard keeps some rows of an
embedding table.  Each shard is a new layer of the same class built from new tensors (copies of the
slices: the full tensors, memory-mapped from the save, are never written and can leave memory), so
it computes exactly what the full layer computes on the same rows or columns:

- ``nn.Linear``, ``nn.Embedding``: the weight's rows or columns, the bias with its rows;
- weight-only int8 and ``quantize w8a8`` (:class:`Int8WeightOnlyLinear`, :class:`Int8DynamicLinear`):
  the int8 rows with their per-row scales, or the int8 columns with every row's scale (a per-row
  scale is constant along the row, so partial sums rescale exactly);
- int4 (:class:`Int4WeightOnlyLinear`): rows with their groups' scales and zeros, or whole groups of
  columns (packed nibbles, scales and zeros together); the packed CPU layout is rebuilt per shard;
- fp8 (:class:`FP8Linear`, :class:`FP8Embedding`): the float8 rows with their per-row scales (a
  tensor-wise scale is kept whole), or columns with every row's scale.

A layer holding switchable LoRA adapters (``lora ... merge=false``) shards its base layer as above and
each adapter with it: ``B``'s rows beside a row shard, ``A``'s columns beside a column shard (the
adapter's partial output, linear in the input and without a bias, is summed with the layer's), so
``set_lora`` keeps working on every rank.

Ranges are ``((start, end), ...)`` in features (several for a fused q|k|v weight: one per projection);
:mod:`.layout` chooses them and checks that they fit the layer (whole heads, whole groups).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..transforms.fp8.layers import FP8Embedding, FP8Linear
from ..transforms.lora.layers import ADAPTERS, LoraAdapter, LoraLayerMixin, base_class, with_lora
from ..transforms.quantize.int4 import Int4WeightOnlyLinear
from ..transforms.quantize.int8_weight_only import Int8WeightOnlyLinear
from ..transforms.quantize.w8a8 import Int8DynamicLinear

Ranges = tuple[tuple[int, int], ...]

#: Layer classes with a row and a column shard, and what the plan says they are.
LINEAR_KINDS: dict[type, str] = {
    nn.Linear: "float",
    Int8WeightOnlyLinear: "int8 weight-only",
    Int8DynamicLinear: "w8a8",
    Int4WeightOnlyLinear: "int4",
    FP8Linear: "fp8",
}
#: Embedding classes with a vocabulary shard.
EMBEDDING_KINDS: dict[type, str] = {nn.Embedding: "float", FP8Embedding: "fp8"}


def take(tensor: torch.Tensor, dim: int, ranges: Ranges, unit: int = 1) -> torch.Tensor:
    """The ``ranges`` of ``tensor`` along ``dim`` (in units of ``unit`` elements), as one new tensor."""
    pieces = [tensor.narrow(dim, start // unit, (end - start) // unit) for start, end in ranges]
    if len(pieces) > 1:
        return torch.cat(pieces, dim)
    return pieces[0].clone(memory_format=torch.contiguous_format)


def _parameter(tensor: torch.Tensor | None, like: torch.Tensor | None) -> nn.Parameter | None:
    if tensor is None:
        return None
    return nn.Parameter(tensor, requires_grad=bool(like is not None and like.requires_grad))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Linear) -> nn.Linear:
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = _parameter(weight, like.weight)
    layer.bias = _parameter(bias, like.bias)
    return layer


def _row_scale(scale: torch.Tensor | None, ranges: Ranges) -> torch.Tensor | None:
    """An fp8 scale's rows (one per output row), or the tensor-wise scale whole."""
    if scale is None or scale.shape[0] == 1:
        return None if scale is None else scale.clone()
    return take(scale, 0, ranges)


def layer_class(layer: nn.Module) -> type:
    """The class that says how ``layer`` shards: its own, or the one switchable LoRAs were mixed into."""
    return base_class(type(layer))


def _with_adapters(new: nn.Module, layer: nn.Module, shard_adapter) -> nn.Module:
    """``new`` (a shard of ``layer``'s base) with ``layer``'s switchable LoRAs, each sharded likewise."""
    if not isinstance(layer, LoraLayerMixin):
        return new
    new.__class__ = with_lora(type(new))
    adapters = nn.ModuleDict()
    for name, adapter in layer._modules[ADAPTERS].items():
        A, B = shard_adapter(adapter.A.detach(), adapter.B.detach())
        copy_ = LoraAdapter(A, B, float(adapter.scale))
        copy_.enabled = adapter.enabled
        adapters[name] = copy_.train(adapter.training)
    new.add_module(ADAPTERS, adapters)
    return new


def rows(layer: nn.Module, ranges: Ranges) -> nn.Module:
    """The layer computing only the output features in ``ranges`` (bias rows included)."""
    new = _base_rows(layer, ranges)
    return _with_adapters(new, layer, lambda A, B: (A.clone(), take(B, 0, ranges))).train(layer.training)


def columns(layer: nn.Module, ranges: Ranges) -> tuple[nn.Module, torch.Tensor | None]:
    """``(the layer computing the partial output of the input features in ranges, without a bias;
    the bias, to add once after the partial outputs are summed)``."""
    new, bias = _base_columns(layer, ranges)
    new = _with_adapters(new, layer, lambda A, B: (take(A, 1, ranges), B.clone()))
    return new.train(layer.training), bias


def _base_rows(layer: nn.Module, ranges: Ranges) -> nn.Module:
    bias = None if layer.bias is None else take(layer.bias.detach(), 0, ranges)
    kind = layer_class(layer)
    if kind is nn.Linear:
        new = _linear(take(layer.weight.detach(), 0, ranges), bias, layer)
    elif kind in (Int8WeightOnlyLinear, Int8DynamicLinear):
        new = kind(take(layer.int8_weight, 0, ranges), take(layer.weight_scale, 0, ranges), bias, layer.weight_dtype)
    elif kind is Int4WeightOnlyLinear:
        new = Int4WeightOnlyLinear(take(layer.packed_weight, 0, ranges), take(layer.weight_scale, 0, ranges),
                                   take(layer.weight_zero, 0, ranges), bias, layer.group_size, layer.compute,
                                   layer.weight_dtype)
    elif kind is FP8Linear:
        weight = take(layer.fp8_weight, 0, ranges)
        new = _fp8_linear(layer, weight, _row_scale(layer.weight_scale, ranges), _parameter(bias, layer.bias))
    else:  # pragma: no cover - layout only asks for the classes above
        raise TypeError(f"no row shard for {type(layer).__name__}")
    return new


def _base_columns(layer: nn.Module, ranges: Ranges) -> tuple[nn.Module, torch.Tensor | None]:
    bias = None if layer.bias is None else layer.bias.detach()
    kind = layer_class(layer)
    if kind is nn.Linear:
        new = _linear(take(layer.weight.detach(), 1, ranges), None, layer)
    elif kind in (Int8WeightOnlyLinear, Int8DynamicLinear):
        new = kind(take(layer.int8_weight, 1, ranges), layer.weight_scale.clone(), None, layer.weight_dtype)
    elif kind is Int4WeightOnlyLinear:
        group = layer.group_size
        new = Int4WeightOnlyLinear(take(layer.packed_weight, 1, ranges, unit=2),
                                   take(layer.weight_scale, 1, ranges, unit=group),
                                   take(layer.weight_zero, 1, ranges, unit=group), None, group, layer.compute,
                                   layer.weight_dtype)
    elif kind is FP8Linear:
        scale = None if layer.weight_scale is None else layer.weight_scale.clone()
        new = _fp8_linear(layer, take(layer.fp8_weight, 1, ranges), scale, None)
    else:  # pragma: no cover - layout only asks for the classes above
        raise TypeError(f"no column shard for {type(layer).__name__}")
    return new, bias


def _fp8_linear(layer: FP8Linear, weight: torch.Tensor, scale: torch.Tensor | None,
                bias: nn.Parameter | None) -> FP8Linear:
    new = FP8Linear(weight.shape[1], weight.shape[0], weight, scale, bias, layer.compute_dtype,
                    native=layer.native, scaling=layer.scaling, strict=layer.strict)
    new.weight_dtype = layer.weight_dtype
    new.statement = layer.statement
    return new


def vocabulary(layer: nn.Module, start: int, end: int) -> nn.Module:
    """The embedding holding rows ``start:end`` of the table (a lookup outside them is the caller's)."""
    padding = layer.padding_idx
    padding = padding - start if padding is not None and start <= padding < end else None
    if type(layer) is nn.Embedding:
        with torch.device("meta"):
            new = nn.Embedding(end - start, layer.embedding_dim, padding_idx=padding, max_norm=layer.max_norm,
                               norm_type=layer.norm_type, scale_grad_by_freq=layer.scale_grad_by_freq,
                               sparse=layer.sparse)
        new.weight = _parameter(take(layer.weight.detach(), 0, ((start, end),)), layer.weight)
    elif type(layer) is FP8Embedding:
        new = copy.copy(layer)  # no constructor from tensors: the same attributes, new tensor tables
        new.__dict__ = dict(layer.__dict__)
        for table in ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks"):
            new.__dict__[table] = dict(layer.__dict__[table])
        new._buffers["weight"] = take(layer.fp8_weight, 0, ((start, end),))
        new._buffers["weight_scale"] = _row_scale(layer.weight_scale, ((start, end),))
        new.num_embeddings, new.padding_idx = end - start, padding
    else:  # pragma: no cover - layout only asks for the classes above
        raise TypeError(f"no vocabulary shard for {type(layer).__name__}")
    return new.train(layer.training)
