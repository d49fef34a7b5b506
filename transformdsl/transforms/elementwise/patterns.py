"""The chains ``fuse bias_*`` recognises at a module boundary, their fused forwards, and the fused copies.

A matched module is replaced by a *fused copy*: an instance of a subclass of its own class whose
``forward`` runs the projection's matmul without its bias, then one fused function for the rest;
the copy shares the original's children, so its state_dict is the original's key for key.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..common.modules import is_conv1d
from . import FUSED
from .kernels import kernel

# --------------------------------------------------------------------------- recognising modules

#: Activation module class name → the fused functions' name for it (same math, same
#: approximation: every tanh-formula GELU of transformers is gelu(approximate="tanh")).
_ACTIVATION_CLASSES = {
    "GELUActivation": "gelu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "AccurateGELUActivation": "gelu_tanh",
    "QuickGELUActivation": "quick_gelu",
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "ReLU": "relu",
}


def activation_kind(module: Any) -> str | None:
    """The fused functions' name for an activation module, or ``None`` if not supported."""
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if isinstance(module, nn.Module):
        return _ACTIVATION_CLASSES.get(type(module).__name__)
    return None


def _is_projection(layer: Any) -> bool:
    return type(layer) is nn.Linear or is_conv1d(type(layer), layer)


def _in_features(layer: nn.Module) -> int:
    weight = layer.weight
    return weight.shape[0] if is_conv1d(type(layer), layer) else weight.shape[1]


def _project(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x @ W, bias)``: the matmul without its bias, which the fused function adds.

    A layer that is not a plain ``Linear``/``Conv1D`` (quantized later, say) runs whole,
    its bias included, and the fused function gets no bias.  The exact type checks are
    the only per-call cost of this dispatch.
    """
    cls = type(layer)
    if cls is nn.Linear:
        return F.linear(x, layer.weight), layer.bias
    if is_conv1d(cls, layer):
        return torch.matmul(x, layer.weight), layer.bias
    return layer(x), None


def _describe_act(act: str) -> str:
    return {"gelu": "gelu", "gelu_tanh": "gelu(tanh)", "silu": "silu", "relu": "relu",
            "quick_gelu": "quick_gelu"}.get(act, act)


# --------------------------------------------------------------------------- the patterns
# A pattern is a mixin put in front of the matched module's own class.  ``match`` reads
# the module's structure and returns a JSON-able spec (what the record saves), None when
# the module is not of this pattern's shape at all, or raises Mismatch with the reason a
# module of this shape cannot be fused (a near miss).


class Mismatch(Exception):
    """A module has the pattern's shape but cannot be fused; the message says why."""


class FusedModule:
    """Base of the pattern mixins: the runtime switch, pickling, and what each pattern defines."""

    pattern: ClassVar[str]
    #: Attributes holding kernels (functions, compiled ones unpicklable): rebuilt from the spec.
    KERNEL_ATTRIBUTES: ClassVar[tuple[str, ...]] = ("_tdsl_in", "_tdsl_out", "_tdsl_fn")

    def forward(self, *args, **kwargs):
        if not FUSED.enabled:
            return super().forward(*args, **kwargs)
        return self._fused_forward(*args, **kwargs)

    def _configure(self, spec: dict, backend: str) -> None:
        self._tdsl_spec = spec
        self._tdsl_backend = backend
        self._setup(spec, backend)

    # -- pickling and deepcopy: the class is made at run time, so a pickle names the pattern and
    # the original class instead of it, and the kernels are looked up again from the spec.
    def __reduce_ex__(self, protocol):
        pattern, original = type(self).__bases__
        return _new_fused, (pattern.pattern, original), self.__getstate__()

    def __getstate__(self):
        state = super().__getstate__()
        for name in self.KERNEL_ATTRIBUTES:
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._setup(self._tdsl_spec, self._tdsl_backend)

    # -- per pattern
    @classmethod
    def match(cls, module: nn.Module) -> dict | None:
        """The spec of a fusable module, ``None`` if not this pattern; raises ``Mismatch``."""
        raise NotImplementedError

    @classmethod
    def describe(cls, spec: dict) -> str:
        raise NotImplementedError

    @classmethod
    def probe_inputs(cls, module: nn.Module, spec: dict, make: Callable[[int], torch.Tensor]) -> tuple:
        raise NotImplementedError

    def _setup(self, spec: dict, backend: str) -> None:
        raise NotImplementedError

    def _fused_forward(self, *args, **kwargs):
        raise NotImplementedError


