"""``quantize w8a8`` and ``quantize int4``: quantized compute in plain torch (implementation).

Both reuse the quantize family's planning, apply and reload (:mod:`.quantization`); what differs is
the layer (:mod:`.w8a8`, :mod:`.int4`), which layers they refuse, and the device note:

- ``w8a8`` refuses layers whose ``in_features`` or ``out_features`` is not a multiple of 8
  (``torch._int_mm``'s rule on CUDA: a save must load on any device) and layers whose inner
  dimension is below 16 (nothing to gain, and ``torch._int_mm`` misreads an inner dimension of 1
  on some CPUs);
- ``int4`` refuses layers whose ``in_features`` is not a multiple of ``group_size`` (a group would
  straddle rows) or whose ``out_features`` is not a multiple of 16 (the packed kernels' rule).
"""

from __future__ import annotations

from ...errors import LoadError
from ...options import DTYPES
from ...tree import ModuleInfo, ModuleTree
from . import INT4_GROUP_SIZES
from . import Int4Quantization as Int4Declaration
from . import W8A8Quantization as W8A8Declaration
from .quantization import QuantizeBehaviour, linear_dims, target_dtypes, targets_device_type

#: Smallest ``in_features`` ``w8a8`` quantizes.
W8A8_MIN_IN = 16


def refuse_export(step, out) -> None:
    """``w8a8`` and ``int4`` in a library's layout: refused, naming the library's torchao format
    (compressed-tensors' layout: :mod:`.ct_export`)."""
    if out.fmt == "compressed-tensors":
        from .ct_export import export_compressed

        return export_compressed(step, out)
    if out.library == "diffusers":
        why = ("diffusers' equivalent is its TorchAoConfig, whose checkpoints are pickled torchao tensor "
               "subclasses (safe_serialization=False), which a safe load never unpickles")
    else:
        why = ("transformers' equivalent is its torchao quantization_config, whose checkpoints hold torchao "
               "tensor subclasses (Int8Tensor/Int4Tensor, flattened with torchao-specific metadata and a "
               "device-packed layout) that load only with torchao installed")
    raise out.refuse(step, why, "save with format='transformdsl' (plain int8/uint8 tensors, any device)")


class W8A8Quantization(QuantizeBehaviour, W8A8Declaration):
    float_weight = True  # Int8DynamicLinear.weight: the dequantized weight

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        reason = super().candidate(info, tree)
        dims = linear_dims(info)
        if reason is not None or dims is None:
            return reason
        in_f, out_f = dims
        if in_f < W8A8_MIN_IN:
            return f"in_features {in_f} < {W8A8_MIN_IN}: too small for an int8 matmul to gain anything"
        if in_f % 8 or out_f % 8:
            return (f"its {in_f}x{out_f} weight: int8 matmul kernels (torch._int_mm on CUDA) take in_features and "
                    "out_features that are multiples of 8")
        return None

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        from .device_notes import w8a8_note

        device = targets_device_type(tree, targets)
        return w8a8_note(device, target_dtypes(tree, targets)) if device else None

    @classmethod
    def export(cls, step, out) -> None:
        refuse_export(step, out)

    @classmethod
    def backend(cls, options):
        from . import w8a8

        return w8a8

    @classmethod
    def build(cls, backend, options, weight, bias, layer=None):
        return backend.Int8DynamicLinear.build(weight, bias)

    @classmethod
    def calibration_grid(cls, options, weight):
        from .int8_weight_only import RowGrid

        return RowGrid(weight)

    @classmethod
    def build_on_grid(cls, backend, options, grid, weight, bias, weight_dtype):
        return backend.Int8DynamicLinear(grid.codes(weight), grid.scale, bias, weight_dtype)

    @classmethod
    def estimate_bytes(cls, options, in_features, out_features, bias, dtype):
        return in_features * out_features + 4 * out_features + (out_features * dtype.itemsize if bias else 0)


