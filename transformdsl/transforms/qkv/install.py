"""``fuse qkv``: installing a :class:`~.analysis.Fusion` on a module (implementation).

:func:`install` replaces the projections with the fused Linear and switches the module to the
fused computation (a diffusers fused processor, diffusers' own ``fused_projections`` flag, the
fused Llama forward, or shared-projection slices), through an :class:`~transformdsl.edit.Edit` so
that a failure rolls back.  :func:`concatenated` builds the fused Linear from the projections
(``apply``); :func:`uninitialised` one of the same shape without values (``rebuild`` on load).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ...edit import Edit
from ...errors import LoadError
from . import shared_projection
from .analysis import FUSED_PROCESSORS, Fusion, Group


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Linear) -> nn.Linear:
    """An ``nn.Linear`` around the given tensors, without initialising (or allocating) others."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    requires_grad = like.weight.requires_grad
    linear.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=requires_grad)
    return linear.train(like.training)


def concatenated(sources: list[nn.Linear], group: Group) -> nn.Linear:
    """The fused Linear of ``sources`` (new tensors: the sources are left untouched)."""
    with torch.no_grad():
        weight = torch.cat([s.weight for s in sources])
        bias = torch.cat([s.bias if s.bias is not None else s.weight.new_zeros(s.out_features)
                          for s in sources]) if group.bias else None
    return _linear(weight, bias, sources[0])


def uninitialised(sources: list[nn.Linear], group: Group) -> nn.Linear:
    """A Linear of the fused shape with uninitialised tensors (meta on a meta skeleton)."""
    first = sources[0].weight
    weight = torch.empty((group.out_features, group.in_features), dtype=first.dtype, device=first.device)
    bias = torch.empty((group.out_features,), dtype=first.dtype, device=first.device) if group.bias else None
    return _linear(weight, bias, sources[0])


def install(edit: Edit, module: nn.Module, fusion: Fusion,
             make: Callable[[list[nn.Linear], Group], nn.Linear]) -> None:
    """Replace ``fusion``'s projections on ``module`` and switch it to the fused computation."""
    # Build every new Linear before the first change, so a failure leaves the module as it was.
    fused = {g.name: make([module._modules[s] for s in g.sources], g) for g in fusion.groups}
    if fusion.forward == "shared":
        for group in fusion.groups:
            shared_projection.install(edit, module, group.name, group.sources, group.splits, fused[group.name],
                                group.zero_bias)
        return
    for group in fusion.groups:
        for source in group.sources:
            edit.delattr(module, source)   # not kept beside the fused copy: bytes do not grow
        edit.setattr(module, group.name, fused[group.name])
    if fusion.processor is not None:
        edit.setattr(module, "processor", _fused_processor(fusion.processor)())
    if fusion.fused_projections:
        edit.setattr(module, "fused_projections", True)
    if fusion.forward == "llama":
        edit.setattr(module, "qkv_split", fusion.groups[0].splits)
        _set_class(edit, module, fused_llama_class(type(module)))


def _fused_processor(name: str) -> type:
    if name not in FUSED_PROCESSORS.values():
        raise LoadError(f"fuse qkv: unknown fused processor {name!r} in the saved record")
    from diffusers.models import attention_processor as ap

    return getattr(ap, name)


def _set_class(edit: Edit, module: nn.Module, klass: type) -> None:
    """``module.__class__ = klass``, undone by rollback (the Edit restores attributes, not classes)."""
    old = type(module)
    edit.on_rollback(lambda: setattr(module, "__class__", old))
    module.__class__ = klass


@functools.cache
def fused_llama_class(base: type) -> type:
    """A subclass of ``base`` (a LlamaAttention) whose forward reads the fused ``qkv_proj``.

    Line for line ``LlamaAttention.forward`` of transformers 5.24 (checked by
    :data:`LLAMA_FORWARD_FINGERPRINT`), except that one matmul and a split (views, no copy)
    produce query, key and value.
    """
    from transformers.models.llama import modeling_llama as llama

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query, key, value = self.qkv_proj(hidden_states).split(self.qkv_split, dim=-1)
        query_states = query.view(hidden_shape).transpose(1, 2)
        key_states = key.view(hidden_shape).transpose(1, 2)
        value_states = value.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = llama.apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface = llama.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, llama.eager_attention_forward)

        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights

    # The same keyword handling as the original (``past_key_values`` → ``cache``).
    from transformers.utils.deprecation import deprecate_kwarg

    forward = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)
    name = FUSED_PREFIX + base.__name__
    return type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name,
                                "__doc__": f"{base.__name__} with q/k/v fused into qkv_proj (transformdsl)."})


FUSED_PREFIX = "QKVFused"


def __getattr__(name: str):
    """``QKVFusedLlamaAttention`` by name, so that pickle (``torch.save(model)``) finds the class."""
    if name == FUSED_PREFIX + "LlamaAttention":
        from transformers.models.llama.modeling_llama import LlamaAttention

        return fused_llama_class(LlamaAttention)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
