"""Recording what a pipeline really feeds its denoiser, for ``calibrate "inputs.safetensors"``.

>>> with record_inputs(pipe, "calibration.safetensors"):        # doctest: +SKIP
...     pipe("a photo of a cat", num_inference_steps=8)
>>> transformdsl.transform(pipe, 'calibrate "calibration.safetensors"; quantize int4 method=gptq')  # doctest: +SKIP

While the block runs, a hook on the denoiser (``pipe.transformer`` or ``pipe.unet``, or the
component named) keeps the tensor arguments of each call (keyword arguments by name, positional
ones under the forward's parameter names); on leaving it, the calls are written atomically as
tensors named ``"<call>.<argument>"`` (``0.hidden_states``, ``0.timestep``...).  Non-tensor
arguments (``return_dict=False``, attention kwargs) are not kept: the calibration pass calls the
denoiser with the tensors only.  ``max_calls`` bounds what is kept (each call of a step loop is a
sample: 4 prompts x 8 steps = 32 samples).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import TransformError


def _denoiser(pipe: Any, component: str | None) -> torch.nn.Module:
    if isinstance(pipe, torch.nn.Module):
        return pipe
    components = getattr(pipe, "components", None) or {}
    if component is not None:
        module = components.get(component)
        if not isinstance(module, torch.nn.Module):
            raise TransformError(f"record_inputs: the pipeline has no module component '{component}' "
                                 f"(it has {', '.join(k for k, v in components.items() if isinstance(v, torch.nn.Module))})")
        return module
    for name in ("transformer", "unet", "prior", "decoder"):
        if isinstance(components.get(name), torch.nn.Module):
            return components[name]
    raise TransformError("record_inputs: no denoiser (transformer or unet) in this pipeline; name it with component=")


@contextmanager
def record_inputs(pipe: Any, path: str | os.PathLike, *, component: str | None = None,
                  max_calls: int = 256) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Record the denoiser's inputs while the ``with`` block runs the pipeline; write them to ``path``
    (a safetensors file) when it ends without an error.  Yields the list of calls so far."""
    module = _denoiser(pipe, component)
    names = list(inspect.signature(module.forward).parameters)
    calls: list[dict[str, torch.Tensor]] = []

    def hook(_module, args, kwargs):
        if len(calls) >= max_calls:
            return
        call = {}
        for name, value in zip(names, args):
            if isinstance(value, torch.Tensor):
                call[name] = value.detach().cpu().clone()
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                call[name] = value.detach().cpu().clone()
        calls.append(call)

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
    if not calls:
        raise TransformError("record_inputs: the denoiser was not called inside the with block; nothing was written")
    from safetensors.torch import save_file

    target = Path(path)
    temporary = target.with_name(f".{target.name}.partial")
    tensors = {f"{index}.{name}": value.contiguous() for index, call in enumerate(calls) for name, value in call.items()}
    save_file(tensors, str(temporary))
    os.replace(temporary, target)