class Int4Quantization(QuantizeBehaviour, Int4Declaration):
    float_weight = True  # Int4WeightOnlyLinear.weight: the dequantized weight

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        reason = super().candidate(info, tree)
        dims = linear_dims(info)
        if reason is not None or dims is None:
            return reason
        in_f, out_f = dims
        if in_f % self.options.group_size:
            fits = [g for g in INT4_GROUP_SIZES if in_f % g == 0]
            fix = f"; group_size={max(fits)} does" if fits else ""
            return f"group_size={self.options.group_size} does not divide its in_features ({in_f}{fix})"
        if out_f % 16:
            return f"out_features {out_f}: the packed int4 kernels take multiples of 16"
        return None

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        from .device_notes import weight_only_note

        device = targets_device_type(tree, targets)
        if device is None:
            return None
        if device == "cpu":
            from . import kernels

            group_ok = self.options.group_size % 32 == 0
            if group_ok and kernels.available() and self.options.activations == "int8":
                larger = ("aten's packed int4 kernel (bfloat16)" if self.options.compute == "bfloat16" else
                          f"the weight dequantized at every call ({self.options.compute})")
                return ("activations rounded per 32 inputs to int8 with a float16 scale, as llama.cpp rounds them; "
                        "inputs of up to 8 rows then take transformdsl's integer kernel (kernels/rows.c, "
                        f"{kernels.status()}: the nibbles, scales and zeros as stored, integer dot products per 32 "
                        f"inputs), larger inputs multiply the rounded activations with {larger}")
            if self.options.compute != "bfloat16":
                decode = (" except decode-sized inputs (up to 8 rows), which take transformdsl's row kernel "
                          f"(kernels/rows.c, {kernels.status()}: the nibbles, scales and zeros as stored, float32 "
                          "activations)" if group_ok and kernels.available() else "")
                return (f"compute={self.options.compute}: scales and zeros in {self.options.compute} (the model's "
                        "precision); the packed int4 CPU kernel is fast in bfloat16 only, so these layers dequantize "
                        f"their weight at every call (about the float layer's cost){decode}; compute=bfloat16 (the "
                        "default) uses it")
            if group_ok and kernels.available():
                return ("inputs of 1-2 rows take transformdsl's row kernel (kernels/rows.c, "
                        f"{kernels.status()}: the nibbles, scales and zeros as stored, float32 activations; 0.86-1.07× "
                        "the packed kernel's time at one row, benchmarks/results/decode_kernels.md), larger "
                        "inputs aten's packed int4 kernel (bfloat16 activations)")
        if device == "cuda":
            return ("on CUDA these layers dequantize their weight at every call (the tinygemm int4 kernel, "
                    "aten._weight_int4pack_mm, is not wired here yet)")
        return weight_only_note(device, target_dtypes(tree, targets), 4)

    @classmethod
    def export(cls, step, out) -> None:
        refuse_export(step, out)

    @classmethod
    def backend(cls, options):
        from . import int4

        return int4

    @classmethod
    def build(cls, backend, options, weight, bias, layer=None):
        if weight.is_meta and weight.shape[1] % options.group_size:  # loading: a record from a file
            raise LoadError(f"'{cls.key()}': the record's layer '{(layer or {}).get('path')}' has in_features "
                            f"{weight.shape[1]}, which group_size={options.group_size} does not divide (int4 groups "
                            "never straddle rows: a tampered record?)")
        return backend.Int4WeightOnlyLinear.build(weight, bias, options.group_size, DTYPES[options.compute],
                                                  options.symmetric, options.activations)

    @classmethod
    def calibration_grid(cls, options, weight, low=None, high=None):
        from .int4 import GroupGrid

        return GroupGrid(weight, options.group_size, low, high, DTYPES[options.compute], options.symmetric)

    @classmethod
    def build_on_grid(cls, backend, options, grid, weight, bias, weight_dtype):
        return backend.Int4WeightOnlyLinear(backend.pack_nibbles(grid.codes(weight)), grid.scale, grid.zero, bias,
                                            options.group_size, DTYPES[options.compute], weight_dtype,
                                            options.activations)

    @classmethod
    def finalize(cls, root, record, options) -> None:
        """The loaded scales and zeros are in the layer's compute dtype, as saved (a save's float
        precision may differ elsewhere; the packed kernel takes its activations' dtype)."""
        compute = DTYPES[options.compute]
        for layer in record["layers"]:
            module = root.get_submodule(layer["path"])
            for name in ("weight_scale", "weight_zero"):
                tensor = module._buffers.get(name)
                if tensor is not None and tensor.dtype != compute:
                    raise LoadError(f"'{cls.key()}': '{layer['path']}.{name}' is "
                                    f"{str(tensor.dtype).removeprefix('torch.')} in the file; int4 layers store "
                                    f"their scales and zeros in their compute dtype, {options.compute} here "
                                    "(a tampered save?)")

    @classmethod
    def estimate_bytes(cls, options, in_features, out_features, bias, dtype):
        groups = in_features // options.group_size
        return (in_features * out_features // 2 + 2 * DTYPES[options.compute].itemsize * groups * out_features
                + (out_features * dtype.itemsize if bias else 0))
