"""``cache MODE``: diffusers' step caches as statements (declarations; torch-free).

A step cache reuses a denoiser's block (or attention) outputs from one denoising step to the next.
diffusers implements them as hooks, enabled with ``model.enable_cache(SomeCacheConfig(...))``; each
mode here is one of those configs, named by its short snake-case name, with the config's fields as
options.  Nothing is re-implemented: :mod:`.run` builds the config and calls ``enable_cache``.

What a text file cannot hold:

- ``current_timestep_callback`` (``pyramid_broadcast``, ``faster``): supplied by us; it returns the
  timestep of the current call (the ``timestep`` of ``cache_context(name, timestep=...)`` when the
  caller gives one, else the denoiser's own ``timestep`` argument, on the scheduler's 0-1000 scale).
- tensors (``mag_ratios``): a comma-separated list of numbers, or ``flux`` for diffusers' Flux ratios.
- ``attention_weight_callback`` (``faster``): a constant weight (``attention_weight=0.5``, diffusers'
  own default); the low/high-frequency weight callbacks keep diffusers' defaults.
- ``raw_vision_callback`` (``sea``): refused; ``sea`` runs only where diffusers has a built-in adapter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ...extend import RuntimeTransform, option


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``"100,800"`` -> ``(100, 800)``; ValueError naming the option otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        low, high = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{name} must be two integers 'low,high' (e.g. \"100,800\"), got {text!r}") from None
    if low >= high:
        raise ValueError(f"{name}: the low end must be below the high end, got {text!r}")
    return low, high


#: The most regular expressions an identifier list takes: each is matched against every module while
#: planning, and a quoted list's commas do not count toward the script's selector cap.
MAX_PATTERNS = 64
#: The most steps a step-counting option may name, and the most magnitude ratios: no sampler runs more
#: (DDPM's 1,000 is the longest in diffusers), and mag's ratios are interpolated to
#: ``num_inference_steps`` points, so 1e9 allocated 4 GB at plan or load time before this bound.
MAX_STEPS = 10_000


def parse_patterns(text: str, name: str) -> tuple[str, ...]:
    """``"a.*,b"`` -> ``("a.*", "b")`` (regular expressions, each checked); ``""`` -> ``()``."""
    patterns = tuple(p.strip() for p in str(text).split(",") if p.strip())
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"{name}: {len(patterns)} regular expressions; the limit is {MAX_PATTERNS} (each is matched "
                         "against every module; one alternation 'a|b|c' names several)")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{name}: {pattern!r} is not a regular expression ({exc})") from None
    return patterns


def parse_numbers(text: str, name: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in str(text).split(",") if p.strip())
    except ValueError:
        raise ValueError(f"{name} must be 'flux' or numbers separated by commas, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} is empty")
    if len(values) > MAX_STEPS:
        raise ValueError(f"{name}: {len(values)} numbers; the limit is {MAX_STEPS} (one per denoising step)")
    bad = [v for v in values if not math.isfinite(v) or v <= 0]
    if bad:  # magnitude ratios: the norm of one step's residual over the last one's
        raise ValueError(f"{name} must be positive finite numbers, got {bad[0]!r}")
    return values


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class FirstBlockOptions:
    threshold: float = option(0.05, "skip the remaining blocks while the first block's residual changes by less "
                              "than this (relative mean absolute difference)", min=0.0)


@dataclass(frozen=True)
class TaylorSeerOptions:
    cache_interval: int = option(5, "steps between full computations (the others are predicted)", min=1, max=MAX_STEPS)
    disable_cache_before_step: int = option(3, "compute fully before this step (gathers the Taylor factors)", min=0, max=MAX_STEPS)
    disable_cache_after_step: int | None = option(None, "compute fully from this step on (none: never)",
                                                  min=0, max=MAX_STEPS, kind="int_or_none")
    max_order: int = option(1, "order of the Taylor expansion", min=0, max=4)
    taylor_factors_dtype: str = option("bfloat16", "dtype the Taylor factors are stored in", kind="dtype")
    skip_predict_identifiers: str = option("", "module names (regular expressions, comma-separated, full match) "
                                           "that return zeros on predicted steps")
    cache_identifiers: str = option("", "module names (regular expressions, comma-separated, full match) whose "
                                    "outputs are predicted; empty: diffusers' default (the blocks' attention)")
    use_lite_mode: bool = option(False, "diffusers' lite variant: skip the blocks, predict proj_out "
                                 "(overrides the identifiers)")

    def __post_init__(self):
        parse_patterns(self.skip_predict_identifiers, "skip_predict_identifiers")
        parse_patterns(self.cache_identifiers, "cache_identifiers")
        if self.disable_cache_after_step is not None and self.disable_cache_after_step <= self.disable_cache_before_step:
            raise ValueError("disable_cache_after_step must be after disable_cache_before_step "
                             f"({self.disable_cache_after_step} <= {self.disable_cache_before_step}); raise it or "
                             "write disable_cache_after_step=none")


@dataclass(frozen=True)
class PyramidBroadcastOptions:
    spatial_attention_block_skip_range: int | None = option(
        None, "recompute spatial self-attention every N steps (none for all three: diffusers uses 2)",
        min=1, max=MAX_STEPS, kind="int_or_none")
    temporal_attention_block_skip_range: int | None = option(None, "same for temporal attention", min=1, max=MAX_STEPS,
                                                             kind="int_or_none")
    cross_attention_block_skip_range: int | None = option(None, "same for cross-attention", min=1, max=MAX_STEPS,
                                                          kind="int_or_none")
    spatial_attention_timestep_skip_range: str = option("100,800", "timesteps 'low,high' between which spatial "
                                                        "attention may be reused")
    temporal_attention_timestep_skip_range: str = option("100,800", "same for temporal attention")
    cross_attention_timestep_skip_range: str = option("100,800", "same for cross-attention")
    spatial_attention_block_identifiers: str = option("", "regular expressions (comma-separated, re.search) naming "
                                                      "spatial attention; empty: diffusers' default")
    temporal_attention_block_identifiers: str = option("", "same for temporal attention")
    cross_attention_block_identifiers: str = option("", "same for cross-attention")

    def __post_init__(self):
        for kind in ("spatial", "temporal", "cross"):
            parse_range(getattr(self, f"{kind}_attention_timestep_skip_range"),
                        f"{kind}_attention_timestep_skip_range")
            parse_patterns(getattr(self, f"{kind}_attention_block_identifiers"),
                           f"{kind}_attention_block_identifiers")


@dataclass(frozen=True)
class FasterOptions:
    spatial_attention_block_skip_range: int = option(2, "recompute spatial attention every N steps", min=1, max=MAX_STEPS)
    temporal_attention_block_skip_range: int | None = option(None, "same for temporal attention (none: off)",
                                                             min=1, max=MAX_STEPS, kind="int_or_none")
    spatial_attention_timestep_skip_range: str = option("-1,681", "timesteps 'low,high' where spatial attention "
                                                        "may be reused")
    temporal_attention_timestep_skip_range: str = option("-1,681", "same for temporal attention")
    low_frequency_weight_update_timestep_range: str = option("99,901", "timesteps 'low,high' where the "
                                                             "low-frequency weight applies")
    high_frequency_weight_update_timestep_range: str = option("-1,301", "same for the high-frequency weight")
    alpha_low_frequency: float = option(1.1, "low-frequency weight", min=0.0)
    alpha_high_frequency: float = option(1.1, "high-frequency weight", min=0.0)
    unconditional_batch_skip_range: int = option(5, "recompute the unconditional half of the batch every N steps",
                                                  min=1, max=MAX_STEPS)
    unconditional_batch_timestep_skip_range: str = option("-1,641", "timesteps 'low,high' where it may be reused")
    spatial_attention_block_identifiers: str = option("", "regular expressions (comma-separated) naming spatial "
                                                      "attention; empty: diffusers' default")
    temporal_attention_block_identifiers: str = option("", "same for temporal attention")
    attention_weight: float = option(0.5, "weight of the cached attention output (diffusers' default callback, "
                                     "as a constant)", min=0.0, max=1.0)
    tensor_format: str = option("BCFHW", "layout of the denoiser's hidden_states", choices=("BCFHW", "BFCHW", "BCHW"))
    is_guidance_distilled: bool = option(False, "the model takes no unconditional batch (guidance-distilled)")

    def __post_init__(self):
        for name in ("spatial_attention_timestep_skip_range", "temporal_attention_timestep_skip_range",
                     "low_frequency_weight_update_timestep_range", "high_frequency_weight_update_timestep_range",
                     "unconditional_batch_timestep_skip_range"):
            parse_range(getattr(self, name), name)
        parse_patterns(self.spatial_attention_block_identifiers, "spatial_attention_block_identifiers")
        parse_patterns(self.temporal_attention_block_identifiers, "temporal_attention_block_identifiers")


@dataclass(frozen=True)
class MagOptions:
    threshold: float = option(0.06, "skip while the accumulated magnitude error stays below this", min=0.0)
    max_skip_steps: int = option(3, "most consecutive steps skipped", min=1, max=MAX_STEPS)
    retention_ratio: float = option(0.2, "fraction of the first steps never skipped", min=0.0, max=1.0)
    num_inference_steps: int = option(28, "steps of the denoising loop (the ratios are interpolated to it)", min=1, max=MAX_STEPS)
    mag_ratios: str = option("", "the model's magnitude ratios: 'flux' (diffusers' Flux ratios) or numbers "
                             "separated by commas; required unless calibrate=true")
    calibrate: bool = option(False, "skip nothing; measure and log the ratios for this model")

    def __post_init__(self):
        if not self.mag_ratios and not self.calibrate:
            raise ValueError("mag needs the model's magnitude ratios: write mag_ratios=flux for Flux, or run once with "
                             "calibrate=true and pass the logged ratios as mag_ratios=\"1.0,0.98,...\"")
        if self.mag_ratios and self.mag_ratios != "flux":
            parse_numbers(self.mag_ratios, "mag_ratios")


@dataclass(frozen=True)
class SeaOptions:
    threshold: float = option(0.25, "accumulated relative-L1 budget; larger reuses the cache more often", min=0.0)
    residual_order: int = option(1, "0: reuse the last residual; 1: extrapolate from the last two", choices=(0, 1))
    retention_steps: int = option(1, "first steps always computed", min=0, max=MAX_STEPS)
    cache_end_steps: int = option(1, "last steps always computed", min=0, max=MAX_STEPS)
    max_consecutive_cached: int = option(2, "most consecutive reuses (0: no limit)", min=0, max=MAX_STEPS)
    power_exp: float = option(3.0, "exponent of the clean-signal power prior", min=0.0)

    def __post_init__(self):
        if self.power_exp <= 0:
            raise ValueError(f"power_exp must be positive, got {self.power_exp}")


@dataclass(frozen=True)
class TextKVOptions:
    """No options: diffusers' TextKVCacheConfig has no fields."""


