"""``quantize q8_0``, ``q4_0``, ``q4_1`` and ``q4_k`` (implementation): the quantize family's planning, apply
and reload (:mod:`.quantization`) with the GGUF block layers of :mod:`.gguf_blocks`.

A layer whose ``in_features`` is not a multiple of the block (32; Q4_K's super-block, 256) is a near miss.  In a
transformers/diffusers layout these layers are refused (no stock loader reads GGUF blocks from
safetensors): ``save(..., format="gguf")`` writes them as they are.
"""

from __future__ import annotations

from ...tree import ModuleInfo, ModuleTree
from . import Q4_0Quantization as Q4_0Declaration
from . import Q4_1Quantization as Q4_1Declaration
from . import Q4_KQuantization as Q4_KDeclaration
from . import Q8_0Quantization as Q8_0Declaration
from .quantization import QuantizeBehaviour, linear_dims, target_dtypes, targets_device_type


class GGUFBlockBehaviour(QuantizeBehaviour):
    float_weight = True  # BlockQuantizedLinear.weight: the dequantized weight

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        reason = super().candidate(info, tree)
        dims = linear_dims(info)
        if reason is not None or dims is None:
            return reason
        if dims[0] % self.block_size:
            return f"in_features {dims[0]} is not a multiple of GGUF's block of {self.block_size}"
        return None

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
        built.activations = getattr(options, "activations", "float")
        return built

    @classmethod
    def estimate_bytes(cls, options, in_features, out_features, bias, dtype):
        from .gguf_blocks import BLOCK, BLOCK_BYTES, Q4_K_BYTES, SUPER

        per_row = in_features // SUPER * Q4_K_BYTES if cls.mode == "q4_k" else in_features // BLOCK * BLOCK_BYTES[cls.mode]
        return per_row * out_features + (out_features * dtype.itemsize if bias else 0)


class Q8_0Quantization(GGUFBlockBehaviour, Q8_0Declaration):
    pass


class Q4_0Quantization(GGUFBlockBehaviour, Q4_0Declaration):
    pass


class Q4_1Quantization(GGUFBlockBehaviour, Q4_1Declaration):
    pass


class Q4_KQuantization(GGUFBlockBehaviour, Q4_KDeclaration):
    pass
