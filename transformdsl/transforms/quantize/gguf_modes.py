"""``quantize q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q4_k``, ``q5_k`` and ``q6_k`` (implementation): the quantize family's planning, apply
and reload (:mod:`.quantization`) with the GGUF block layers of :mod:`.gguf_blocks`.

A layer whose ``in_features`` is not a multiple of the block (32; Q4_K's super-block, 256) is a near miss.  In a
transformers/diffusers layout these layers are refused (no stock loader reads GGUF blocks from
safetensors): ``save(..., format="gguf")`` writes them as they are.

A head whose weight is tied to an ``nn.Embedding`` (SmolLM2's, Qwen2's small models', Gemma's...) is quantized with
it: the head holds the blocks and the embedding becomes a :class:`.gguf_blocks.BlockEmbedding` reading their rows, as a
GGUF file's ``token_embd`` serves both (one quantized copy where there was one float copy).

A layer that already holds GGUF blocks (a GGUF import's, or an earlier script's) is a target of the statement
whose mode is its own grid only: that statement sets the layer's options (``activations=``) and keeps its
blocks byte for byte (quantizing a dequantized block again is not always the identity: a Q4_0 block whose
largest magnitude is positive would move to another grid).  Other modes leave it, saying why.
"""

from __future__ import annotations

from torch import nn

from ...errors import LoadError
from ...tree import ModuleInfo, ModuleTree
from ..common.modules import put_module
from . import BLOCK_LAYER_CLASS
from . import Q4_0Quantization as Q4_0Declaration
from . import Q4_1Quantization as Q4_1Declaration
from . import Q4_KQuantization as Q4_KDeclaration
from . import Q5_0Quantization as Q5_0Declaration
from . import Q5_1Quantization as Q5_1Declaration
from . import Q5_KQuantization as Q5_KDeclaration
from . import Q6_KQuantization as Q6_KDeclaration
from . import Q8_0Quantization as Q8_0Declaration
from .quantization import (
    FLOAT_DTYPES,
    QuantizeBehaviour,
    checked_layers,
    linear_dims,
    target_dtypes,
    targets_device_type,
)
from .weights import state_bytes


def held_grid(info: ModuleInfo) -> str | None:
    """The GGUF grid (``"q4_0"``...) a planned module's blocks are on, or None for any other module."""
    return getattr(info.cls, "kind", None) if BLOCK_LAYER_CLASS in info.class_names else None