# --------------------------------------------------------------------------- declarations


class Cache(RuntimeTransform):
    """What every cache mode shares: one per denoiser, on the denoiser itself, after structure changes."""

    verb = "cache"
    default_target = None  # the scope's top: the denoiser (or the model)
    exclusive = "cache"
    #: diffusers' hooks wrap the live blocks, which convert replaces as it streams them.
    streams = False
    #: Hooks wrap the blocks' (or attention modules') forward: structural transforms run first, so
    #: that the cache wraps the modules they leave; compilation runs after everything.
    runs_after = ("fuse *", "quantize *", "fp8 *", "attention *")
    #: One call in a fresh cache context computes every block: the output is exact (``verify``
    #: runs each sample in a fresh context); the error comes from later steps (spec.md "cache").
    error_bound = 0.0
    #: diffusers' config class (in ``diffusers.hooks``).
    config_class: str = ""
    #: Whether the hooks keep per-context state (then a call outside ``cache_context`` fails).
    needs_context: bool = True
    #: Whether the hooks read the current timestep (through the callback we supply).
    reads_timestep: bool = False

    def incompatible(self, other):
        if other.verb == "cache" and other is not self and other.common.component == self.common.component:
            return ("a denoiser has one step cache at a time (diffusers' enable_cache); keep one cache statement "
                    "(or point them at different components with component=)")
        if other.verb == "compile" and other.options is not None and getattr(other.options, "fullgraph", False) \
                and other.common.component == self.common.component and self.breaks_fullgraph:
            from ..common.fullgraph import refusal

            if other.mode == "regional":
                return refusal(f"'cache {self.mode}'", "'compile regional fullgraph=true'", "fullgraph=false")
            return refusal(f"'cache {self.mode}'", "'compile fullgraph=true'",
                           "'compile fullgraph=false', or 'compile regional in <blocks>' (fullgraph=false)")
        return None

    #: Whether compiling the whole denoiser with fullgraph=true fails with this cache (measured).
    breaks_fullgraph: bool = True


