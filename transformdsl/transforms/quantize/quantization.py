"""``quantize int8|nf4|fp4|hqq``: weight quantization with bitsandbytes and hqq (implementation).

Each selected linear layer (``nn.Linear``, or GPT-2's ``Conv1D`` whose weight is stored
transposed) is replaced, through the edit log, by a quantized layer built from its weight
(see ``layers.py``; bitsandbytes and hqq are imported only there, when a script runs).
The source tensors are read, never written, so a failed run rolls back bit-exactly.

The record returned by ``apply`` lists, per layer, its path, dimensions and dtypes: enough
for ``rebuild`` to replay the same structure on the meta device; the quantized tensors
themselves are saved and reloaded as they are (never quantized again).

>>> from torch import nn
>>> from transformdsl import plan
>>> model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
>>> plan(model, "quantize int8").steps[0].targets
['0', '2']
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...errors import LoadError
from ...explain import human_bytes
from ...extend import ApplyContext
from ...options import DTYPES
from ...tree import ModuleInfo, ModuleTree
from ..common.modules import is_conv1d, put_module, tied_weights
from ..lora import ADAPTER_CLASS, HOLDS_ADAPTERS
from . import ACTIVATION_GRIDS, BLOCK_LAYER_CLASS, QUANTIZED_CLASS_NAMES, HQQOptions
from . import FP4Quantization as FP4Declaration
from . import HQQQuantization as HQQDeclaration
from . import Int8Quantization as Int8Declaration
from . import NF4Quantization as NF4Declaration
from .weights import float_weight, state_bytes  # noqa: F401  (importable from here, as before)

#: Weight dtypes the backends quantize from.
FLOAT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _backend():
    """The quantized layer classes (imports bitsandbytes and hqq: seconds, so only when needed)."""
    from . import layers

    return layers


# --------------------------------------------------------------------------- layers


def linear_dims(info: ModuleInfo) -> tuple[int, int] | None:
    """(in_features, out_features) of a linear layer on the planning snapshot, if known."""
    shape = info.facts.get("weight_shape")
    if shape is not None and len(shape) == 2:
        return (shape[0], shape[1]) if is_conv1d(info.cls, info.module) else (shape[1], shape[0])
    in_f, out_f = info.facts.get("in_features"), info.facts.get("out_features")
    return (in_f, out_f) if isinstance(in_f, int) and isinstance(out_f, int) else None


def target_dtypes(tree: ModuleTree, targets: list[str]) -> set[str]:
    """The dtypes of ``targets`` on the planning snapshot (``"float32"``, ``"bfloat16"``...)."""
    return {str(tree[p].facts.get("dtype", "torch.float32")).removeprefix("torch.") for p in targets}


#: Planning snapshot → its tied weights: one walk per snapshot, not one per candidate.
def _read_by_parent(info: ModuleInfo, tree: ModuleTree) -> bool:
    """``nn.MultiheadAttention.out_proj`` (SigLIP's and CLIP's pooling heads): the parent passes
    ``out_proj.weight`` to ``F.multi_head_attention_forward`` and never calls the layer."""
    parent_path, _, name = info.path.rpartition(".")
    parent = tree.get(parent_path) if name == "out_proj" else None
    return parent is not None and issubclass(parent.cls, nn.MultiheadAttention)


def targets_device_type(tree: ModuleTree, targets: list[str]) -> str | None:
    """The device type (``cpu``, ``cuda``...) of the first target's weight; None when unknown."""
    for path in targets:
        module = tree[path].module
        weight = None if module is None else module._parameters.get("weight")
        if weight is not None:
            return weight.device.type
    return None


# --------------------------------------------------------------------------- the transforms


