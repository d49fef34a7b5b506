"""``fp8 storage`` and ``fp8 native``: weights in float8, upcast per layer or multiplied natively (implementation).

``fp8 storage`` replaces each selected ``Linear``/``Conv``/``Embedding`` (and GPT-2's ``Conv1D``)
with a module that keeps its weight as a float8 *buffer* plus one float32 scale per output
channel, and upcasts the weight to the ``compute`` dtype inside ``forward``.  Keeping the
fp8 tensor as a plain buffer and doing the cast in ``forward`` (not in a hook) is what lets
``torch.compile(fullgraph=True)`` trace it; a buffer rather than a ``Parameter`` keeps
diffusers' ``ModelMixin.dtype`` (its first floating *parameter*) at the model's real dtype.

``fp8 native`` replaces each selected ``nn.Linear`` with :class:`FP8Linear` in native mode:
float8 e4m3 weight with a tensor-wise or row-wise scale, activations quantized dynamically
at every call, and ``torch._scaled_mm``.  Where that cannot run it falls back to the same
upcast as storage, and the plan says so:

- a layer whose shapes break the CUDA kernel rules (:func:`cuda_scaled_mm_problems`) is
  stored in fp8 and upcast (listed in the plan with the reason; an error with ``strict=true``);
- a device without fp8 tensor cores (CPU, CUDA before compute capability 8.9, ROCm) upcasts
  every native layer (a plan note; an error with ``strict=true``).  On CPU,
  the switch :data:`CPU_SCALED_MM` runs ``torch._scaled_mm``'s CPU reference
  instead: slow, but the exact code path a GPU takes, after the CUDA rules are checked here
  (the CPU kernel itself accepts layouts and sizes that CUDA rejects).

Every module here returns its output in its *input's* dtype, so a layer can be dropped into a
model of any dtype; ``compute`` is the dtype the matmul (or convolution) runs in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import LoadError
from ...extend import ApplyContext
from ...tree import ModuleInfo, ModuleTree, class_names
from ..common.modules import is_conv1d, put_module, tied_weights
from ..lora import ADAPTER_CLASS, HOLDS_ADAPTERS
from ..quantize import QUANTIZED_CLASS_NAMES
from . import SCALE_MODES
from . import FP8Native as NativeDeclaration
from . import FP8Storage as StorageDeclaration
from .cuda import device_fp8_problem, native_layer_problems
from .layers import FP8Conv, FP8Conv1D, FP8Embedding, FP8Linear, FP8Module
from .numerics import FP8_DTYPES, NATIVE_DTYPE, torch_dtype

# --------------------------------------------------------------------------- which layers


#: Convolutions ``fp8 storage`` converts (ConvTranspose is not: its forward takes an output size).
_CONV_CLASSES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _kind(cls: type) -> str | None:
    """The layer kind fp8 knows for this class, by the same rule as ``quantize``: ``nn.Linear``
    and its subclasses (Falcon's ``FalconLinear``...), except layers that already hold quantized
    weights (bitsandbytes'); convolutions and embeddings, and their subclasses that keep the
    base class's computation (a subclass with its own ``forward``, e.g. a causal-padding
    convolution, would lose it); GPT-2's ``Conv1D``."""
    if issubclass(cls, nn.Linear):
        return None if QUANTIZED_CLASS_NAMES.intersection(class_names(cls)) else "linear"
    for base in _CONV_CLASSES:
        if issubclass(cls, base) and _same_computation(cls, base, ("forward", "_conv_forward")):
            return "conv"
    if issubclass(cls, nn.Embedding) and _same_computation(cls, nn.Embedding, ("forward",)):
        return "embedding"
    if is_conv1d(cls):
        return "conv1d"
    return None


def _same_computation(cls: type, base: type, methods: tuple[str, ...]) -> bool:
    return all(getattr(cls, name, None) is getattr(base, name, None) for name in methods)


def _layer_reason(info: ModuleInfo, tree: ModuleTree, kinds: tuple[str, ...], verb: str) -> str | None:
    """Why a selected module cannot get an fp8 weight (a near miss), or ``None``."""
    if info.module is not None and isinstance(info.module, FP8Module):
        return "already has a float8 weight"
    if ADAPTER_CLASS in info.class_names:
        return HOLDS_ADAPTERS
    kind = _kind(info.cls)
    if kind not in kinds:
        names = {"linear": "Linear", "conv": "Conv1d/2d/3d", "embedding": "Embedding", "conv1d": "Conv1D"}
        return f"{verb} changes {', '.join(names[k] for k in kinds)} layers, not {info.cls.__name__}"
    module = info.module
    dtype = info.facts.get("dtype") if module is None else getattr(module, "weight", None).dtype
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"weight dtype {dtype} is not float32/bfloat16/float16"
    weight = info.module._parameters.get("weight") if info.module is not None else None
    shared = [p for p in tied_weights(tree).get(id(weight), []) if p != info.path] if weight is not None else []
    if shared:
        return f"weight is tied to {', '.join(shared[:2])}: an fp8 copy would keep both in memory"
    if kind == "embedding" and module is not None and module.max_norm is not None:
        return "Embedding with max_norm renormalises its weight in place at forward"
    return None


def _features(info: ModuleInfo) -> tuple[int, int]:
    """(in_features, out_features) of a Linear, from the live module or planning facts."""
    if info.module is not None:
        return info.module.in_features, info.module.out_features
    facts = info.facts
    if "in_features" in facts and "out_features" in facts:
        return facts["in_features"], facts["out_features"]
    out_features, in_features = facts["weight_shape"]
    return in_features, out_features


def _has_bias(info: ModuleInfo) -> bool:
    return info.module is None or info.module.bias is not None


def _model_device(tree: ModuleTree, targets: list[str]) -> torch.device | None:
    for path in [*targets, ""]:
        info = tree.get(path)
        module = info.module if info is not None else None
        if module is None:
            continue
        for tensor in module.parameters():
            # Weights still to be read (convert) are read to the CPU.
            return torch.device("cpu") if tensor.is_meta and tree.weights_pending else tensor.device
    return None


def _fp8_bytes(info: ModuleInfo, scale_values: int) -> int:
    """Bytes of the layer once converted: 1 per weight, 4 per scale, the bias unchanged."""
    shape = info.facts.get("weight_shape")
    if shape is None and info.module is not None:
        shape = tuple(info.module.weight.shape)
    if shape is None:
        return info.own_bytes
    weight = 1
    for d in shape:
        weight *= d
    bias = info.module.bias if info.module is not None and getattr(info.module, "bias", None) is not None else None
    bias_bytes = bias.numel() * bias.element_size() if bias is not None else 0
    return weight + 4 * scale_values + bias_bytes


def _channel_count(info: ModuleInfo) -> int:
    """Number of per-output-channel scales storage keeps for this layer."""
    shape = info.facts.get("weight_shape") or (tuple(info.module.weight.shape) if info.module is not None else (1,))
    return shape[1] if _kind(info.cls) == "conv1d" else shape[0]


#: The weight dtypes a layer's record may name (the dtype of the weight it replaced).
_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _with_weight_dtype(layer: FP8Module, spec: dict, path: str) -> FP8Module:
    """The layer with the weight dtype its record names (records before it was kept: the
    skeleton's dtype, which the constructor took)."""
    name = spec.get("weight_dtype")
    if name is not None:
        if name not in _WEIGHT_DTYPES:
            from ...errors import LoadError

            raise LoadError(f"fp8: the record of '{path}' names weight dtype {str(name)[:40]!r}; expected one of "
                            f"{', '.join(_WEIGHT_DTYPES)}")
        layer.weight_dtype = _WEIGHT_DTYPES[name]
    return layer


def _ratio_note(before: int, after: int) -> str:
    from ...explain import human_bytes

    ratio = after / before if before else 1.0
    return f"selected layers: {human_bytes(before)} → {human_bytes(after)} ({ratio:.2f}x)"


# --------------------------------------------------------------------------- fp8 storage


def export_fp8(cls, step, out) -> None:
    """fp8 layers in transformers' (or compressed-tensors') fp8 format (:mod:`.export`)."""
    from .export import export_fp8 as export

    export(step, out)


class FP8Storage(StorageDeclaration):
    KINDS = ("linear", "conv", "embedding", "conv1d")
    export = classmethod(export_fp8)

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        return _layer_reason(info, tree, self.KINDS, "fp8 storage")

    def scale_count(self, info: ModuleInfo) -> int:
        """Scales kept for this layer under the ``scale`` option."""
        return {"row": _channel_count(info), "tensor": 1, "none": 0}[self.options.scale]

    def plan_effect(self, tree: ModuleTree, targets: list[str]) -> None:
        for path in targets:
            info = tree[path]
            tree.replace(path, info.cls, own_bytes=_fp8_bytes(info, self.scale_count(info)))

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        if not targets:
            return []
        fmt = FP8_DTYPES[self.options.dtype]
        before = sum(tree[p].own_bytes for p in targets)
        after = sum(_fp8_bytes(tree[p], self.scale_count(tree[p])) for p in targets)
        scales = {"row": "a float32 scale per output channel", "tensor": "one float32 scale per weight",
                  "none": "no scale (a plain cast)"}[self.options.scale]
        return [f"weights stored as {str(fmt).removeprefix('torch.')} with {scales}, "
                f"upcast to {self.options.compute} at each forward; " + _ratio_note(before, after)]

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        fmt, compute = FP8_DTYPES[self.options.dtype], torch_dtype(self.options.compute)
        layers = {}
        for path in ctx.progress(targets, total=len(targets), desc="fp8 storage"):
            old = ctx.root.get_submodule(path)
            kind = _kind(type(old))
            ctx.edit.replace(ctx.root, path, _convert(old, kind, fmt, compute, self.options.scale))
            layers[path] = {"kind": kind, "weight_dtype": _dtype_name(old.weight.dtype)}
        return {"dtype": self.options.dtype, "compute": self.options.compute,
                "scale": self.options.scale, "layers": layers}

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: Any) -> None:
        fmt, compute = FP8_DTYPES[record["dtype"]], torch_dtype(record["compute"])
        scale = record.get("scale", "row")  # saves from before the option are per-row
        if scale not in SCALE_MODES:
            raise LoadError(f"fp8 storage: unknown scale {str(scale)[:40]!r} in the record (expected one of "
                            f"{', '.join(SCALE_MODES)})")
        for path, spec in record["layers"].items():
            layer = _empty(root.get_submodule(path), spec["kind"], fmt, compute, scale)
            put_module(root, path, _with_weight_dtype(layer, spec, path), cls.key())