class FeedForwardChain(FusedModule):
    """diffusers ``FeedForward``: ``net = [act(proj), Dropout, Linear, (Dropout)]``.

    Fused: ``proj``'s matmul, then bias + activation (GELU, GEGLU, SwiGLU...) + dropout in
    one function; the output projection's bias + final dropout in another, if there is one.
    """

    pattern = "feedforward"
    #: diffusers activation module → (fused function, activation); ``None``: read ``.activation``.
    ACTS: ClassVar[dict[str, tuple[str, str | None]]] = {
        "GELU": ("bias_act_dropout", None), "GEGLU": ("bias_glu_dropout", "gelu"),
        "SwiGLU": ("bias_glu_dropout", "silu"), "ApproximateGELU": ("bias_act_dropout", "quick_gelu"),
        "LinearActivation": ("bias_act_dropout", None)}

    @classmethod
    def match(cls, module):
        net = getattr(module, "net", None)
        if "FeedForward" not in [c.__name__ for c in type(module).__mro__] or not isinstance(net, nn.ModuleList):
            return None
        if len(net) not in (3, 4) or not isinstance(net[1], nn.Dropout):
            raise Mismatch("net is not [activation, Dropout, Linear(, Dropout)]")
        act_module = net[0]
        name = type(act_module).__name__
        if name not in cls.ACTS or not type(act_module).__module__.startswith("diffusers"):
            raise Mismatch(f"activation {name} is not supported (GELU, GEGLU, SwiGLU, ApproximateGELU, "
                            "LinearActivation are)")
        function, act = cls.ACTS[name]
        if name == "GELU":
            act = "gelu_tanh" if act_module.approximate == "tanh" else "gelu"
        elif act is None:
            act = activation_kind(getattr(act_module, "activation", None))
            if act is None:
                raise Mismatch(f"activation {type(act_module.activation).__name__} is not supported")
        if not _is_projection(getattr(act_module, "proj", None)):
            raise Mismatch(f"{name}.proj is not a Linear")
        final_dropout = len(net) == 4
        if final_dropout and not isinstance(net[3], nn.Dropout):
            raise Mismatch("net[3] is not a Dropout")
        return {"function": function, "act": act, "final_dropout": final_dropout}

    @classmethod
    def describe(cls, spec):
        act = _describe_act(spec["act"])
        if spec["function"] == "bias_glu_dropout":
            act = f"hidden * {act}(gate)"
        tail = "; net.2 → +bias → dropout" if spec["final_dropout"] else ""
        return f"FeedForward net.0.proj → +bias → {act} → dropout{tail}"

    @classmethod
    def probe_inputs(cls, module, spec, make):
        return (make(_in_features(module.net[0].proj)),)

    def _setup(self, spec, backend):
        self._tdsl_act = spec["act"]
        self._tdsl_in = kernel(spec["function"], backend)
        self._tdsl_out = kernel("bias_act_dropout", backend) if spec["final_dropout"] else None

    def _fused_forward(self, hidden_states, *args, **kwargs):
        net = self.net
        dropout = net[1]
        h, bias = _project(net[0].proj, hidden_states)
        h = self._tdsl_in(h, bias, self._tdsl_act, dropout.p, dropout.training)
        if self._tdsl_out is None:
            return net[2](h)
        h, bias = _project(net[2], h)
        return self._tdsl_out(h, bias, "identity", net[3].p, net[3].training)