class GGUFBlockBehaviour(QuantizeBehaviour):
    float_weight = True  # BlockQuantizedLinear.weight: the dequantized weight

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        held = held_grid(info)
        if held is not None:
            if held != self.mode:
                return (f"it holds GGUF {held.upper()} blocks already ({info.cls.__name__}); only 'quantize {held}' "
                        "applies to it, to set its options")
            if not self.statement.options:
                return f"it holds GGUF {held.upper()} blocks already; the statement sets no option"
            return None
        reason = super().candidate(info, tree)
        dims = linear_dims(info)
        if reason is not None or dims is None:
            return reason
        if dims[0] % self.block_size:
            return f"in_features {dims[0]} is not a multiple of GGUF's block of {self.block_size}"
        return None

    def tied_reason(self, info: ModuleInfo, tree: ModuleTree, others: list[str]) -> str | None:
        if others and all(tree[path].cls is nn.Embedding for path in others):
            return None  # quantized together: the embedding reads the head's blocks (apply)
        return (super().tied_reason(info, tree, others) + " (a GGUF grid quantizes a head tied to an nn.Embedding "
                "only)")

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        from .device_notes import gguf_block_note
        from .gguf_blocks import PACKED_OUT_MULTIPLE

        device = targets_device_type(tree, targets)
        if device is None:
            return None
        if getattr(self.options, "activations", "float") == "int8":
            from .device_notes import gguf_int8_note

            return gguf_int8_note(device)
        narrow = sum(1 for p in targets if (linear_dims(tree[p]) or (0, 0))[1] % PACKED_OUT_MULTIPLE)
        return gguf_block_note(device, target_dtypes(tree, targets), self.mode, narrow)

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        held = sum(1 for path in targets if held_grid(tree[path]) is not None)
        floats = [path for path in targets if held_grid(tree[path]) is None]
        notes = super().notes(tree, floats) if floats else []
        if held:
            options = ", ".join(f"{option.name}={option.value}" for option in self.statement.options)
            notes.append(f"{held} layer(s) already hold {self.mode.upper()} blocks: their blocks are kept as they "
                         f"are, the statement sets {options}")
        return notes

    def apply(self, ctx, targets: list[str]) -> dict:
        """Float layers quantized; layers already on this grid keep their blocks and take the options (through
        ``ctx.edit``, so that a failure later on puts them back)."""
        from .gguf_blocks import BlockEmbedding

        held = {path: layer for path in targets if self._on_grid(layer := ctx.root.get_submodule(path))}
        floats = [path for path in targets if path not in held]
        tied = _tied_embeddings(ctx.root, floats)
        done = (super().apply(ctx, floats) if floats else {"layers": [], "bytes_before": 0, "bytes_after": 0})
        for entry in done["layers"]:
            if entry["path"] in tied:  # the embedding reads the head's blocks (the same bytes, one copy)
                head = ctx.root.get_submodule(entry["path"])
                for path, embedding in tied[entry["path"]]:
                    ctx.edit.replace(ctx.root, path, BlockEmbedding(head, embedding.padding_idx))
                entry["tied"] = [{"path": path, "padding_idx": embedding.padding_idx}
                                 for path, embedding in tied[entry["path"]]]
        for path, layer in held.items():
            ctx.edit.setattr(layer, "activations", self._activations(self.options))
            size = state_bytes(layer)
            done["layers"].append({"path": path, "in": layer.in_features, "out": layer.out_features,
                                   "dtype": FLOAT_DTYPES[layer.weight_dtype],
                                   "bias": None if layer.bias is None else FLOAT_DTYPES[layer.bias.dtype],
                                   "source": type(layer).__name__, "kept": True})
            done["bytes_before"] += size
            done["bytes_after"] += size
        return done

    @classmethod
    def _on_grid(cls, layer) -> bool:
        """Whether ``layer`` holds this mode's GGUF blocks already."""
        from .gguf_blocks import BlockQuantizedLinear

        return isinstance(layer, BlockQuantizedLinear) and layer.kind == cls.mode

    @staticmethod
    def _activations(options) -> str:
        return getattr(options, "activations", "float")  # (q5_1, q4_k, q5_k and q6_k have no option)

    @classmethod
    def rebuild(cls, root, record: dict, options) -> None:
        """Layers the statement found on its grid are those an earlier statement of the record rebuilt: they
        take the options; the others are built as quantized layers."""
        layers = checked_layers(record, cls.key())
        for entry in layers:
            if entry.get("kept") is not True:
                continue
            try:
                layer = root.get_submodule(entry["path"])
            except AttributeError:
                layer = None
            if not cls._on_grid(layer):
                raise LoadError(f"'{cls.key()}': {entry['path']} should hold {cls.mode.upper()} blocks from an "
                                f"earlier statement of the record, but holds {type(layer).__name__}")
            layer.activations = cls._activations(options)
        rest = [entry for entry in layers if entry.get("kept") is not True]
        if rest:
            super().rebuild(root, {**record, "layers": rest}, options)
        from .gguf_blocks import BlockEmbedding

        for entry in rest:
            for embedding in _checked_ties(entry, cls.key()):
                put_module(root, embedding["path"], BlockEmbedding(root.get_submodule(entry["path"]),
                                                                   embedding["padding_idx"]), cls.key())

    @classmethod
    def export(cls, step, out) -> None:
        raise out.refuse(step, f"GGUF's {cls.mode.upper()} blocks have no {out.library} layout",
                         "save with format='gguf' (llama.cpp) or format='transformdsl'")

    @classmethod
    def backend(cls, options):
        from . import gguf_blocks

        return gguf_blocks

    @classmethod
    def build(cls, backend, options, weight, bias, layer=None):
        built = backend.LAYERS[cls.mode].build(weight, bias)
        built.activations = cls._activations(options)
        return built

    @classmethod
    def estimate_bytes(cls, options, in_features, out_features, bias, dtype):
        from .gguf_blocks import BLOCK, BLOCK_BYTES, SUPER, SUPER_BYTES

        per_row = (in_features // SUPER * SUPER_BYTES[cls.mode] if cls.mode in SUPER_BYTES
                   else in_features // BLOCK * BLOCK_BYTES[cls.mode])
        return per_row * out_features + (out_features * dtype.itemsize if bias else 0)


class Q8_0Quantization(GGUFBlockBehaviour, Q8_0Declaration):
    pass


class Q4_0Quantization(GGUFBlockBehaviour, Q4_0Declaration):
    pass


class Q4_1Quantization(GGUFBlockBehaviour, Q4_1Declaration):
    pass


class Q4_KQuantization(GGUFBlockBehaviour, Q4_KDeclaration):
    pass


class Q5_0Quantization(GGUFBlockBehaviour, Q5_0Declaration):
    pass


class Q5_1Quantization(GGUFBlockBehaviour, Q5_1Declaration):
    pass


class Q5_KQuantization(GGUFBlockBehaviour, Q5_KDeclaration):
    pass


class Q6_KQuantization(GGUFBlockBehaviour, Q6_KDeclaration):
    pass


def _tied_embeddings(root: nn.Module, paths: list[str]) -> dict[str, list[tuple[str, nn.Embedding]]]:
    """For each layer at ``paths`` whose weight ``nn.Embedding`` modules hold too (a tied head), those embeddings
    with their paths; layers without one are left out."""
    embeddings: dict[int, list[tuple[str, nn.Embedding]]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if type(module) is nn.Embedding and module._parameters.get("weight") is not None:
            embeddings.setdefault(id(module._parameters["weight"]), []).append((name, module))
    tied = {}
    for path in paths:
        weight = root.get_submodule(path)._parameters.get("weight")
        if weight is not None and id(weight) in embeddings:
            tied[path] = embeddings[id(weight)]
    return tied


def _checked_ties(entry: dict, key: str) -> list[dict]:
    """A record entry's tied embeddings (``[{"path", "padding_idx"}]``; none when absent), checked: it comes from a
    file."""
    ties = entry.get("tied", [])
    ok = isinstance(ties, list) and all(
        isinstance(tie, dict) and isinstance(tie.get("path"), str) and tie["path"] and set(tie) == {"path", "padding_idx"}
        and (tie["padding_idx"] is None or (isinstance(tie["padding_idx"], int) and not isinstance(tie["padding_idx"], bool)))
        for tie in ties)
    if not ok:
        raise LoadError(f"'{key}': malformed 'tied' entry for {entry['path']} in the record: {str(ties)[:200]}")
    return ties