def _layer_class(kind: str) -> type[FP8Module]:
    """The fp8 module class for a layer kind (``linear``, ``conv``, ``embedding``, ``conv1d``)."""
    classes = {"linear": FP8Linear, "conv": FP8Conv, "embedding": FP8Embedding, "conv1d": FP8Conv1D}
    if kind not in classes:
        raise LoadError(f"fp8: unknown layer kind {str(kind)[:40]!r} in the record (expected one of "
                        f"{', '.join(classes)})")
    return classes[kind]


def _convert(old: nn.Module, kind: str, fmt: torch.dtype, compute: torch.dtype, scale: str = "row") -> FP8Module:
    """A new fp8 module computed from ``old`` (which is left untouched)."""
    build = {FP8Linear: FP8Linear.from_linear, FP8Conv: FP8Conv.from_conv,
             FP8Embedding: FP8Embedding.from_embedding, FP8Conv1D: FP8Conv1D.from_conv1d}[_layer_class(kind)]
    return build(old, fmt, compute, scale=scale)


def _empty(old: nn.Module, kind: str, fmt: torch.dtype, compute: torch.dtype, scale: str = "row") -> FP8Module:
    """The same structure, nothing computed (for loading)."""
    return _layer_class(kind).empty(old, fmt, compute, scale=scale)


