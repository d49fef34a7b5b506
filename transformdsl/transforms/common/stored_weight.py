"""Layers that save a packed weight under the state-dict key ``weight`` and read ``.weight`` live.

``fp8 storage`` and weight-only int8 keep their float8 or int8 values as a buffer named
``weight`` (so a saved model has the keys a stock model has) and give model code that reads
``layer.weight`` the effective weight through a property, dequantized on each read.
"""

from __future__ import annotations

import torch
from torch import nn


class StoredWeight(nn.Module):
    """Base of such layers: registering the ``weight`` buffer never reads the property."""

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        # nn.Module.register_buffer (which load_state_dict(assign=True) and loading reach through
        # setattr) first asks hasattr(self, name): for "weight" that would run the property, a full
        # dequantize per layer on every load (and, on meta tensors, torch's Python reference
        # kernels through torch._dynamo).
        if name == "weight" and "weight" in self._buffers and (tensor is None or isinstance(tensor, torch.Tensor)):
            self._buffers["weight"] = tensor
            if persistent:
                self._non_persistent_buffers_set.discard(name)
            else:
                self._non_persistent_buffers_set.add(name)
            return
        super().register_buffer(name, tensor, persistent)
