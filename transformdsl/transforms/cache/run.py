"""``cache MODE``: diffusers' step caches as statements (implementation).

:meth:`apply` builds the mode's diffusers config from the options and calls the denoiser's own
``enable_cache(config)``: the hooks are diffusers', nothing of the cache is re-implemented.  Around
them we add one hook of our own on the denoiser (:class:`ContextGuard`, registered in diffusers'
hook registry, so ``cache_context`` reaches it):

- a call outside ``cache_context`` raises diffusers' own message at the denoiser's call
  (:class:`CacheContextError`), not from deep inside the first block hook;
- for ``pyramid_broadcast`` and ``faster`` it remembers the call's timestep, which the
  ``current_timestep_callback`` we give diffusers returns.

Planning computes the modules the hooks will wrap with the hooks' own rules (diffusers' block
identifiers, its ``TransformerBlockRegistry``, its attention classes): a model a mode cannot wrap is
a plan error naming what the mode looks for.  Nothing is saved but the statement: ``load()``
enables the cache again (:meth:`finalize`).

Beside it: :mod:`.guard` (our hook at the denoiser's call) and :mod:`.blocks` (what the hooks wrap).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ... import regexes
from ...errors import LoadError
from ...extend import TransformError
from ...history import history_of
from ...tree import ModuleInfo, ModuleTree
from ..common.fullgraph import refusal
from . import FasterCache as FasterCacheDeclaration
from . import FirstBlockCache as FirstBlockCacheDeclaration
from . import MagCache as MagCacheDeclaration
from . import PyramidBroadcastCache as PyramidBroadcastCacheDeclaration
from . import SeaCache as SeaCacheDeclaration
from . import TaylorSeerCache as TaylorSeerCacheDeclaration
from . import TextKVCache as TextKVCacheDeclaration
from . import parse_numbers, parse_patterns, parse_range
from .blocks import Unsupported, attention_modules, registered_blocks, residual_chain
from .guard import GUARD_HOOK, fresh_context, make_guard, timestep_callback, timestep_scale

# --------------------------------------------------------------------------- shared behaviour


class CacheBehaviour:
    """What every cache mode does; each mode says what it wraps and how its config is built."""

    def _model(self, info: ModuleInfo) -> nn.Module | None:
        return info.module

    def check(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        model = info.module
        if model is None:
            return None
        if not hasattr(model, "enable_cache") or not hasattr(model, "cache_context"):
            where = f"'{info.path}'" if info.path else "the model"
            return (f"a step cache works on a diffusers denoiser (a model with enable_cache and cache_context); "
                    f"{where} is a {type(model).__name__}; select the denoiser (no 'in' clause, or component=)")
        compiled = [s.statement for s in (history_of(model).steps if history_of(model) else [])
                    if s.key.startswith("compile") and s.options.get("fullgraph")]
        if compiled and self.breaks_fullgraph:
            return refusal(f"'cache {self.mode}'", f"the model (it was compiled with '{compiled[-1]}')",
                           "fullgraph=false in that compile statement")
        if getattr(model, "is_cache_enabled", False):
            return (f"{type(model).__name__} already has a step cache ({type(model._cache_config).__name__}) "
                    "enabled outside this script: call model.disable_cache() first")
        try:
            self.wrapped(model)
            self.build_config(model, None)
        except Unsupported as exc:
            return str(exc)
        except ValueError as exc:  # the config's own checks
            return f"diffusers refuses the options: {exc}"
        return None

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        lines = []
        for path in targets:
            model = tree[path].module
            if model is None:
                continue
            try:
                wrapped = self.wrapped(model)
            except Unsupported:
                continue
            lines.append(self.describe_wrapped([name for name, _ in wrapped]))
            lines.append(f"per step: {self.skips}")
            lines.extend(self.call_notes())
            lines.append("call the denoiser inside `with model.cache_context(\"cond\"):` (pipelines do); "
                         + ("a call outside one is an error" if self.needs_context else
                            "reset with model._reset_stateful_cache() between denoising loops"))
        return lines

    # -- per mode

    skips: str = ""

    def call_notes(self) -> list[str]:
        """What each call must give, for the plan (what :meth:`call_check` enforces)."""
        return []

    def call_check(self) -> Callable[[Any, tuple, dict], str | None] | None:
        """A check of each denoiser call (``(guard, args, kwargs) -> problem or None``; the guard knows the
        call's timestep and the calls since the last reset), for what the mode's hooks assume of it and
        would otherwise fail on deep inside; None: nothing to check."""
        return None

    def describe_wrapped(self, names: list[str]) -> str:
        return f"wraps {_summary(names)} ({len(names)} module(s))"

    def wrapped(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        raise NotImplementedError

    def config_kwargs(self, model: nn.Module, guard) -> dict:
        return dataclasses.asdict(self.options)

    def build_config(self, model: nn.Module, guard):
        import diffusers.hooks

        config_cls = getattr(diffusers.hooks, self.config_class)
        return config_cls(**self.config_kwargs(model, guard))

    # -- execution

    # A step cache is hooks, set at run time: nothing is stored, and loading enables it again.
    not_stored = "{library} keeps no step cache in a checkpoint"
    after_from_pretrained = "call model.enable_cache(...) after from_pretrained; transformdsl.load enables it again"
    attached_field = "wrapped"

    @classmethod
    def attach(cls, module: nn.Module, path: str, options: Any, edit) -> list[str]:
        """``module.enable_cache(...)`` and our guard hook; the wrapped paths."""
        statement = describe(cls.key(), options)
        try:
            return enable(module, cls, options, statement)
        except (Unsupported, ValueError, TypeError) as exc:
            if edit is not None:
                raise TransformError(f"diffusers' enable_cache failed on {type(module).__name__}: {exc}") from exc
            if isinstance(exc, regexes.SelectorTooSlow):
                raise LoadError(f"saved statement '{statement}': {exc}") from None
            raise

    @classmethod
    def touches(cls, module: nn.Module) -> list[nn.Module]:
        """Every module below: the hooks set attributes (``forward``, ``_diffusers_hook``) on the blocks."""
        return list(module.modules())

    @classmethod
    def detach(cls, module: nn.Module) -> None:
        disable(module)

    @classmethod
    def fresh_run(cls, module: nn.Module):
        """One call as a fresh denoising loop (:func:`~.guard.fresh_context`)."""
        return fresh_context(module)


def describe(key: str, options: Any) -> str:
    """The statement as the user would write it (its options that differ from the defaults)."""
    parts = [key]
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value != f.default:
            text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            parts.append(f"{f.name}={text}" if re.fullmatch(r"[\w.\-]+", text) else f'{f.name}="{text}"')
    return " ".join(parts)


def disable(model: nn.Module) -> None:
    """Remove the cache and our guard (a rollback; then every touched __dict__ is restored too)."""
    if getattr(model, "is_cache_enabled", False):
        model.disable_cache()
    registry = getattr(model, "_diffusers_hook", None)
    if registry is not None and GUARD_HOOK in registry.hooks:
        registry.remove_hook(GUARD_HOOK, recurse=False)


def enable(model: nn.Module, cls: type, options: Any, statement: str) -> list[str]:
    """``model.enable_cache(config)`` for the mode ``cls`` and our guard hook; the wrapped paths.

    The identifiers (regular expressions) are matched against the module names once, within one
    regex budget (:func:`transformdsl.regexes.regex_budget`: :class:`~transformdsl.regexes.SelectorTooSlow`
    past it), and diffusers gets the names they matched as literals, never a user's pattern: its
    hooks match with Python's ``re``, which backtracks without bound (64 slow identifiers in a saved
    record made a load take 59 s)."""
    from diffusers.hooks import HookRegistry

    behaviour = cls.__new__(cls)
    behaviour.options = options
    with regexes.regex_budget():
        wrapped = behaviour.wrapped(model)
        guard = make_guard(statement, cls.needs_context, cls.reads_timestep, timestep_scale(model),
                            behaviour.call_check())
        config = behaviour.build_config(model, guard)
    model.enable_cache(config)
    registry = HookRegistry.check_if_exists_or_initialize(model)
    registry.register_hook(guard, GUARD_HOOK)
    registry.invalidate_child_registries_cache()
    names = [name for name, _ in wrapped]
    hooked = {name for name, m in model.named_modules() if getattr(m, "_diffusers_hook", None) is not None
              and any(h != GUARD_HOOK for h in m._diffusers_hook.hooks)}
    missing = [name for name in names if name not in hooked]
    if missing:  # our reading of the hooks' rules disagrees with diffusers: say so rather than mislead
        raise TransformError(f"'cache {cls.mode}': diffusers did not hook {', '.join(missing[:3])} as planned")
    return names


def literal_identifiers(model: nn.Module, patterns, whole: bool) -> list[str]:
    """One pattern naming exactly the modules of ``model`` that ``patterns`` match (``whole``: a full
    match, as diffusers' TaylorSeer; else a search, as its pyramid and FasterCache hooks), matched
    within the regex budget: what diffusers is given instead of the patterns themselves."""
    match = regexes.fullmatch if whole else regexes.search
    compiled = [regexes.compile_regex(p) for p in patterns]
    names = [name for name, _ in model.named_modules() if any(match(c, name) for c in compiled)]
    return ["^(?:" + "|".join(re.escape(n) for n in names) + ")$"] if names else [r"(?!)"]


def _summary(names: list[str]) -> str:
    groups: dict[str, list[str]] = {}
    for name in names:
        head, _, tail = name.rpartition(".")
        key = re.sub(r"\.\d+(\.|$)", r".*\1", name)
        groups.setdefault(key, []).append(name)
    parts = [f"{key} ({len(v)})" if len(v) > 1 else v[0] for key, v in groups.items()]
    return ", ".join(parts[:6]) + (f", ... ({len(parts) - 6} more)" if len(parts) > 6 else "")


# --------------------------------------------------------------------------- the modes


class FirstBlockCache(CacheBehaviour, FirstBlockCacheDeclaration):
    skips = ("the first block always runs; while its residual changed by less than threshold since the last "
             "full step, every other block is skipped and their cached residual added")

    def wrapped(self, model):
        blocks = registered_blocks(model, self.mode, least=2)
        residual_chain(model, blocks, self.mode, "hidden_states")  # the name its hooks read, whatever the block's
        return blocks

    def describe_wrapped(self, names):
        return (f"wraps {len(names)} blocks: {names[0]} runs every step and decides; "
                f"{_summary(names[1:])} may be skipped")


class MagCache(CacheBehaviour, MagCacheDeclaration):
    skips = ("the first block decides: while the accumulated magnitude-ratio error stays under threshold (at most "
             "max_skip_steps in a row, never in the first retention_ratio of the steps), the blocks are skipped "
             "and the cached residual added")

    def wrapped(self, model):
        blocks = registered_blocks(model, self.mode, least=1)
        residual_chain(model, blocks, self.mode, None)
        return blocks

    def describe_wrapped(self, names):
        return f"wraps {len(names)} blocks: {names[0]} decides; {_summary(names) if len(names) > 1 else names[0]} " \
               "may be skipped"

    def config_kwargs(self, model, guard):
        kwargs = dataclasses.asdict(self.options)
        ratios = kwargs.pop("mag_ratios")
        if ratios == "flux":
            from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

            kwargs["mag_ratios"] = FLUX_MAG_RATIOS.clone()
        elif ratios:
            kwargs["mag_ratios"] = torch.tensor(parse_numbers(ratios, "mag_ratios"))
        return kwargs


class SeaCache(CacheBehaviour, SeaCacheDeclaration):
    skips = ("while the accumulated change of the spectral indicator stays under threshold, the repeated block "
             "stack is replaced by a residual predicted from the last full steps; needs cache_context(name, "
             "step_index=, sigma=, num_inference_steps=) (otherwise diffusers runs every block: fail-open)")

    def wrapped(self, model):
        from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
        from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

        adapted = isinstance(model, Cosmos3OmniTransformer) or (
            isinstance(model, WanTransformer3DModel) and model.config.in_channels == model.config.out_channels)
        if not adapted:
            raise Unsupported(
                f"'cache sea' needs a raw_vision_callback (a Python function, which a script cannot hold) except on "
                f"the models diffusers has an adapter for: Cosmos3OmniTransformer, and WanTransformer3DModel with "
                f"in_channels == out_channels (text-to-video); {type(model).__name__} is not one")
        blocks = registered_blocks(model, self.mode, least=1)
        return blocks if not isinstance(model, Cosmos3OmniTransformer) else [("", model)]


class TextKVCache(CacheBehaviour, TextKVCacheDeclaration):
    skips = "nothing is skipped: each block's text keys and values are computed once per prompt and reused (exact)"

    def wrapped(self, model):
        from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoEImageTransformerBlock

        blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, NucleusMoEImageTransformerBlock)]
        if not blocks:
            raise Unsupported(f"'cache text_kv' hooks NucleusMoEImageTransformerBlock blocks (the only ones whose "
                               f"attention reads cached text keys and values); {type(model).__name__} has none")
        return blocks


class TaylorSeerCache(CacheBehaviour, TaylorSeerCacheDeclaration):
    skips = ("the first disable_cache_before_step steps and every cache_interval-th step compute fully and update "
             "the Taylor factors; the other steps predict the wrapped modules' outputs instead of running them")

    def _patterns(self):
        from diffusers.hooks import taylorseer_cache as ts

        inactive = parse_patterns(self.options.skip_predict_identifiers, "skip_predict_identifiers")
        active = parse_patterns(self.options.cache_identifiers, "cache_identifiers") or ts._TRANSFORMER_BLOCK_IDENTIFIERS
        if self.options.use_lite_mode:
            active, inactive = ts._PROJ_OUT_IDENTIFIERS, ts._BLOCK_IDENTIFIERS
        return inactive, active

    def wrapped(self, model):
        inactive, active = self._patterns()
        found = [(name, m) for name, m in model.named_modules()
                 if any(regexes.fullmatch(regexes.compile_regex(p), name) for p in (*inactive, *active))]
        if not found:
            raise Unsupported(f"'cache taylorseer' hooks the modules whose names fully match "
                               f"{', '.join(active + inactive)}; {type(model).__name__} has none (give "
                               "cache_identifiers=\"...\" naming its attention modules)")
        return found

    def config_kwargs(self, model, guard):
        kwargs = dataclasses.asdict(self.options)
        kwargs["taylor_factors_dtype"] = getattr(torch, kwargs["taylor_factors_dtype"])
        for name in ("skip_predict_identifiers", "cache_identifiers"):
            patterns = parse_patterns(kwargs[name], name)
            kwargs[name] = literal_identifiers(model, patterns, whole=True) if patterns else None
        return kwargs


class PyramidBroadcastCache(CacheBehaviour, PyramidBroadcastCacheDeclaration):
    skips = ("each wrapped attention module runs on the first step, outside the timestep range and every N-th "
             "step (the *_block_skip_range); on the other steps it returns its last output")

    def _config_fields(self):
        from diffusers.hooks import pyramid_attention_broadcast as pab

        options = self.options
        kwargs = {}
        any_range = any(getattr(options, f"{k}_attention_block_skip_range") is not None
                        for k in ("spatial", "temporal", "cross"))
        defaults = {"spatial": pab._SPATIAL_TRANSFORMER_BLOCK_IDENTIFIERS,
                    "temporal": pab._TEMPORAL_TRANSFORMER_BLOCK_IDENTIFIERS,
                    "cross": pab._CROSS_TRANSFORMER_BLOCK_IDENTIFIERS}
        for kind in ("spatial", "temporal", "cross"):
            skip = getattr(options, f"{kind}_attention_block_skip_range")
            if kind == "spatial" and not any_range:
                skip = 2  # diffusers' own fallback (it warns and sets it)
            kwargs[f"{kind}_attention_block_skip_range"] = skip
            kwargs[f"{kind}_attention_timestep_skip_range"] = parse_range(
                getattr(options, f"{kind}_attention_timestep_skip_range"), f"{kind}_attention_timestep_skip_range")
            kwargs[f"{kind}_attention_block_identifiers"] = parse_patterns(
                getattr(options, f"{kind}_attention_block_identifiers"), "") or defaults[kind]
        return kwargs

    def wrapped(self, model):
        fields = self._config_fields()
        found = []
        for name, module in attention_modules(model):
            cross = bool(getattr(module, "is_cross_attention", False))
            for kind in ("spatial", "temporal", "cross"):
                if fields[f"{kind}_attention_block_skip_range"] is None or (kind == "cross") != cross:
                    continue
                if any(regexes.search(regexes.compile_regex(p), name)
                       for p in fields[f"{kind}_attention_block_identifiers"]):
                    found.append((name, module))
                    break
        if not found:
            raise Unsupported(
                f"'cache pyramid_broadcast' hooks diffusers attention modules (Attention, AttentionModuleMixin) "
                f"whose names match the block identifiers and whose kind (self or cross attention) has a skip "
                f"range; {type(model).__name__} has none")
        return found

    def config_kwargs(self, model, guard):
        fields = self._config_fields()
        for kind in ("spatial", "temporal", "cross"):
            if parse_patterns(getattr(self.options, f"{kind}_attention_block_identifiers"), ""):  # a user's
                fields[f"{kind}_attention_block_identifiers"] = literal_identifiers(
                    model, fields[f"{kind}_attention_block_identifiers"], whole=False)
        return dict(fields, current_timestep_callback=timestep_callback(guard))


class FasterCache(CacheBehaviour, FasterCacheDeclaration):
    skips = ("each wrapped attention module recomputes every spatial_attention_block_skip_range steps within the "
             "timestep range and otherwise extrapolates from its last two outputs; unless is_guidance_distilled, "
             "the unconditional half of the batch is recomputed every unconditional_batch_skip_range steps")

    def _fields(self):
        from diffusers.hooks import faster_cache as fc

        options = dataclasses.asdict(self.options)
        kwargs = {}
        for name, value in options.items():
            if name.endswith("_range") and isinstance(value, str):
                kwargs[name] = parse_range(value, name)
            elif name.endswith("_identifiers"):
                default = (fc._SPATIAL_ATTENTION_BLOCK_IDENTIFIERS if name.startswith("spatial")
                           else fc._TEMPORAL_ATTENTION_BLOCK_IDENTIFIERS)
                kwargs[name] = parse_patterns(value, name) or default
            else:
                kwargs[name] = value
        return kwargs

    def wrapped(self, model):
        from diffusers.hooks import faster_cache as fc

        fields = self._fields()
        found = []
        for name, module in attention_modules(model):
            if not any(re.search(p, name) for p in fc._TRANSFORMER_BLOCK_IDENTIFIERS):
                continue
            cross = bool(getattr(module, "is_cross_attention", False))
            spatial = any(regexes.search(regexes.compile_regex(p), name)
                          for p in fields["spatial_attention_block_identifiers"]) and not cross
            temporal = (fields["temporal_attention_block_skip_range"] is not None and not cross
                        and any(regexes.search(regexes.compile_regex(p), name)
                                for p in fields["temporal_attention_block_identifiers"]))
            if spatial or temporal:
                found.append((name, module))
        if not found:
            raise Unsupported(
                f"'cache faster' hooks diffusers self-attention modules inside blocks whose names match the "
                f"spatial/temporal identifiers; {type(model).__name__} has none")
        return found

    def call_notes(self):
        low, high = parse_range(self.options.spatial_attention_timestep_skip_range,
                                "spatial_attention_timestep_skip_range")
        if self.options.is_guidance_distilled:
            return [f"a denoising loop's first call must be at a timestep outside ({low}, {high}) (pipelines start "
                    "above it; an img2img at low strength may not)"]
        return [f"each call carries the unconditional and conditional batches concatenated (an even batch, as CFG "
                f"pipelines call it) with hidden_states in {self.options.tensor_format}; a guidance-distilled model "
                "(Flux) takes is_guidance_distilled=true"]

    def call_check(self):
        distilled = self.options.is_guidance_distilled
        layout = self.options.tensor_format
        dims = len(layout)
        ranges = [("spatial_attention_timestep_skip_range", parse_range(
            self.options.spatial_attention_timestep_skip_range, "spatial_attention_timestep_skip_range"))]
        if self.options.temporal_attention_block_skip_range is not None:
            ranges.append(("temporal_attention_timestep_skip_range", parse_range(
                self.options.temporal_attention_timestep_skip_range, "temporal_attention_timestep_skip_range")))

        def check(guard, args: tuple, kwargs: dict) -> str | None:
            if distilled and guard.calls == 0 and guard.timestep is not None and guard.timestep[0] is not None:
                # Guidance-distilled, the attention hooks reuse their last outputs within these timesteps from
                # the first call on, and there are none yet (diffusers fails with "'NoneType' object is not
                # subscriptable"); a pipeline starts at a high timestep, an img2img at low strength may not.
                # (With CFG they compute on the first call: it sets the batch size they compare against.)
                timestep = guard.current_timestep()
                for name, (low, high) in ranges:
                    if low < timestep < high:
                        return (f"the first call of a denoising loop (after a reset) must compute attention, and "
                                f"diffusers' FasterCache reuses it from the first call on within {name} "
                                f"({low}, {high}); this call's timestep is {timestep:g}: start the loop above {high} "
                                f"(a pipeline does), or set {name} so that it excludes the first timestep")
            if distilled:
                return None
            states = kwargs.get("hidden_states", args[0] if args else None)
            if not isinstance(states, torch.Tensor):
                return None
            if states.dim() != dims:
                return (f"unless is_guidance_distilled=true, diffusers' FasterCache splits the denoiser's output as "
                        f"{layout} ({dims} dimensions), and this call's hidden_states have {states.dim()} "
                        f"{tuple(states.shape)} (packed tokens: Flux, Qwen-Image, ...): for a guidance-distilled model "
                        "write is_guidance_distilled=true, or set tensor_format= to the layout")
            if states.shape[0] % 2:
                return (f"unless is_guidance_distilled=true, diffusers' FasterCache expects the unconditional and "
                        f"conditional batches concatenated (classifier-free guidance, as diffusers' pipelines call "
                        f"the denoiser): an even batch; this call's is {states.shape[0]}")
            return None

        return check

    def config_kwargs(self, model, guard):
        kwargs = self._fields()
        for name in ("spatial_attention_block_identifiers", "temporal_attention_block_identifiers"):
            if parse_patterns(getattr(self.options, name), name):  # a user's patterns
                kwargs[name] = literal_identifiers(model, kwargs[name], whole=False)
        weight = kwargs.pop("attention_weight")
        kwargs["attention_weight_callback"] = lambda _module, w=weight: w
        kwargs["current_timestep_callback"] = timestep_callback(guard)
        return kwargs
