"""``fp8 storage`` and ``fp8 native``: weights in float8, upcast per layer or multiplied natively (declarations).

``fp8 storage`` keeps each selected ``Linear``/``Conv``/``Embedding`` (and GPT-2's ``Conv1D``) weight as
a float8 buffer with float32 scales and upcasts it inside ``forward``; ``fp8 native`` multiplies
e4m3 weights and dynamically quantized inputs with ``torch._scaled_mm`` where the device can, and
falls back to the same upcast elsewhere.  The implementation: :mod:`.layers` (the modules and their
numerics) and :mod:`.apply` (the two transforms' planning, application and reload).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...extend import Transform, option
from ...switches import Switch

#: diffusers' layerwise-casting defaults (``diffusers.hooks.layerwise_casting.DEFAULT_SKIP_MODULES_PATTERN``:
#: ``("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")``, matched with ``re.search`` on the
#: module path).  The words match the same names here; the anchored regexes stay regexes.  Excluding a
#: module excludes its subtree, as in diffusers.
DEFAULT_EXCEPT = ("norm", "pos_embed", "patch_embed", "re:^proj_in$", "re:^proj_out$")
#: What the model declares, as diffusers' ``enable_layerwise_casting`` honours it: its own skip
#: patterns and the modules kept in float32 (transformers' too); see ``declarations.py``.
DECLARATIONS = ("_skip_layerwise_casting_patterns", "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
#: On: ``fp8 native`` layers on a CPU run ``torch._scaled_mm``'s CPU reference (slow, but the code path a
#: GPU takes, after the CUDA rules are checked); off (the default): they upcast like ``fp8 storage``.
CPU_SCALED_MM = Switch("fp8.cpu_scaled_mm", "fp8 native layers on a CPU run torch._scaled_mm's CPU reference",
                       default=False)
#: ``fp8 storage scale=``: one float32 scale per output channel, one per weight, or none.
SCALE_MODES = ("row", "tensor", "none")


@dataclass(frozen=True)
class StorageOptions:
    dtype: str = option("e4m3", "float8 format of the stored weights", choices=("e4m3", "e5m2"))
    compute: str = option("bfloat16", "dtype weights are upcast to for the forward", kind="dtype")
    scale: str = option("row", "one float32 scale per output channel (row), per weight (tensor), or none "
                        "(a plain cast, as diffusers' layerwise casting)", choices=SCALE_MODES)


@dataclass(frozen=True)
class NativeOptions:
    scaling: str = option("tensor", "weight/activation scale granularity", choices=("tensor", "row"))
    activation: str = option("dynamic", "how activations are scaled", choices=("dynamic",))
    compute: str = option("bfloat16", "output dtype of the fp8 matmul", kind="dtype")
    strict: bool = option(False, "error instead of upcasting where the device has no fp8 matmul")

    def __post_init__(self):
        # Row-wise scaling runs CUTLASS's f8f8bf16_rowwise on sm89: bfloat16 output only.
        if self.scaling == "row" and self.compute != "bfloat16":
            raise ValueError(f"scaling=row needs compute=bfloat16 (the row-wise fp8 kernels write bfloat16), "
                             f"got compute={self.compute}")


class FP8Storage(Transform):
    verb = "fp8"
    mode = "storage"
    summary = "store weights in float8, upcast per layer at forward"
    Options = StorageOptions
    default_target = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding", "Conv1D")
    default_except = DEFAULT_EXCEPT
    honoured_declarations = DECLARATIONS
    runs_after = ("fuse *",)
    exclusive = "weights"
    implementation = ".apply:FP8Storage"

    #: Bounds per format and metric (spec.md "Numerical guard").
    BOUNDS = {"e4m3": {"kl": 0.4, "top1": 0.3, "rms": 0.2, "max": 0.2},
              "e5m2": {"kl": 0.8, "top1": 0.4, "rms": 0.4, "max": 0.4}}

    @property
    def error_bound(self) -> dict:  # depends on the options (see Transform.error_bound)
        return self.BOUNDS[self.options.dtype]


class FP8Native(Transform):
    verb = "fp8"
    mode = "native"
    summary = "keep fp8 weights and multiply natively with torch._scaled_mm"
    Options = NativeOptions
    default_target = ("Linear",)
    default_except = DEFAULT_EXCEPT
    honoured_declarations = DECLARATIONS
    runs_after = ("fuse *",)
    # The planner lets a statement give modules up only to one that claimed them *earlier*:
    # running first is what makes ``overrides`` take ``fp8 storage``'s shared layers.
    runs_before = ("fp8 storage",)
    exclusive = "weights"
    overrides = ("fp8 storage",)
    switches = (CPU_SCALED_MM,)
    #: Bounds per metric (spec.md "Numerical guard"); weight and input both in e4m3.
    error_bound = {"kl": 0.4, "top1": 0.3, "rms": 0.2, "max": 0.15}
    implementation = ".apply:FP8Native"


@dataclass(frozen=True)
class DynamicOptions:
    scaling: str = option("tensor", "weight/activation scale granularity: one per tensor, or one per row "
                          "(weights per output channel, activations per token)", choices=("tensor", "row"))
    compute: str = option("bfloat16", "output dtype of the fp8 matmul", kind="dtype")

    def __post_init__(self):
        if self.scaling == "row" and self.compute != "bfloat16":
            raise ValueError(f"scaling=row needs compute=bfloat16 (the row-wise fp8 kernels write bfloat16), "
                             f"got compute={self.compute}")


class FP8Dynamic(FP8Native):
    """``fp8 dynamic``: weights and activations in float8 e4m3 with per-tensor or per-row scales,
    ``torch._scaled_mm`` (torchao's ``Float8DynamicActivationFloat8WeightConfig``).  Unlike ``fp8
    native`` it never falls back: a device without fp8 matmul is refused when the script is planned
    (a CPU runs it only with :data:`CPU_SCALED_MM` on: torch's slow reference kernel), and a layer
    whose shape the CUDA kernel rejects is left as it is, with the reason."""

    mode = "dynamic"
    summary = "float8 weights and per-tensor/per-row dynamic float8 activations, torch._scaled_mm (no fallback)"
    Options = DynamicOptions
    implementation = ".dynamic:FP8Dynamic"
