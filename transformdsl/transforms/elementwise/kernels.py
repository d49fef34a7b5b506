"""The fused functions, and how they run (inductor or eager).

Pure functions of tensors and constants, so that inductor turns each into one kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import KERNELS

# --------------------------------------------------------------------------- the fused functions
# Pure functions of tensors and constants, so that inductor turns each into one kernel.
# ``act`` names an activation (see ``_activate``); the strings and floats are constants
# for torch.compile (it guards on them), the tensors may change shape freely.


def _activate(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "silu":
        return F.silu(x)
    if act == "relu":
        return F.relu(x)
    if act == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if act == "identity":
        return x
    raise ValueError(f"unknown activation {act!r}")


def bias_act_dropout(x: torch.Tensor, bias: torch.Tensor | None, act: str, p: float,
                     training: bool) -> torch.Tensor:
    """``dropout(act(x + bias))``."""
    if bias is not None:
        x = x + bias
    return F.dropout(_activate(x, act), p, training)


def bias_glu_dropout(x: torch.Tensor, bias: torch.Tensor | None, act: str, p: float,
                     training: bool) -> torch.Tensor:
    """GEGLU/SwiGLU: one projection holds ``[hidden | gate]``; ``dropout(hidden * act(gate))``."""
    if bias is not None:
        x = x + bias
    hidden, gate = x.chunk(2, dim=-1)
    return F.dropout(hidden * _activate(gate, act), p, training)


def bias_gate_mul(gate: torch.Tensor, gate_bias: torch.Tensor | None, up: torch.Tensor,
                  up_bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """Llama-style MLP: ``act(gate + gate_bias) * (up + up_bias)``."""
    if gate_bias is not None:
        gate = gate + gate_bias
    if up_bias is not None:
        up = up + up_bias
    return _activate(gate, act) * up


def bias_dropout_residual(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                          training: bool) -> torch.Tensor:
    """``dropout(x + bias) + residual``."""
    if bias is not None:
        x = x + bias
    return F.dropout(x, p, training) + residual


def bias_dropout_residual_layernorm(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                                    p: float, training: bool, shape: tuple[int, ...],
                                    weight: torch.Tensor | None, norm_bias: torch.Tensor | None,
                                    eps: float) -> torch.Tensor:
    """``layer_norm(dropout(x + bias) + residual)`` with the norm's own shape, affine and eps."""
    return F.layer_norm(bias_dropout_residual(x, bias, residual, p, training), shape, weight, norm_bias, eps)


FUNCTIONS: dict[str, Callable] = {f.__name__: f for f in (
    bias_act_dropout, bias_glu_dropout, bias_gate_mul, bias_dropout_residual, bias_dropout_residual_layernorm)}
_COMPILED: dict[str, Callable] = {}


def kernel(name: str, backend: str) -> Callable:
    """The fused function ``name`` as ``backend`` runs it: compiled once per process with
    inductor (lazily: the first call compiles), or the plain Python function (``eager``)."""
    function = FUNCTIONS[name]
    if backend == "eager":
        return function
    if backend != "inductor":
        raise ValueError(f"unknown kernel backend {backend!r}; one of {KERNELS}")
    if name not in _COMPILED:
        # dynamic=None: the first shape is specialised, a second one makes the changing
        # dimensions symbolic, so one kernel serves every block of a model.
        _COMPILED[name] = torch.compile(function, fullgraph=True, dynamic=None)
    return _COMPILED[name]
