"""``quantize int8|nf4|fp4|hqq|w8a8|int4``: weight quantization (declarations).

The implementation (:mod:`.quantization`, :mod:`.compute`) replaces each selected linear layer by a
quantized one built from its weight; the layers are in :mod:`.layers` (bitsandbytes and hqq,
imported only when a script quantizes), :mod:`.int8_weight_only`, :mod:`.w8a8` and :mod:`.int4`
(plain torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...extend import Transform, option

#: Linear layers (GPT-2's transposed ``Conv1D`` included).
LINEAR_TARGETS = ("Linear", "Conv1D")
#: The layers quantization hurts most for the least memory, as diffusers/transformers users
#: and GGUF/quanto recipes skip them: norms (with the modulation linears inside AdaLayerNorm*),
#: embeddings and embedders (timestep/text embedders, a DiT's ``x_embedder`` and
#: ``context_embedder`` input projections) and output heads (``lm_head``; the final
#: ``proj_out`` of DiT-style denoisers, not the ``proj_out`` inside blocks).  spec.md has the
#: measurements.
DEFAULT_EXCEPT = ("norm", "embed", "embedding", "embedder", "lm_head", "re:^proj_out$")
#: Class names of layers that already hold quantized weights (ours derive from these).
#: The class every GGUF block layer derives from (gguf_blocks.py), by name: what planning recognises them by.
BLOCK_LAYER_CLASS = "BlockQuantizedLinear"
QUANTIZED_CLASS_NAMES = frozenset({"Linear8bitLt", "Linear4bit", "HQQLinear", "Int8WeightOnlyLinear",
                                   "Int4WeightOnlyLinear"})
#: int4 group sizes the packed kernels take (torchao's ``Int4WeightOnlyConfig`` allows the same).
INT4_GROUP_SIZES = (32, 64, 128, 256)


# --------------------------------------------------------------------------- options


#: How a calibrated mode may round its weights (``method=``): to nearest, or learnt from data.
METHODS = ("rtn", "gptq", "awq")
#: GPTQ's options and their defaults: llm-compressor's (its ``actorder`` defaults to "static": columns
#: in decreasing ``diag H``, groups fixed from the weight first).
GPTQ_DEFAULTS = {"damp": 0.01, "block_size": 128, "act_order": True}


@dataclass(frozen=True)
class CalibratedOptions:
    """The options of a mode whose weights may be rounded by a method that learns from calibration
    data (``calibrate "PATH"`` in the script, or ``transform(..., calibration=DATA)``)."""

    method: str = option("rtn", "how weights are rounded: rtn (to nearest), gptq (error compensation on "
                         "calibration data)", choices=("rtn", "gptq"))
    damp: float = option(0.01, "GPTQ: dampening added to the Hessian's diagonal, a fraction of its mean",
                         min=0.0, max=1.0)
    block_size: int = option(128, "GPTQ: columns rounded before their error is spread over the rest at once",
                             min=1, max=8192)
    act_order: bool = option(True, "GPTQ: round columns by decreasing input energy (diag of the Hessian), "
                             "groups fixed beforehand (llm-compressor's actorder=static)")

    def __post_init__(self):
        if self.method != "gptq":
            given = [f"{name}={getattr(self, name)}" for name, default in GPTQ_DEFAULTS.items()
                     if getattr(self, name) != default]
            if given:
                raise ValueError(f"{', '.join(given)} tune GPTQ, and method={self.method}: add method=gptq, or drop "
                                 f"{'them' if len(given) > 1 else 'it'}")

    @property
    def calibrated(self) -> bool:
        """Whether the mode learns from calibration data with these options."""
        return self.method != "rtn"


@dataclass(frozen=True)
class Int8Options(CalibratedOptions):
    threshold: float = option(0.0, "LLM.int8 outlier threshold (0 = no outlier decomposition)", min=0.0)
    weight_only: bool = option(False, "int8 weights, float activations and matmul (W8A16) instead of LLM.int8")

    def __post_init__(self):
        super().__post_init__()
        if self.weight_only and self.threshold:
            raise ValueError(f"threshold={self.threshold:g} is LLM.int8's activation outlier threshold; "
                             "weight_only=true never quantizes activations: drop one of the two")
        if self.method != "rtn" and not self.weight_only:
            raise ValueError(f"method={self.method} rounds int8 weights of our own layers: add weight_only=true "
                             "(bitsandbytes' LLM.int8 layers quantize their weights themselves)")


@dataclass(frozen=True)
class W8A8Options(CalibratedOptions):
    smooth: float = option(0.0, "SmoothQuant's migration strength alpha: moves activation outliers into the "
                           "weights before quantizing (0: off; 0.5: the paper's default; needs calibration data)",
                           min=0.0, max=1.0)

    @property
    def calibrated(self) -> bool:
        return self.method != "rtn" or self.smooth > 0


@dataclass(frozen=True)
class GGUFOptions:
    activations: str = option("float", "float: inputs multiply the stored blocks as they are (their exact product); "
                              "int8: rounded per 32 inputs to int8 with a float16 scale and multiplied as integers, "
                              "as llama.cpp's CPU backend does (about 2x faster 4-bit decoding here; outputs move by "
                              "the activations' rounding)", choices=("float", "int8"))


@dataclass(frozen=True)
class FourBitOptions:
    compute: str = option("float32", "dtype the matmul runs in", kind="dtype")
    double_quant: bool = option(False, "quantize the quantization constants too")
    blocksize: int = option(64, "elements per quantization block",
                            choices=(32, 64, 128, 256, 512, 1024, 2048, 4096))


@dataclass(frozen=True)
class HQQOptions:
    bits: int = option(4, "bits per weight", choices=(1, 2, 3, 4, 8))
    group_size: int | str = option(64, "weights per quantization group (a multiple of 8 that divides in_features), "
                                   "or auto: the largest of 128, 64, 32, 16, 8 that suits each layer",
                                   min=8, kind="int_or_auto")
    axis: int = option(1, "axis the groups run along (1: along a row's inputs; 0: down a column)", choices=(0, 1))
    compute: str = option("float32", "dtype the matmul runs in", kind="dtype")

    def __post_init__(self):
        if self.group_size != "auto" and self.group_size % 8:
            below = max(8, self.group_size // 8 * 8)
            raise ValueError(f"hqq group_size must be a multiple of 8, got {self.group_size}; "
                             f"try {below} or {below + 8}")


# --------------------------------------------------------------------------- the transforms


class Quantize(Transform):
    verb = "quantize"
    default_target = LINEAR_TARGETS
    default_except = DEFAULT_EXCEPT
    #: The modules transformers and diffusers keep in float32, as their own bitsandbytes
    #: integrations leave them unquantized (T5 casts ``wo``'s input to ``wo.weight.dtype``, packed
    #: uint8 for a 4-bit layer: relative error > 1 in nf4 otherwise).
    honoured_declarations = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
    runs_after = ("fuse *",)
    exclusive = "weights"
    summed_record_fields = ("bytes_before", "bytes_after")

    @property
    def needs_calibration(self) -> bool:  # depends on the options (see Transform.needs_calibration)
        return bool(getattr(self.options, "calibrated", False))

    @property
    def shares_samples(self) -> bool:  # GPTQ sums Hessians; AWQ and SmoothQuant decide on one sample's pass
        return getattr(self.options, "method", "") == "gptq" and not getattr(self.options, "smooth", 0.0)


class Int8Quantization(Quantize):
    quant_methods = ("bitsandbytes",)  # a stock bitsandbytes checkpoint reads as this statement
    mode = "int8"
    summary = "bitsandbytes LLM.int8 (Linear8bitLt)"
    Options = Int8Options
    implementation = ".quantization:Int8Quantization"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.options is not None and self.options.weight_only:
            self.summary = "weight-only int8 (W8A16): int8 weights, float activations and matmul"

    @property
    def error_bound(self) -> dict:  # depends on the options (see Transform.error_bound)
        # Per metric; measured on trained weights and the corpus: spec.md "Numerical guard".
        if self.options.weight_only:
            return {"kl": 0.2, "top1": 0.15, "rms": 0.05, "max": 0.03}
        return {"kl": 0.4, "top1": 0.2, "rms": 0.1, "max": 0.05}


class NF4Quantization(Quantize):
    quant_methods = ("bitsandbytes",)  # a stock bitsandbytes checkpoint reads as this statement
    mode = "nf4"
    summary = "bitsandbytes 4-bit NormalFloat (Linear4bit)"
    Options = FourBitOptions
    #: Per metric; measured on trained weights and the corpus: spec.md "Numerical guard".
    error_bound = {"kl": 1.2, "top1": 0.5, "rms": 0.4, "max": 0.4}
    implementation = ".quantization:NF4Quantization"


class FP4Quantization(Quantize):
    quant_methods = ("bitsandbytes",)  # a stock bitsandbytes checkpoint reads as this statement
    mode = "fp4"
    summary = "bitsandbytes 4-bit float (Linear4bit)"
    Options = FourBitOptions
    #: Per metric; measured on trained weights and the corpus: spec.md "Numerical guard".
    error_bound = {"kl": 1.5, "top1": 0.55, "rms": 0.5, "max": 0.5}
    implementation = ".quantization:FP4Quantization"


class HQQQuantization(Quantize):
    mode = "hqq"
    summary = "half-quadratic quantization (hqq HQQLinear)"
    Options = HQQOptions
    #: Bounds per bit width and metric (spec.md "Numerical guard").  1 and 2 bits have none: the
    #: output of a tiny random model is noise.
    BOUNDS = {8: {"kl": 0.2, "top1": 0.15, "rms": 0.05, "max": 0.03},
              4: {"kl": 1.0, "top1": 0.45, "rms": 0.4, "max": 0.4},
              3: {"kl": 2.5, "top1": 0.75, "rms": 0.8, "max": 0.8}, 2: None, 1: None}
    implementation = ".quantization:HQQQuantization"

    @property
    def error_bound(self) -> dict | None:  # depends on the options (see Transform.error_bound)
        return self.BOUNDS[self.options.bits]


@dataclass(frozen=True)
class Int4Options(CalibratedOptions):
    method: str = option("rtn", "how weights are rounded: rtn (to nearest), gptq (error compensation on "
                         "calibration data), awq (activation-aware scales and clipping on calibration data)",
                         choices=METHODS)
    awq_grid: int = option(20, "AWQ: points of its scale search and of its clipping search", min=2, max=100)
    group_size: int = option(128, "weights per (scale, zero) group along a row's inputs", choices=INT4_GROUP_SIZES)
    weight_only: bool = option(True, "int4 weights, bfloat16 activations (W4A16); false is not supported "
                               "(activations=int8 rounds the inputs instead)")
    symmetric: bool = option(False, "symmetric groups: zero point 0, scale = largest magnitude / 7.5 "
                             "(llm-compressor's W4A16, which format='compressed-tensors' writes); false: "
                             "asymmetric groups with a float zero (torchao's scheme, less error)")
    compute: str = option("bfloat16", "dtype the matmul runs in, and of the groups' scales and zeros (bfloat16: "
                          "the packed CPU kernel; float32: exact scales, the model's precision, a dequantized "
                          "matmul)", kind="dtype")
    activations: str = option("float", "float: inputs multiply the stored groups as they come; int8: rounded per 32 "
                              "inputs to int8 with a float16 scale and multiplied as integers where decoding, as "
                              "llama.cpp rounds activations (4-bit decoding 1.45x faster through 4096-wide layers on CPUs with VNNI; "
                              "outputs move by the activations' rounding)", choices=("float", "int8"))

    def __post_init__(self):
        super().__post_init__()
        if self.awq_grid != 20 and self.method != "awq":
            raise ValueError(f"awq_grid={self.awq_grid} tunes AWQ, and method={self.method}: add method=awq, or drop it")
        if not self.weight_only:
            raise ValueError("int4 quantizes weights only (W4A16): int4 activations have no kernel here; "
                             "use weight_only=true, or activations=int8 (inputs rounded per 32 to int8), or "
                             "'quantize w8a8' for per-token int8 activations")


class W8A8Quantization(Quantize):
    mode = "w8a8"
    summary = "int8 weights and per-token dynamic int8 activations, int8 x int8 matmul (W8A8)"
    #: Per metric, as LLM.int8's (the same scheme without outliers): measured max 0.010-0.018 and rms
    #: ~0.01 on the built-in tiny models (random weights: the worst case for per-token rounding).
    error_bound = {"kl": 0.4, "top1": 0.2, "rms": 0.1, "max": 0.05}
    Options = W8A8Options
    implementation = ".compute:W8A8Quantization"


class Int4Quantization(Quantize):
    mode = "int4"
    summary = "int4 weights in asymmetric groups, bfloat16 activations (W4A16), packed CPU kernel"
    Options = Int4Options
    #: Per metric, as nf4's (4 bits with a scale and zero per group, finer than nf4's blocks): measured
    #: rms 0.10-0.12 on the tiny Llama, 0.004-0.006 on the tiny Flux (group sizes 32-64).
    error_bound = {"kl": 1.2, "top1": 0.5, "rms": 0.4, "max": 0.4}
    implementation = ".compute:Int4Quantization"


class GGUFBlockQuantization(Quantize):
    """``quantize q8_0|q4_0|q4_1|q5_0|q5_1|q4_k|q5_k|q6_k``: the grid of a GGUF (llama.cpp) block type, so that ``save(...,
    format="gguf")`` writes these layers as they are (spec.md "Interchange")."""

    #: The GGUF block: inputs per block (a layer's ``in_features`` must be a multiple).
    block_size = 32
    #: Float linear layers, and layers already holding GGUF blocks (a GGUF import's): a statement whose mode
    #: is a layer's own grid sets its options (``activations=``) and keeps its blocks (gguf_modes.py).
    default_target = LINEAR_TARGETS + (BLOCK_LAYER_CLASS,)


class Q8_0Quantization(GGUFBlockQuantization):
    mode = "q8_0"
    summary = "GGUF Q8_0: int8 weights in blocks of 32 with a float16 scale (llama.cpp's grid), float activations"
    #: As weight-only int8's (the same rounding, finer scales: one per 32 inputs, not per row).
    error_bound = {"kl": 0.2, "top1": 0.15, "rms": 0.05, "max": 0.03}
    Options = GGUFOptions
    implementation = ".gguf_modes:Q8_0Quantization"


class Q4_0Quantization(GGUFBlockQuantization):
    mode = "q4_0"
    summary = "GGUF Q4_0: 4-bit symmetric weights in blocks of 32 with a float16 scale (llama.cpp's grid)"
    #: As int4's (4 bits per weight, symmetric blocks of 32: finer than nf4's 64).
    error_bound = {"kl": 1.2, "top1": 0.5, "rms": 0.4, "max": 0.4}
    Options = GGUFOptions
    implementation = ".gguf_modes:Q4_0Quantization"


class Q4_1Quantization(GGUFBlockQuantization):
    mode = "q4_1"
    summary = "GGUF Q4_1: 4-bit weights in blocks of 32 with a float16 scale and minimum (llama.cpp's grid)"
    #: As q4_0's (4 bits per weight, asymmetric blocks of 32).
    error_bound = {"kl": 1.2, "top1": 0.5, "rms": 0.4, "max": 0.4}
    Options = GGUFOptions
    implementation = ".gguf_modes:Q4_1Quantization"


class Q5_0Quantization(GGUFBlockQuantization):
    mode = "q5_0"
    summary = "GGUF Q5_0: 5-bit symmetric weights in blocks of 32 with a float16 scale (llama.cpp's grid)"
    #: As q4_0's, a bound (one bit finer: the rounding error is half q4_0's).
    error_bound = {"kl": 1.2, "top1": 0.5, "rms": 0.4, "max": 0.4}
    Options = GGUFOptions
    implementation = ".gguf_modes:Q5_0Quantization"


class Q5_1Quantization(GGUFBlockQuantization):
    mode = "q5_1"
    summary = "GGUF Q5_1: 5-bit weights in blocks of 32 with a float16 scale and minimum (llama.cpp's grid)"
    #: As q5_0's, a bound (5 bits per weight, asymmetric blocks of 32).
    error_bound = {"kl": 1.2, "top1": 0.5, "rms": 0.4, "max": 0.4}
    implementation = ".gguf_modes:Q5_1Quantization"


class Q4_KQuantization(GGUFBlockQuantization):
    mode = "q4_k"
    summary = "GGUF Q4_K: 4-bit weights in sub-blocks of 32 with 6-bit scales and mins per super-block of 256 (llama.cpp's grid)"
    block_size = 256
    #: As q4_0's (4 bits per weight, asymmetric sub-blocks of 32 whose scale and min are searched).
    error_bound = {"kl": 1.2, "top1": 0.5, "rms": 0.4, "max": 0.4}
    implementation = ".gguf_modes:Q4_KQuantization"


class Q5_KQuantization(GGUFBlockQuantization):
    mode = "q5_k"
    summary = "GGUF Q5_K: 5-bit weights in sub-blocks of 32 with 6-bit scales and mins per super-block of 256 (llama.cpp's grid)"
    block_size = 256
    #: As q5_0's, a bound (5 bits per weight, asymmetric sub-blocks of 32 whose scale and min are searched).
    error_bound = {"kl": 1.2, "top1": 0.5, "rms": 0.4, "max": 0.4}
    implementation = ".gguf_modes:Q5_KQuantization"


class Q6_KQuantization(GGUFBlockQuantization):
    mode = "q6_k"
    summary = "GGUF Q6_K: 6-bit weights in groups of 16 with int8 scales per super-block of 256 (llama.cpp's grid)"
    block_size = 256
    #: As q8_0's, a bound (6 bits with a searched scale per 16 inputs, two bits coarser than q8_0).
    error_bound = {"kl": 0.4, "top1": 0.25, "rms": 0.1, "max": 0.1}
    implementation = ".gguf_modes:Q6_KQuantization"


#: The GGUF grids whose layers take ``activations=`` (their options are :class:`GGUFOptions`; ``q5_1``, ``q4_k``,
#: ``q5_k`` and ``q6_k`` have none).
ACTIVATION_GRIDS = frozenset(cls.mode for cls in GGUFBlockQuantization.__subclasses__() if cls.Options is GGUFOptions)
