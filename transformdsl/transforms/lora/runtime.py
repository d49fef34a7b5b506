"""Switchable LoRAs at run time: :func:`set_lora` and :func:`lora_adapters` (public as ``transformdsl.*``).

A LoRA kept with ``merge=false`` is one :class:`~.layers.LoraAdapter` per layer it touches, all
under the same name.  Changing its scale writes the adapters' ``scale`` buffers in place: the next
call uses it, nothing is reloaded, and a compiled model does not recompile (the graph reads the
buffer).  Disabling flips a plain attribute the forward tests: the next call skips the adapter's
two matmuls, and a compiled model recompiles once for each state it meets (then both are cached).
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import TransformError
from . import layers


def _adapters(model: Any) -> dict[str, list[layers.LoraAdapter]]:
    from ...planner import module_components

    found: dict[str, list[layers.LoraAdapter]] = {}
    for root in module_components(model).values():
        for module in root.modules():
            adapters = module._modules.get(layers.ADAPTERS) if isinstance(module, layers.LoraLayerMixin) else None
            for name, adapter in (adapters or {}).items():
                found.setdefault(name, []).append(adapter)
    return found


def lora_adapters(model: Any) -> dict[str, dict]:
    """The switchable LoRAs of ``model`` (a module or a pipeline): name → ``{"scale", "enabled", "layers"}``."""
    out = {}
    for name, adapters in _adapters(model).items():
        out[name] = {"scale": float(adapters[0].scale.item()), "enabled": adapters[0].enabled, "layers": len(adapters)}
    return out


def set_lora(model: Any, name: str, scale: float | None = None, *, enabled: bool | None = None) -> None:
    """Set the scale of the switchable LoRA ``name`` and/or enable or disable it, in place, without reloading.

    ``set_lora(pipe, "style", 0.5)`` halves its effect; ``set_lora(pipe, "style", enabled=False)``
    turns it off (``enabled=True`` back on, with the scale it had).  Raises :class:`TransformError`
    naming the adapters the model has when it has none named ``name``.
    """
    found = _adapters(model)
    if name not in found:
        have = ", ".join(sorted(found)) or "none (a LoRA kept switchable comes from 'lora ... merge=false')"
        raise TransformError(f"no switchable LoRA named {name!r}; the model has: {have}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale:
            raise TypeError(f"scale must be a number, got {scale!r}")
    with torch.no_grad():
        for adapter in found[name]:
            if scale is not None:
                adapter.scale.fill_(float(scale))
            if enabled is not None:
                adapter.enabled = bool(enabled)