class QuantizeBehaviour:
    """What every quantization does (mixed into each declaration)."""

    #: Whether the quantized layer's ``.weight`` reads as a float weight (then a parent that
    #: reads its child's weight instead of calling it still works).
    float_weight: bool = False

    # -- planning -----------------------------------------------------------------

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        quantized = QUANTIZED_CLASS_NAMES.intersection(info.class_names)
        if quantized:
            return f"already quantized ({info.cls.__name__})"
        if ADAPTER_CLASS in info.class_names:
            return HOLDS_ADAPTERS
        if not self.float_weight and _read_by_parent(info, tree):
            return ("nn.MultiheadAttention reads out_proj.weight itself and never calls out_proj; a quantized "
                    "weight would reach its matmul")
        if info.cls.__name__ == "Conv1D" and not is_conv1d(info.cls, info.module):
            return "a Conv1D that is not GPT-2's transposed linear layer"
        dtype = info.facts.get("dtype")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return f"its weight is {str(dtype).removeprefix('torch.')}; quantization reads float32/bf16/fp16 weights"
        # A model with no weight loaded (a skeleton) is planned as it will be; on a partly loaded one
        # (modules offloaded to meta), the layers without weights are not, fused ones included.
        if info.facts.get("meta") and not (tree.weights_pending or tree.all_meta):
            return "its weight is on the meta device (not loaded)"
        if info.module is not None:
            weight = info.module._parameters.get("weight")
            if weight is None or weight.dim() != 2:
                return "no 2-D weight to quantize"
            bias = info.module._parameters.get("bias")
            if bias is not None and bias.dtype not in FLOAT_DTYPES:
                return f"its bias is {str(bias.dtype).removeprefix('torch.')}; expected float32/bf16/fp16"
            shared = tied_weights(tree).get(id(weight))
            if shared:
                return self.tied_reason(info, tree, [p for p in shared if p != info.path])
        return None

    def tied_reason(self, info: ModuleInfo, tree: ModuleTree, others: list[str]) -> str | None:
        """Why a layer whose weight other modules (``others``) hold too is left, or None where this mode
        quantizes it with them (GGUF's grids: a head tied to its embedding)."""
        return f"its weight is tied to {', '.join(others)}; quantizing it would untie them"

    def idle_reason(self, tree: ModuleTree) -> str | None:
        """Where nothing was selected because the model's linear layers are quantized already (their classes
        are no ``Linear``), say so, with the classes, instead of naming the default exclusions."""
        if self.statement.target or self.statement.scope:  # (a selection of the user's: its own words say more)
            return None
        held: dict[str, int] = {}
        grids = set()
        for info in tree:
            names = set(info.class_names)
            if names & QUANTIZED_CLASS_NAMES or BLOCK_LAYER_CLASS in names:
                held[info.cls.__name__] = held.get(info.cls.__name__, 0) + 1
                if BLOCK_LAYER_CLASS in names:
                    grids.add(getattr(info.cls, "kind", ""))
        if not held:
            return None
        shown = ", ".join(f"{name} x{count}" for name, count in sorted(held.items(), key=lambda kv: -kv[1]))
        text = f"the model's linear layers are quantized already ({shown}); quantize changes float layers"
        settable = sorted(grids & ACTIVATION_GRIDS)
        if settable:
            text += f" ('quantize {settable[0]} activations=int8' sets its {settable[0].upper()} layers' option)"
        return text

    def plan_effect(self, tree: ModuleTree, targets: list[str]) -> None:
        # The class stays (conflicts with later statements are found on the same paths);
        # the size becomes the quantized one, so later statements and explain see it.
        for path in targets:
            info = tree[path]
            estimate = self._estimate(info)
            if estimate is not None:
                tree.replace(path, info.cls, own_bytes=estimate, quantized=self.key())

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        before = after = 0
        for path in targets:
            estimate = self._estimate(tree[path])
            if estimate is None:
                return []
            before += tree[path].own_bytes
            after += estimate
        if not before:
            return []
        return [f"weights of the {len(targets)} layer(s): {human_bytes(before)} -> about {human_bytes(after)} "
                f"({after / before:.2f}x)"]

    def _estimate(self, info: ModuleInfo) -> int | None:
        dims = linear_dims(info)
        if dims is None:
            return None
        module = info.module
        has_bias = module is None or getattr(module, "bias", None) is not None
        dtype = info.facts.get("dtype", torch.float32)
        return self.estimate_bytes(self.options, dims[0], dims[1], has_bias, dtype)

    @classmethod
    def estimate_bytes(cls, options: Any, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> int:
        """Bytes the quantized layer will save (formula; tested against the real layers)."""
        raise NotImplementedError

    # -- execution ----------------------------------------------------------------

    @classmethod
    def backend(cls, options: Any):
        """The module holding the layer classes :meth:`build` uses (imported on first use)."""
        return _backend()

    def apply_blocks(self, ctx: ApplyContext, targets: list[str], stream, blocks: list[str]) -> dict:
        from .calibrated import apply_calibrated_blocks

        return apply_calibrated_blocks(self, ctx, targets, stream, blocks)

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        if self.needs_calibration:  # GPTQ, AWQ, SmoothQuant: fitted block by block on ctx.calibration
            from .calibrated import apply_calibrated

            return apply_calibrated(self, ctx, targets)
        backend = self.backend(self.options)
        layers = []
        before = after = 0
        for path in ctx.progress(targets, total=len(targets), desc=self.key()):
            old = ctx.root.get_submodule(path)
            weight, bias = float_weight(old)
            new = self.build(backend, self.options, weight, bias)
            new.train(old.training)
            entry = self.describe(path, old, weight, bias, new)
            ctx.edit.replace(ctx.root, path, new)
            layers.append(entry)
            before += state_bytes(old)
            after += state_bytes(new)
        return {"layers": layers, "bytes_before": before, "bytes_after": after}

    @classmethod
    def build(cls, backend, options: Any, weight: torch.Tensor, bias: torch.Tensor | None,
              layer: dict | None = None) -> nn.Module:
        """The quantized layer for a (out, in) weight; on the meta device, its empty structure.

        ``layer`` is the layer's record entry when rebuilding."""
        raise NotImplementedError

    @classmethod
    def calibration_grid(cls, options: Any, weight: torch.Tensor):
        """The grid (scales fixed) that a method learning from data rounds ``weight`` (out x in,
        float32) onto; modes without one are not offered ``method=``."""
        raise NotImplementedError(f"'{cls.key()}' has no method that learns from data")

    @classmethod
    def build_on_grid(cls, backend, options: Any, grid, weight: torch.Tensor, bias: torch.Tensor | None,
                      weight_dtype: torch.dtype) -> nn.Module:
        """The quantized layer holding ``weight`` (float32, on ``grid``) exactly."""
        raise NotImplementedError(f"'{cls.key()}' has no method that learns from data")

    def describe(self, path: str, old: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
                 new: nn.Module) -> dict:
        """The layer's record entry: what :meth:`rebuild` needs (JSON)."""
        return {
            "path": path,
            "in": int(weight.shape[1]),
            "out": int(weight.shape[0]),
            "dtype": FLOAT_DTYPES[weight.dtype],
            "bias": None if bias is None else FLOAT_DTYPES[bias.dtype],
            "source": type(old).__name__,
        }

    # -- other formats -------------------------------------------------------------

    @classmethod
    def export(cls, step, out) -> None:
        from .export import export_bitsandbytes

        export_bitsandbytes(step, out)

    @classmethod
    def import_checkpoint(cls, path, quantization_config, headers):
        from .imports import bitsandbytes_steps

        return bitsandbytes_steps(path, quantization_config, headers)

    # -- loading ------------------------------------------------------------------

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: Any) -> None:
        backend = cls.backend(options)
        for layer in checked_layers(record, cls.key()):
            with torch.device("meta"):
                weight = torch.empty(layer["out"], layer["in"], dtype=DTYPES[layer["dtype"]])
                bias = None if layer["bias"] is None else torch.empty(layer["out"], dtype=DTYPES[layer["bias"]])
            put_module(root, layer["path"], cls.build(backend, options, weight, bias, layer), cls.key())