class MLPChain(FusedModule):
    """Two projections around an activation, maybe a dropout after: GPT-2 (``c_fc → act →
    c_proj → dropout``), GPT-J (``fc_in/fc_out``), CLIP (``fc1 → activation_fn → fc2``), and
    BERT's ``Intermediate`` (``dense → intermediate_act_fn``, no second projection).

    Fused: bias + activation after the first matmul; bias + dropout after the second.
    """

    pattern = "mlp"
    #: (first projection, activation, second projection or None, dropout or None).
    LAYOUTS: ClassVar[tuple[tuple[str, str, str | None, str | None], ...]] = (
        ("c_fc", "act", "c_proj", "dropout"),
        ("fc_in", "act", "fc_out", "dropout"),
        ("fc1", "activation_fn", "fc2", None),
        ("dense", "intermediate_act_fn", None, None),
    )

    @classmethod
    def match(cls, module):
        children = module._modules
        for first, act, second, dropout in cls.LAYOUTS:
            wanted = [n for n in (first, act, second) if n]
            if not all(n in children for n in wanted):
                continue
            extra = set(children) - set(wanted) - {dropout}
            if extra:
                raise Mismatch(f"has more children than {', '.join(wanted)}: {', '.join(sorted(extra))}")
            for name in (first, second):
                if name and not _is_projection(children[name]):
                    raise Mismatch(f"{name} is a {type(children[name]).__name__}, not a Linear/Conv1D")
            kind = activation_kind(children[act])
            if kind is None:
                raise Mismatch(f"activation {type(children[act]).__name__} is not supported")
            has_dropout = dropout is not None and isinstance(children.get(dropout), nn.Dropout)
            return {"names": [first, second, dropout if has_dropout else None], "act": kind}
        return None

    @classmethod
    def describe(cls, spec):
        first, second, dropout = spec["names"]
        text = f"{first} → +bias → {_describe_act(spec['act'])}"
        if second and dropout:
            text += f"; {second} → +bias → {dropout}"
        return text

    @classmethod
    def probe_inputs(cls, module, spec, make):
        return (make(_in_features(getattr(module, spec["names"][0]))),)

    def _setup(self, spec, backend):
        self._tdsl_names = tuple(spec["names"])
        self._tdsl_act = spec["act"]
        self._tdsl_fn = kernel("bias_act_dropout", backend)

    def _fused_forward(self, hidden_states):
        first, second, dropout = self._tdsl_names
        h, bias = _project(getattr(self, first), hidden_states)
        h = self._tdsl_fn(h, bias, self._tdsl_act, 0.0, False)
        if second is None:
            return h
        if dropout is None:
            return getattr(self, second)(h)
        drop = getattr(self, dropout)
        h, bias = _project(getattr(self, second), h)
        return self._tdsl_fn(h, bias, "identity", drop.p, drop.training)


class GatedMLPChain(FusedModule):
    """Llama/Mistral/Qwen MLP: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.

    Fused: both biases (when ``mlp_bias``), the activation and the product in one function.
    """

    pattern = "gated_mlp"
    NAMES = ("gate_proj", "up_proj", "down_proj", "act_fn")

    @classmethod
    def match(cls, module):
        children = module._modules
        if not all(n in children for n in cls.NAMES):
            return None
        for name in cls.NAMES[:3]:
            if not _is_projection(children[name]):
                raise Mismatch(f"{name} is a {type(children[name]).__name__}, not a Linear")
        kind = activation_kind(children["act_fn"])
        if kind is None:
            raise Mismatch(f"activation {type(children['act_fn']).__name__} is not supported")
        return {"act": kind, "bias": children["gate_proj"].bias is not None}

    @classmethod
    def describe(cls, spec):
        bias = " + bias" if spec.get("bias") else ""
        text = f"{_describe_act(spec['act'])}(gate_proj{bias}) * (up_proj{bias})"
        return text if bias else text + " (no bias, no dropout: only the activation and the product)"

    @classmethod
    def probe_inputs(cls, module, spec, make):
        return (make(_in_features(module.gate_proj)),)

    def _setup(self, spec, backend):
        self._tdsl_act = spec["act"]
        self._tdsl_fn = kernel("bias_gate_mul", backend)

    def _fused_forward(self, x):
        gate, gate_bias = _project(self.gate_proj, x)
        up, up_bias = _project(self.up_proj, x)
        return self.down_proj(self._tdsl_fn(gate, gate_bias, up, up_bias, self._tdsl_act))


