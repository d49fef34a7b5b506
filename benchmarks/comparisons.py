"""What is compared: one entry per transform or combination, ours against the by-hand ways.

Each :class:`Comparison` is a transformdsl script and the baselines that do the same job with
the underlying libraries (:mod:`baselines`).  To add one, append to :data:`COMPARISONS`.
A transform that has not landed yet raises "cannot be executed yet" and its rows read
"not available yet"; nothing else needs to change when it lands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import baselines as hand
import torch

DIFFUSERS = ("flux", "sd3", "unet")
ALL = ("flux", "sd3", "unet", "llama")


@dataclass(frozen=True)
class Baseline:
    """One by-hand way: a label for the page, the function, and the package it needs."""

    label: str
    fn: Callable
    families: tuple[str, ...] = ALL
    needs: str | None = None  # an importable module (e.g. "torchao"); skipped when missing
    sizes: tuple[str, ...] | None = None  # where it runs, when not everywhere its comparison does


@dataclass(frozen=True)
class Comparison:
    """A transformdsl script against its by-hand baselines.

    ``dtype``: the dtype of the checkpoint both sides read (fp8 jobs start, as users do, from a
    bfloat16 checkpoint read in its own dtype, memory-mapped); ``sizes``: where it runs (compile
    is too slow for the large models on 2 cores); ``reload``: whether to measure save/load of our
    result.
    """

    name: str
    script: str | Callable[[str], str]
    baselines: tuple[Baseline, ...] = ()
    families: tuple[str, ...] = ALL
    sizes: tuple[str, ...] = ("tiny", "medium", "large")
    dtype: torch.dtype = torch.float32
    reload: bool = True
    #: Why there is no by-hand baseline (shown instead of ratios), when there is none.
    no_baseline: str = ""
    #: Left out of the default run (too slow for its few minutes); ``--only NAME`` runs it.
    optional: bool = False
    #: Whether by-hand jobs also time ours in the same process (not for compile: a second compile).
    duel: bool = True
    #: Keyword arguments of ``transformdsl.transform`` beyond the script, as (name, value) pairs.
    transform_kwargs: tuple[tuple[str, object], ...] = ()
    #: Apply time from this many fresh processes per side, the sides in turn (the first is the full
    #: job; the others only read and transform): a transform of a few milliseconds moves by ±20% from
    #: one process to the next, so one job per side makes a 1.5x target a coin toss.  The ratio is
    #: the median of the rounds' ratios.
    apply_rounds: int = 1

    def script_for(self, workload) -> str:
        return self.script(workload) if callable(self.script) else self.script


FUSE = Baseline("diffusers fuse_qkv_projections()", hand.diffusers_fuse_qkv, DIFFUSERS)
BNB_INT8 = Baseline("bitsandbytes Linear8bitLt by hand", hand.bnb_int8)
LAYERWISE = Baseline("diffusers enable_layerwise_casting(fp8)", hand.diffusers_layerwise_fp8)
COMPILE = Baseline("torch.compile(model)", hand.torch_compile)
#: The untransformed model, called in turn with ours (ours ÷ original from one process): the anchor
#: of issue 15's latency targets and of the figures the plan's device notes quote.
UNCHANGED = Baseline(hand.UNCHANGED_LABEL, hand.unchanged, sizes=("tiny", "medium"))


#: Rounds of the fp8 storage apply-time target's jobs (see ``Comparison.apply_rounds``).
FP8_ROUNDS = 3

ELEMENTWISE = "no library does this fusion alone (torch.compile does it as part of compiling)"


def _regional_scope(workload) -> str:
    """The repeated blocks diffusers' ``_repeated_blocks`` names, as a transformdsl scope."""
    return {"flux": "compile regional in transformer_blocks.*, single_transformer_blocks.*",
            "sd3": "compile regional in transformer_blocks.*",
            "llama": "compile regional in model.layers.*"}.get(workload.family, "compile regional in *")


def _hqq(workload) -> str:
    """4-bit hqq in the groups the by-hand side picks (:func:`baselines.hqq_group_size`): 64,
    or less on the tiny models, whose layers can be 16 or 32 wide."""
    if workload.config is None:
        import workloads

        group = hand.hqq_group_size(workloads.build(workload))  # the built-in: milliseconds
    else:
        group = 64
    return f"quantize hqq bits=4 group_size={group}"