def checked_layers(record: dict, key: str) -> list[dict]:
    """The record's layer entries, checked field by field (it comes from a file)."""
    layers = record.get("layers")
    if not isinstance(layers, list):
        raise LoadError(f"'{key}': the record has no list of layers")
    for entry in layers:
        ok = (isinstance(entry, dict) and isinstance(entry.get("path"), str) and entry["path"]
              and all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) and entry[k] > 0
                      for k in ("in", "out"))
              and entry.get("dtype") in DTYPES and (entry.get("bias") is None or entry.get("bias") in DTYPES))
        if not ok:
            raise LoadError(f"'{key}': malformed layer entry in the record: {str(entry)[:200]}")
    return layers


def _size(dtype_name: str | torch.dtype) -> int:
    dtype = DTYPES[dtype_name] if isinstance(dtype_name, str) else dtype_name
    return torch.empty(0, dtype=dtype).element_size()


# --------------------------------------------------------------------------- int8


#: The plan's note on ``quantize int8`` without ``threshold=``: where the default differs from the libraries
#: users come from (spec.md "quantize", the measurements behind the choice).
THRESHOLD_NOTE = ("threshold 0, bitsandbytes' default (no outlier decomposition); transformers' and diffusers' "
                  "BitsAndBytesConfig(load_in_8bit=True) use 6: more quality on models with outlier activations "
                  "(large LLMs), more time per call; threshold=6 matches them")