class ResidualChain(FusedModule):
    """BERT-style output: ``forward(hidden_states, input_tensor)`` computing
    ``LayerNorm(dropout(dense(hidden_states)) + input_tensor)`` (or without the norm).

    ``bias_dropout_residual_layernorm`` fuses all of it; ``bias_dropout_residual`` fuses up
    to the residual add and runs the norm as it was.
    """

    pattern = "residual"
    ARGS = ("hidden_states", "input_tensor")

    @classmethod
    def match(cls, module):
        children = module._modules
        if not isinstance(children.get("dense"), nn.Module) or not isinstance(children.get("dropout"), nn.Dropout):
            return None
        try:
            params = list(inspect.signature(type(module).forward).parameters)[1:]
        except (TypeError, ValueError):  # pragma: no cover - builtins
            params = []
        if tuple(params) != cls.ARGS:
            raise Mismatch(f"forward takes ({', '.join(params)}), not (hidden_states, input_tensor)")
        if not _is_projection(children["dense"]):
            raise Mismatch(f"dense is a {type(children['dense']).__name__}, not a Linear")
        norm = children.get("LayerNorm")
        if norm is not None and type(norm) is not nn.LayerNorm:
            raise Mismatch(f"LayerNorm is a {type(norm).__name__}, not an nn.LayerNorm")
        return {"layernorm": norm is not None, "fuse_norm": norm is not None}

    @classmethod
    def describe(cls, spec):
        norm = " → LayerNorm" if spec["layernorm"] else ""
        if spec["layernorm"] and not spec["fuse_norm"]:
            norm = " (LayerNorm left separate)"
        return f"dense → +bias → dropout → +input_tensor{norm}"

    @classmethod
    def probe_inputs(cls, module, spec, make):
        dense = module.dense
        out = dense.weight.shape[1] if is_conv1d(type(dense), dense) else dense.weight.shape[0]
        return make(_in_features(dense)), make(out)

    def _setup(self, spec, backend):
        self._tdsl_norm = spec["fuse_norm"]
        self._tdsl_fn = kernel("bias_dropout_residual_layernorm" if spec["fuse_norm"] else "bias_dropout_residual",
                               backend)

    def _fused_forward(self, hidden_states, input_tensor):
        drop = self.dropout
        h, bias = _project(self.dense, hidden_states)
        if self._tdsl_norm:
            norm = self.LayerNorm
            return self._tdsl_fn(h, bias, input_tensor, drop.p, drop.training, norm.normalized_shape,
                                 norm.weight, norm.bias, norm.eps)
        h = self._tdsl_fn(h, bias, input_tensor, drop.p, drop.training)
        norm = self._modules.get("LayerNorm")
        return h if norm is None else norm(h)


PATTERNS: dict[str, type[FusedModule]] = {
    cls.pattern: cls for cls in (FeedForwardChain, MLPChain, GatedMLPChain, ResidualChain)}


# --------------------------------------------------------------------------- fused copies

_CLASSES: dict[tuple[type, type], type] = {}


