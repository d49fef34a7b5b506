"""Tensors a module keeps as plain attributes, which ``state_dict()`` does not hold.

Some architectures compute tables in ``__init__`` and keep them as ordinary attributes rather
than buffers: QwenImage's ``pos_embed.pos_freqs``/``neg_freqs`` (complex tensors), Lumina2's
``rope_embedder.freqs_cis`` (a list of tensors).  A model rebuilt from its configuration on the
meta device has them on the meta device too, so ``save`` stores them beside the state_dict and
``load`` puts them back; without them the loaded model could not run.

Names are ``<module path>.<attribute>`` for a tensor and ``<module path>.<attribute>.<i>`` for
the items of a list or tuple of tensors; the layout goes into the metadata:
``{name: "tensor" | {"list": n} | {"tuple": n} | {"same_as": state_dict name}}``.  An attribute
that *is* one of the model's parameters or buffers (transformers' rotary embeddings keep
``original_inv_freq = self.inv_freq``) is not stored again: it becomes that tensor again on load.
Complex tensors (safetensors has no complex128) are stored as ``torch.view_as_real`` of them and
viewed as complex again on load, as the architecture's own attribute is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import LoadError


def collect(root: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors by saved name, layout)`` of the plain tensor attributes of ``root``'s modules.

    Tensors on the meta device (no data: nothing to save) are left out.
    """
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    state_names = {id(t): name for name, t in (*root.named_parameters(remove_duplicate=False),
                                                *root.named_buffers(remove_duplicate=False))}
    for path, module in root.named_modules(remove_duplicate=True):
        for attr, value in module.__dict__.items():
            name = f"{path}.{attr}" if path else attr
            if isinstance(value, torch.Tensor) and id(value) in state_names:
                layout[name] = {"same_as": state_names[id(value)]}
            elif isinstance(value, torch.Tensor):
                if not value.is_meta:
                    tensors[name] = _storable(value)
                    layout[name] = "tensor"
            elif isinstance(value, (list, tuple)) and value and all(
                    isinstance(t, torch.Tensor) and not t.is_meta for t in value):
                for i, t in enumerate(value):
                    tensors[f"{name}.{i}"] = _storable(t)
                layout[name] = {type(value).__name__ if type(value) in (list, tuple) else "tuple": len(value)}
    return tensors, layout


def check_layout(layout: Any, where: Any) -> dict[str, Any]:
    """The layout read from a file, checked (an error names ``where``)."""
    if not isinstance(layout, dict):
        raise LoadError(f"{where}: 'tensors.attributes' must map attribute names to their layout")
    for name, how in layout.items():
        kind, value = next(iter(how.items())) if isinstance(how, dict) and len(how) == 1 else (how, None)
        ok = isinstance(name, str) and name and (
            how == "tensor"
            or (kind in ("list", "tuple") and isinstance(value, int) and not isinstance(value, bool)
                and 0 < value <= 4096)
            or (kind == "same_as" and isinstance(value, str) and value))
        if not ok:
            raise LoadError(f"{where}: invalid attribute layout entry {str(name)[:80]!r}: {str(how)[:80]}")
    return layout


def saved_names(layout: dict[str, Any]) -> list[str]:
    """The tensor names the layout stores in the weights files."""
    names = []
    for name, how in layout.items():
        if how == "tensor":
            names.append(name)
        elif "same_as" not in how:
            names.extend(f"{name}.{i}" for i in range(next(iter(how.values()))))
    return names


def take(tensors: dict[str, torch.Tensor], layout: dict[str, Any], where: Any) -> dict[str, torch.Tensor]:
    """Remove the attribute tensors from the loaded ``tensors`` (the rest is the state_dict)."""
    missing = [name for name in saved_names(layout) if name not in tensors]
    if missing:
        raise LoadError(f"{where}: the weights files lack {len(missing)} attribute tensor(s) the metadata lists: "
                        + ", ".join(missing[:5]))
    return {name: tensors.pop(name) for name in saved_names(layout)}


def restore(root: nn.Module, layout: dict[str, Any], tensors: dict[str, torch.Tensor], where: Any) -> None:
    """Set the saved attribute tensors on ``root`` (each must exist there, with the same shape and
    kind of dtype: a float precision may differ, as for the state_dict)."""
    state: dict[str, torch.Tensor] = {}
    if any(isinstance(how, dict) and "same_as" in how for how in layout.values()):
        state = {**dict(root.named_parameters(remove_duplicate=False)),
                 **dict(root.named_buffers(remove_duplicate=False))}
    for name, how in layout.items():
        path, _, attr = name.rpartition(".")
        try:
            owner = root.get_submodule(path) if path else root
        except AttributeError:
            raise LoadError(f"{where}: saved attribute '{name}': this architecture has no module '{path}'") from None
        current = owner.__dict__.get(attr)
        if isinstance(how, dict) and "same_as" in how:
            if how["same_as"] not in state:
                raise LoadError(f"{where}: saved attribute '{name}' is the tensor '{how['same_as'][:80]}', which "
                                "this architecture does not have")
            if not isinstance(current, torch.Tensor):
                raise LoadError(f"{where}: saved attribute '{name}' is a tensor, but this architecture's is "
                                f"{_describe(current)}")
            value = state[how["same_as"]]
        elif how == "tensor":
            value = _as_stored(current, tensors[name])
            _check_like(current, value, name, where)
        else:
            kind, count = next(iter(how.items()))
            if not isinstance(current, (list, tuple)) or len(current) != count:
                raise LoadError(f"{where}: saved attribute '{name}' is a {kind} of {count} tensors, but this "
                                f"architecture's is {_describe(current)}")
            items = [_as_stored(have, tensors[f"{name}.{i}"]) for i, have in enumerate(current)]
            for i, (have, value) in enumerate(zip(current, items)):
                _check_like(have, value, f"{name}.{i}", where)
            value = list(items) if kind == "list" else tuple(items)
        owner.__dict__[attr] = value


def _storable(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _as_stored(current: Any, saved: torch.Tensor) -> torch.Tensor:
    """The saved tensor as the architecture holds it (complex again where it is complex)."""
    if (isinstance(current, torch.Tensor) and current.is_complex() and saved.dtype in (torch.float32, torch.float64)
            and saved.dim() >= 1 and saved.shape[-1] == 2):
        return torch.view_as_complex(saved.contiguous())
    return saved


def _check_like(current: Any, value: torch.Tensor, name: str, where: Any) -> None:
    if not isinstance(current, torch.Tensor):
        raise LoadError(f"{where}: saved attribute '{name}' is a tensor, but this architecture's is "
                        f"{_describe(current)}")
    same_kind = current.dtype == value.dtype or (current.is_floating_point() and value.is_floating_point()) or (
        current.is_complex() and value.is_complex())
    if tuple(current.shape) != tuple(value.shape) or not same_kind:
        raise LoadError(f"{where}: saved attribute '{name}' is {_tensor(value)} but this architecture's is "
                        f"{_tensor(current)}; was it saved from another model?")


def _tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {_tensor(value)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return "missing" if value is None else f"a {type(value).__name__}"