class Int8Quantization(QuantizeBehaviour, Int8Declaration):
    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        from .device_notes import int8_note, weight_only_note

        device = targets_device_type(tree, targets)
        if device and self.options.weight_only:  # the packed kernel decodes with bfloat16 activations
            return weight_only_note(device, target_dtypes(tree, targets), 8)
        return int8_note(device) if device else None

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        notes = super().notes(tree, targets)
        given = {option.name for option in self.statement.options}
        if targets and not self.options.weight_only and "threshold" not in given:
            notes.append(THRESHOLD_NOTE)
        return notes

    @classmethod
    def backend(cls, options):
        if options.weight_only:  # plain torch: no bitsandbytes import
            from . import int8_weight_only

            return int8_weight_only
        return _backend()

    @classmethod
    def build(cls, backend, options, weight, bias, layer=None):
        if options.weight_only:
            return backend.Int8WeightOnlyLinear.build(weight, bias)
        return backend.Int8Linear.build(weight, bias, options.threshold)

    @classmethod
    def calibration_grid(cls, options, weight):
        from .int8_weight_only import RowGrid

        return RowGrid(weight)

    @classmethod
    def build_on_grid(cls, backend, options, grid, weight, bias, weight_dtype):
        return backend.Int8WeightOnlyLinear(grid.codes(weight), grid.scale, bias, weight_dtype)

    @classmethod
    def estimate_bytes(cls, options, in_features, out_features, bias, dtype):
        # int8 weight, one fp32 scale per output row, bitsandbytes' 1-byte format tag, the bias as it was.
        tag = 0 if options.weight_only else 1
        return in_features * out_features + 4 * out_features + tag + (out_features * _size(dtype) if bias else 0)


# --------------------------------------------------------------------------- nf4 / fp4


class FourBitBehaviour(QuantizeBehaviour):

    @classmethod
    def build(cls, backend, options, weight, bias, layer=None):
        offset = (layer or {}).get("offset")
        if weight.is_meta and options.double_quant and not (
                isinstance(offset, (int, float)) and not isinstance(offset, bool) and math.isfinite(offset)):
            raise LoadError(f"'{cls.key()}': the record of '{(layer or {}).get('path')}' lacks its "
                            f"double-quantization offset (a finite number; the record has {str(offset)[:40]})")
        return backend.FourBitLinear.build(weight, bias, cls.mode, options.blocksize, options.double_quant,
                                           DTYPES[options.compute], nested_offset=offset)

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        from .device_notes import four_bit_note

        device = targets_device_type(tree, targets)
        return four_bit_note(device, self.options.compute) if device else None

    def describe(self, path, old, weight, bias, new):
        entry = super().describe(path, old, weight, bias, new)
        if new.nested_offset is not None:
            # Written as text into a quant-state tensor whose length depends on it: the
            # skeleton needs it to have the same shape as the saved tensor.
            entry["offset"] = new.nested_offset
        return entry

    @classmethod
    def estimate_bytes(cls, options, in_features, out_features, bias, dtype):
        n = in_features * out_features
        blocks = math.ceil(n / options.blocksize)
        total = math.ceil(n / 2) + 16 * 4 + 100  # packed weight, 16-entry code, JSON quant state
        if options.double_quant:
            total += blocks + 4 * math.ceil(blocks / 256) + 256 * 4 + 40  # uint8 absmax, its own state
        else:
            total += 4 * blocks  # one fp32 absmax per block
        return total + (out_features * _size(options.compute) if bias else 0)


class NF4Quantization(FourBitBehaviour, NF4Declaration):
    pass


class FP4Quantization(FourBitBehaviour, FP4Declaration):
    pass