# --------------------------------------------------------------------------- fp8 native


class FP8Native(NativeDeclaration):
    export = classmethod(export_fp8)

    @property
    def compute(self) -> torch.dtype:
        return torch_dtype(self.options.compute)

    def layer_problems(self, info: ModuleInfo) -> list[str]:
        """Why this Linear cannot run ``torch._scaled_mm`` on a GPU (empty if it can)."""
        in_features, out_features = _features(info)
        return native_layer_problems(in_features, out_features, self.options.scaling, self.compute,
                                     _has_bias(info))

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        return _layer_reason(info, tree, ("linear",), "fp8 native")

    def check(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        if not self.options.strict:
            return None
        problems = self.layer_problems(info)
        if problems:
            return "; ".join(problems) + " (strict=true: no upcast fallback)"
        device = _model_device(tree, [info.path])
        problem = device_fp8_problem(device) if device is not None else None
        if problem:
            return f"{problem} (strict=true: no upcast fallback)"
        return None

    def scale_count(self, info: ModuleInfo) -> int:
        """Scales kept for this layer: one per output row (row-wise, or a fallback layer) or one."""
        if self.options.scaling == "row" or self.layer_problems(info):
            return _features(info)[1]
        return 1

    def plan_effect(self, tree: ModuleTree, targets: list[str]) -> None:
        for path in targets:
            info = tree[path]
            tree.replace(path, info.cls, own_bytes=_fp8_bytes(info, self.scale_count(info)))

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        # GPT-2's projections are linear layers that are not nn.Linear: say so, never skip silently.
        conv1d = [i.path for i in tree if "Conv1D" in i.class_names and i.path not in targets]
        unhandled = ([f"{len(conv1d)} transformers Conv1D layer(s) (linear layers with a transposed weight, "
                      f"e.g. {conv1d[0]}) are not nn.Linear and do not run natively; 'fp8 storage' handles them"]
                     if conv1d else [])
        if not targets:
            return unhandled
        fallback = {p: self.layer_problems(tree[p]) for p in targets}
        fallback = {p: r for p, r in fallback.items() if r}
        native = len(targets) - len(fallback)
        notes = [f"{native} layer(s) native: torch._scaled_mm on e4m3 weights and inputs, {self.options.scaling}-wise "
                 f"scales (dynamic for inputs), {self.options.compute} output"]
        if fallback:
            shown = "; ".join(f"{p}: {', '.join(r)}" for p, r in list(fallback.items())[:4])
            more = f" (+{len(fallback) - 4} more)" if len(fallback) > 4 else ""
            notes.append(f"{len(fallback)} layer(s) cannot run torch._scaled_mm on a GPU and are stored in fp8 "
                         f"with upcast instead: {shown}{more}")
        before = sum(tree[p].own_bytes for p in targets)
        after = sum(_fp8_bytes(tree[p], self.scale_count(tree[p])) for p in targets)
        notes.append(_ratio_note(before, after))
        return unhandled + notes

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        device = _model_device(tree, targets)
        problem = device_fp8_problem(device) if device is not None and device.type != "meta" else None
        if not problem:
            return None
        hint = (" (transformdsl.transforms.fp8.CPU_SCALED_MM.set(True) runs torch._scaled_mm's slow CPU "
                "reference instead)") if device.type == "cpu" else ""

        cost = _upcast_cost() if device.type == "cpu" else None
        measured = f", measured {cost}; fp8 saves memory here, not time" if cost else ""
        return (f"fallback: {problem}; native layers upcast their fp8 weights to {self.options.compute} "
                f"on it{measured}{hint}; strict=true makes this an error")

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        layers = {}
        for path in ctx.progress(targets, total=len(targets), desc="fp8 native"):
            old = ctx.root.get_submodule(path)
            problems = native_layer_problems(old.in_features, old.out_features, self.options.scaling,
                                             self.compute, old.bias is not None)
            # A layer that cannot run natively is plain storage-with-upcast (per-row scales).
            new = FP8Linear.from_linear(old, NATIVE_DTYPE, self.compute, native=not problems,
                                        scaling=self.options.scaling, strict=self.options.strict)
            ctx.edit.replace(ctx.root, path, new)
            layers[path] = {"kind": "linear", "native": not problems, "weight_dtype": _dtype_name(old.weight.dtype)}
            if problems:
                layers[path]["fallback"] = "; ".join(problems)
        return {"scaling": self.options.scaling, "compute": self.options.compute,
                "strict": self.options.strict, "layers": layers}

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: Any) -> None:
        compute, scaling = torch_dtype(record["compute"]), record["scaling"]
        for path, spec in record["layers"].items():
            layer = FP8Linear.empty(root.get_submodule(path), NATIVE_DTYPE, compute, native=spec["native"],
                                    scaling=scaling, strict=record["strict"])
            put_module(root, path, _with_weight_dtype(layer, spec, path), cls.key())


def _upcast_cost() -> str | None:
    """What upcasting fp8 layers costs on this kind of CPU, as the benchmarks measured it, with its
    source (for the fp8 native fallback note); None when not measured here."""
    from ...capabilities import cited, measured_latency

    cost = measured_latency("flux-medium", "fp8 native")
    return cited(cost, cost) if cost else None