class FirstBlockCache(Cache):
    mode = "first_block"
    summary = "first-block cache: skip the other blocks while the first block's residual barely changes"
    Options = FirstBlockOptions
    config_class = "FirstBlockCacheConfig"
    implementation = ".run:FirstBlockCache"


class TaylorSeerCache(Cache):
    mode = "taylorseer"
    summary = "TaylorSeer: predict the attention outputs of skipped steps from a Taylor expansion"
    Options = TaylorSeerOptions
    config_class = "TaylorSeerCacheConfig"
    implementation = ".run:TaylorSeerCache"


class PyramidBroadcastCache(Cache):
    mode = "pyramid_broadcast"
    summary = "pyramid attention broadcast: reuse attention outputs for N steps within a timestep range"
    Options = PyramidBroadcastOptions
    config_class = "PyramidAttentionBroadcastConfig"
    needs_context = False
    reads_timestep = True
    implementation = ".run:PyramidBroadcastCache"


class FasterCache(Cache):
    mode = "faster"
    summary = "FasterCache: reuse attention outputs and the unconditional batch across steps"
    Options = FasterOptions
    config_class = "FasterCacheConfig"
    needs_context = False
    reads_timestep = True
    implementation = ".run:FasterCache"


class MagCache(Cache):
    mode = "mag"
    summary = "MagCache: skip the blocks while the accumulated magnitude-ratio error stays small"
    Options = MagOptions
    config_class = "MagCacheConfig"
    implementation = ".run:MagCache"


class SeaCache(Cache):
    mode = "sea"
    summary = "SeaCache: reuse the block stack's residual while spectral indicators barely change"
    Options = SeaOptions
    config_class = "SeaCacheConfig"
    implementation = ".run:SeaCache"


class TextKVCache(Cache):
    mode = "text_kv"
    summary = "text K/V cache: compute the text keys and values once per prompt (exact)"
    Options = TextKVOptions
    config_class = "TextKVCacheConfig"
    breaks_fullgraph = False  # measured: NucleusMoEImage compiles with fullgraph=true, whole and regional
    implementation = ".run:TextKVCache"
