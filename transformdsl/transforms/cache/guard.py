"""``cache MODE``: our one hook on the denoiser, beside diffusers' (implementation).

:func:`make_guard` builds it (registered in diffusers' hook registry, so ``cache_context`` reaches it):

- a call outside ``cache_context`` raises diffusers' own message at the denoiser's call
  (:class:`CacheContextError`), not from deep inside the first block hook;
- for ``pyramid_broadcast`` and ``faster`` it remembers the call's timestep, which the
  ``current_timestep_callback`` we give diffusers returns (:func:`timestep_callback`);
- a mode's ``call_check`` says, at the call, what its hooks assume of the call and would fail on.

:func:`fresh_context` runs a model (or pipeline) once as a fresh denoising loop (verify, the zoo).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

GUARD_HOOK = "transformdsl_cache_guard"


class CacheContextError(ValueError):
    """A call a step cache cannot take, raised at the denoiser's call: outside ``cache_context`` (diffusers'
    own message, raised early), without the timestep the mode needs, or with inputs the mode's hooks would
    fail on deep inside (``cache faster``)."""


# --------------------------------------------------------------------------- the guard hook


def _hooks():
    from diffusers.hooks import hooks

    return hooks


class _NoState:
    def reset(self, *args, **kwargs) -> None:
        pass


def make_guard(statement: str, needs_context: bool, reads_timestep: bool, timestep_scale: float,
                call_check: Callable[[Any, tuple, dict], str | None] | None = None):
    """Our hook at the denoiser's call: the cache-context check, the call's timestep, and ``call_check``
    (what the mode's hooks assume of the call's inputs, said before they fail inside)."""
    hooks = _hooks()

    class ContextGuard(hooks.ModelHook):
        """Checks the cache context at the denoiser's call; remembers the call's timestep."""

        _is_stateful = True

        def __init__(self):
            super().__init__()
            self.state_manager = hooks.StateManager(_NoState)  # _set_cache_context sets its context
            self.statement = statement
            self.needs_context = needs_context
            self.reads_timestep = reads_timestep
            self.timestep_scale = timestep_scale
            self.timestep = None
            self._timestep_index = None
            self.call_check = call_check
            #: Denoiser calls since the cache was last reset (a new denoising loop starts at 0).
            self.calls = 0

        def initialize_hook(self, module):
            names = list(inspect.signature(type(module).forward).parameters)[1:]
            self._timestep_index = names.index("timestep") if "timestep" in names else None
            return module

        def pre_forward(self, module, *args, **kwargs):
            context = self.state_manager._context
            if context is None and self.needs_context:
                _raise_outside_context(module, self.statement, self.state_manager)
            if self.reads_timestep:
                if context is not None and context.timestep is not None:
                    self.timestep = (context.timestep, 1.0)
                else:
                    value = kwargs.get("timestep")
                    if value is None and self._timestep_index is not None and self._timestep_index < len(args):
                        value = args[self._timestep_index]
                    self.timestep = (value, self.timestep_scale)
            if self.call_check is not None:
                problem = self.call_check(self, args, kwargs)
                if problem:
                    raise CacheContextError(f"{self.statement}: {problem}")
            self.calls += 1
            return args, kwargs

        def reset_state(self, module):
            self.timestep = None
            self.calls = 0
            return module

        @torch.compiler.disable
        def current_timestep(self) -> float:
            if self.timestep is None or self.timestep[0] is None:
                raise CacheContextError(
                    f"{self.statement}: the cache needs the current timestep, and this call gave none: pass "
                    "timestep= to the denoiser, or cache_context(name, timestep=t)")
            value, scale = self.timestep
            if isinstance(value, torch.Tensor):
                value = value.detach().flatten()[0].item()
            return float(value) * scale

    return ContextGuard()


def _raise_outside_context(module: nn.Module, statement: str, state_manager) -> None:
    try:
        _ = state_manager.context  # raises diffusers' own message outside a context
    except ValueError as exc:
        message = str(exc)
    else:  # pragma: no cover - the context is set after all
        return
    raise CacheContextError(
        f"{message} ({type(module).__name__} has a step cache, '{statement}': call it as "
        f"`with model.cache_context(\"cond\"): model(...)`, one context per prompt branch; diffusers' pipelines "
        "do this themselves.  Between two denoising loops call model._reset_stateful_cache().)") from None


def guard_of(model: nn.Module):
    registry = getattr(model, "_diffusers_hook", None)
    return registry.get_hook(GUARD_HOOK) if registry is not None else None


@contextlib.contextmanager
def fresh_context(model: Any, name: str = "transformdsl"):
    """Run ``model`` (a module or a pipeline) once as a fresh denoising loop: each component with a
    step cache is reset and called inside ``cache_context(name)``, and reset again afterwards (so a
    check, e.g. ``verify``, leaves no cached step behind)."""
    from ...planner import module_components

    cached = [m for m in module_components(model).values() if getattr(m, "is_cache_enabled", False)]
    with contextlib.ExitStack() as stack:
        for module in cached:
            module._reset_stateful_cache()
            stack.callback(module._reset_stateful_cache)
            stack.enter_context(module.cache_context(name))
        yield


def timestep_scale(model: nn.Module) -> float:
    """1000 for denoisers whose forward multiplies the timestep by 1000 (their pipelines pass t/1000)."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return 1.0
    return 1000.0 if re.search(r"timestep[^\n]*\*\s*1000\b", source) else 1.0


def timestep_callback(guard):
    if guard is None:
        return lambda: 0.0  # planning: the config is only built to run diffusers' own checks
    return guard.current_timestep