COMPARISONS: list[Comparison] = [
    Comparison("fuse qkv", "fuse qkv", (FUSE,), families=ALL,
               no_baseline="transformers has no q/k/v fusion of its own"),
    Comparison("quantize int8", "quantize int8", (
        BNB_INT8,
        Baseline("torchao Int8WeightOnlyConfig (W8A16)", hand.torchao_int8_weight_only, needs="torchao"),
        Baseline("torchao Int8DynamicActivationInt8WeightConfig (W8A8)", hand.torchao_int8_dynamic,
                 needs="torchao", sizes=("tiny", "medium")),
        UNCHANGED,
    )),
    # The same scheme as torchao's W8A16; fp32 is the other anchor (the "latency ÷ original" column).
    Comparison("quantize int8 weight_only", "quantize int8 weight_only=true", (
        Baseline("torchao Int8WeightOnlyConfig (W8A16)", hand.torchao_int8_weight_only, needs="torchao"),
        UNCHANGED,
    )),
    # UNCHANGED: the device note's figure (latency ÷ fp32) from calls in turn, like compute=bfloat16's.
    Comparison("quantize nf4", "quantize nf4", (Baseline("bitsandbytes Linear4bit nf4 by hand",
                                                         hand.bnb_4bit("nf4")), UNCHANGED)),
    # On CPUs with bf16 instructions the float32 matmul is the slow one (transforms/quantize/device_notes.py: four_bit_note).
    Comparison("quantize nf4 compute=bfloat16", "quantize nf4 compute=bfloat16",
               (Baseline("bitsandbytes Linear4bit nf4 compute bf16 by hand", hand.bnb_4bit("nf4", torch.bfloat16)),
                UNCHANGED), sizes=("tiny", "medium")),
    Comparison("quantize fp4", "quantize fp4", (Baseline("bitsandbytes Linear4bit fp4 by hand",
                                                         hand.bnb_4bit("fp4")),), sizes=("tiny",)),
    # hqq's optimizer costs about a second per million weights here: minutes per side at width 3072.
    Comparison("quantize hqq", _hqq,
               (Baseline("hqq HQQLinear by hand", hand.hqq_4bit), UNCHANGED), sizes=("tiny", "medium")),
    # bf16 matmuls are slow on CPUs without bf16 units: at width 3072 only the diffusers baseline.
    Comparison("fp8 storage", "fp8 storage", (
        LAYERWISE,
        Baseline("torchao Float8WeightOnlyConfig", hand.torchao_float8_weight_only, needs="torchao",
                 sizes=("tiny", "medium")),
    ), dtype=torch.bfloat16, apply_rounds=FP8_ROUNDS),
    # diffusers' plain cast, option for option: the apply-time target (<= 1.5x) at equal error.
    Comparison("fp8 storage scale=tensor", "fp8 storage scale=tensor", (LAYERWISE,), dtype=torch.bfloat16,
               sizes=("tiny", "medium"), apply_rounds=FP8_ROUNDS),
    Comparison("fp8 storage scale=none", "fp8 storage scale=none", (LAYERWISE,), dtype=torch.bfloat16,
               apply_rounds=FP8_ROUNDS),
    # The same with the undo log in memory: what atomicity's spill to disk (undo="auto") costs in time.
    Comparison("fp8 storage undo=memory", "fp8 storage", (LAYERWISE,), dtype=torch.bfloat16,
               sizes=("medium", "large"), transform_kwargs=(("undo", "memory"),), reload=False,
               apply_rounds=FP8_ROUNDS),
    Comparison("fp8 native", "fp8 native", (UNCHANGED,), dtype=torch.bfloat16,
               no_baseline="torchao's fp8 matmul (Float8DynamicActivationFloat8WeightConfig) needs CUDA "
                           "compute capability 8.9+: compared on GPU (benchmarks/gpu.py)"),
    Comparison("fuse qkv + quantize int8", "fuse qkv; quantize int8",
               (Baseline("fuse_qkv_projections() + Linear8bitLt by hand", hand.chain(hand.diffusers_fuse_qkv,
                                                                                      hand.bnb_int8), DIFFUSERS),),
               families=DIFFUSERS),
    Comparison("fuse qkv + fp8 storage", "fuse qkv; fp8 storage",
               (Baseline("fuse_qkv_projections() + enable_layerwise_casting", hand.chain(
                   hand.diffusers_fuse_qkv, hand.diffusers_layerwise_fp8), DIFFUSERS),),
               families=DIFFUSERS, dtype=torch.bfloat16, sizes=("tiny", "medium")),
    *(Comparison(f"fuse {chain}", f"fuse {chain}", (), sizes=("tiny",), no_baseline=ELEMENTWISE)
      for chain in ("bias_act_dropout", "bias_dropout_residual", "bias_dropout_residual_layernorm")),
    # Cold compilation costs a minute or more per process on a busy 2-core machine: the tiny Flux only.
    Comparison("compile", "compile", (COMPILE,), families=("flux",), sizes=("tiny",), reload=False, duel=False),
    Comparison("compile regional", _regional_scope, (
        Baseline("diffusers compile_repeated_blocks()", hand.diffusers_compile_repeated_blocks, ("flux", "sd3")),
    ), families=("flux",), sizes=("tiny",), reload=False, duel=False),
    Comparison("quantize int8 + compile", "quantize int8; compile fullgraph=false",
               (Baseline("Linear8bitLt by hand + torch.compile", hand.chain(hand.bnb_int8, hand.torch_compile)),),
               families=("flux",), sizes=("tiny",), reload=False, optional=True, duel=False),
]

BY_NAME = {c.name: c for c in COMPARISONS}