def fused_class(pattern: type[FusedModule], original: type) -> type:
    """``Fused<Original>``: the pattern mixin in front of the module's own class.

    Being a subclass keeps ``isinstance`` checks of the libraries and class selectors
    (``in FeedForward``) true.  Each class is created once and published in this module
    so that pickling a fused model finds it.
    """
    key = (pattern, original)
    if key not in _CLASSES:
        name = f"Fused{original.__name__}"
        base = name
        counter = 1
        while name in globals() and not _is_ours(globals()[name], key):
            counter += 1
            name = f"{base}_{counter}"
        cls = type(name, (pattern, original), {"__module__": __name__, "__qualname__": name,
                                               "__doc__": f"{original.__name__} with a fused {pattern.pattern} chain."})
        _CLASSES[key] = cls
        globals()[name] = cls
    return _CLASSES[key]


def _is_ours(cls: object, key: tuple[type, type]) -> bool:
    return isinstance(cls, type) and cls.__bases__ == key


def fused_copy(module: nn.Module, pattern: type[FusedModule], spec: dict, backend: str) -> nn.Module:
    """A fused module sharing ``module``'s children, parameters and buffers (nothing copied).

    The attribute dictionaries are copied one level deep, so that replacing a child of the
    copy later (a quantized Linear) leaves the original, kept for rollback, as it was.
    """
    new = object.__new__(fused_class(pattern, type(module)))
    state = {}
    for name, value in module.__dict__.items():
        state[name] = copy.copy(value) if isinstance(value, (dict, set, list)) else value
    new.__dict__.update(state)
    new._configure(spec, backend)
    return new


def _new_fused(pattern: str, original: type) -> nn.Module:
    """An empty fused module (unpickling fills it through ``__setstate__``)."""
    return object.__new__(fused_class(PATTERNS[pattern], original))


def is_fused(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, FusedModule)


# --------------------------------------------------------------------------- plan-time checks

#: ``x = a + b``: an addition of two names written as a statement of a forward.
_ADD_LINE = re.compile(r"^\s*(\w+)\s*=\s*([\w.]+)\s*\+\s*([\w.]+)\s*(?:#.*)?$")


@functools.lru_cache(maxsize=256)
def residual_line(cls: type) -> str | None:
    """The first residual add written in ``cls.forward`` (quoted in near misses): ``x = y + x``,
    ``x = x + y`` or an addition of something named ``residual``.  Read once per class (reading
    source takes milliseconds; a model repeats one class per layer)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    for line in source.splitlines():
        found = _ADD_LINE.match(line)
        if found and (found[1] in found.group(2, 3) or "residual" in found.group(2, 3)):
            return line.strip()
    return None


@contextlib.contextmanager
def _eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Eval mode for a probe, restoring every module's own flag afterwards."""
    saved = [(m, m.training) for root in modules for m in root.modules()]
    for m, _ in saved:
        m.training = False
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def verify(module: nn.Module, pattern: type[FusedModule], spec: dict) -> str | None:
    """Run the original forward and the fused formula (uncompiled) on a probe input.

    Returns ``None`` when they agree, else why not.  Skipped on the meta device.
    """
    weight = next((p for p in module.parameters()), None)
    if weight is None or weight.device.type == "meta":
        return None
    generator = torch.Generator().manual_seed(0)

    def make(features: int) -> torch.Tensor:
        return torch.randn(2, 3, features, generator=generator).to(weight.device, weight.dtype)

    fused = fused_copy(module, pattern, spec, "eager")
    try:
        inputs = pattern.probe_inputs(module, spec, make)
        with torch.no_grad(), _eval_mode(module, fused):
            want = module(*inputs)
            got = fused._fused_forward(*inputs)
    except Exception as error:  # the forward does something the pattern did not expect
        return f"the fused formula does not run on it ({type(error).__name__}: {error})"
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return "its forward returns something else than the fused formula"
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    scale = max(1.0, want.abs().max().item())
    if (want - got).abs().max().item() > tolerance * scale:
        return f"its forward computes something else than {pattern.describe(spec)} (checked on a probe input)"
    return None