# --------------------------------------------------------------------------- hqq

#: Rows of quantized values hqq packs into one stored row, per bit width (3-bit: 10 per int32).
_HQQ_ROWS_PER_PACK = {1: 8, 2: 4, 3: 10, 4: 2, 8: 1}
#: The group sizes ``group_size=auto`` tries for each layer, largest first.
AUTO_GROUP_SIZES = (128, 64, 32, 16, 8)


class HQQQuantization(QuantizeBehaviour, HQQDeclaration):
    float_weight = True  # HQQLayer.weight: the dequantized weight

    @classmethod
    def export(cls, step, out) -> None:
        from .export import refuse_hqq

        refuse_hqq(step, out)

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        """A layer the group size does not suit is a near miss (the others are quantized)."""
        reason = super().candidate(info, tree)
        dims = linear_dims(info)
        if reason is not None or dims is None:
            return reason
        size, problem = layer_group_size(self.options, *dims)
        if problem and self.options.group_size != "auto":
            problem += "; group_size=auto picks a size per layer"
        return problem

    @classmethod
    def build(cls, backend, options, weight, bias, layer=None):
        size = (layer or {}).get("group_size")
        if size is None:
            size, problem = layer_group_size(options, weight.shape[1], weight.shape[0])
            if problem:
                raise LoadError(f"'{cls.key()}': {problem}") if weight.is_meta else ValueError(problem)
        elif not (isinstance(size, int) and not isinstance(size, bool) and size >= 8 and size % 8 == 0):
            raise LoadError(f"'{cls.key()}': the record of '{layer.get('path')}' has an invalid group size "
                            f"{str(size)[:40]}")
        elif options.group_size != "auto" and size != options.group_size:
            raise LoadError(f"'{cls.key()}': the record of '{layer.get('path')}' has group size {size}, the "
                            f"statement group_size={options.group_size} (a tampered save?)")
        return backend.HQQLayer.build(weight, bias, options.bits, size, options.axis, DTYPES[options.compute])

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        from .device_notes import hqq_note

        device = targets_device_type(tree, targets)
        return hqq_note(device) if device else None

    def describe(self, path, old, weight, bias, new):
        entry = super().describe(path, old, weight, bias, new)
        entry["group_size"] = int(new.meta["group_size"])  # per layer (group_size=auto): reload is exact
        return entry

    @classmethod
    def estimate_bytes(cls, options, in_features, out_features, bias, dtype):
        n = in_features * out_features
        size = layer_group_size(options, in_features, out_features)[0] or 64
        groups = n // size
        if options.bits == 3:
            rows = groups if options.axis == 1 else size
            packed = math.ceil(rows / 10) * (n // rows) * 4
        else:
            packed = n * options.bits // 8
        compute = _size(options.compute)
        return packed + 2 * groups * compute + (out_features * compute if bias else 0)


def layer_group_size(options: HQQOptions, in_features: int, out_features: int) -> tuple[int | None, str | None]:
    """``(group size, None)`` for this layer, or ``(None, why no size suits it)``."""
    if options.group_size != "auto":
        return options.group_size, _group_problem(options.bits, options.axis, options.group_size, in_features,
                                                  out_features)
    for size in AUTO_GROUP_SIZES:
        if _group_problem(options.bits, options.axis, size, in_features, out_features) is None:
            return size, None
    return None, (f"no group size of {', '.join(map(str, AUTO_GROUP_SIZES))} suits its {in_features}x{out_features} "
                  f"weights (in_features {in_features})")


def _group_problem(bits: int, axis: int, size: int, in_f: int, out_f: int) -> str | None:
    if axis == 1 and in_f % size:
        return f"group_size={size} does not divide its in_features ({in_f})"
    groups, rem = divmod(in_f * out_f, size)
    if rem:
        return f"group_size={size} does not divide its {in_f}x{out_f} weights"
    per_pack = _HQQ_ROWS_PER_PACK[bits]
    # axis=1: one stored row per group, packed `per_pack` rows at a time (3-bit pads).
    if axis == 1 and bits != 3 and groups % per_pack:
        return (f"bits={bits} packs {per_pack} groups together but it has {groups} groups of {size}; use a smaller "
                "group_size")
    return None
