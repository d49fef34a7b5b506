"""LoRA key formats → one LoRA per module path, through diffusers' and PEFT's own converters.

A community LoRA names its modules in one of many conventions: kohya/A1111 (``lora_unet_..._to_q
.lora_down.weight`` with ``.alpha``), diffusers' older attention-processor keys
(``...processor.to_q_lora.down.weight``), PEFT (``base_model.model.<path>.lora_A.weight``) and
diffusers' own (``transformer.<path>.lora_A.weight``).  They are converted by the library that reads
them: the ``lora_state_dict`` of the diffusers loader mixin for the model's class (which recognises
kohya, XLabs, BFL and the others for that architecture), then diffusers'
``convert_unet_state_dict_to_peft`` for the older diffusers keys.  What comes out is PEFT's form,
grouped here per module path: ``A`` (rank x in), ``B`` (out x rank) and ``alpha``.

The converters are run on *placeholder* tensors at planning time (meta tensors, shapes from the
header; the scalar ``alpha`` entries as ones, as their values never decide a key), so that a plan
knows which modules a file names without reading its data.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import TransformError
from . import MAX_ALPHA
from .files import printable

#: Pipeline components a key may be prefixed with (diffusers writes ``unet.``, ``transformer.``...).
COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "prior", "decoder")
#: PEFT's prefix for a wrapped model (``PeftModel.base_model.model``).
PEFT_PREFIX = "base_model.model."
#: diffusers model class → the loader mixin whose ``lora_state_dict`` converts its community formats.
MIXINS = {
    "FluxTransformer2DModel": "FluxLoraLoaderMixin",
    "SD3Transformer2DModel": "SD3LoraLoaderMixin",
    "UNet2DConditionModel": "StableDiffusionLoraLoaderMixin",
    "SanaTransformer2DModel": "SanaLoraLoaderMixin",
    "AuraFlowTransformer2DModel": "AuraFlowLoraLoaderMixin",
    "CogVideoXTransformer3DModel": "CogVideoXLoraLoaderMixin",
    "HunyuanVideoTransformer3DModel": "HunyuanVideoLoraLoaderMixin",
    "LTXVideoTransformer3DModel": "LTXVideoLoraLoaderMixin",
    "WanTransformer3DModel": "WanLoraLoaderMixin",
    "QwenImageTransformer2DModel": "QwenImageLoraLoaderMixin",
    "HiDreamImageTransformer2DModel": "HiDreamImageLoraLoaderMixin",
    "Lumina2Transformer2DModel": "Lumina2LoraLoaderMixin",
}
_PEFT_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.[A-Za-z0-9_-]+)?\.(?P<tensor>weight|bias)$")
#: Keys of adapters that are not LoRAs (DoRA's magnitude, LoKr, LoHa, IA3): refused by name.
_NOT_LORA = re.compile(r"lora_magnitude_vector|dora_scale|\.lokr_|\.hada_|\.ia3_|\.oft_")


class NeedsValues(Exception):
    """A converter read the values of placeholder tensors (a sparsity test): the keys are known once
    the tensors are read."""


@dataclass
class Pair:
    """One module's LoRA: ``delta = alpha / rank * B @ A`` (``alpha`` None: the statement's, or the rank)."""

    A: torch.Tensor
    B: torch.Tensor
    alpha: float | None = None

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])


@dataclass
class Converted:
    """A LoRA file as the modules of one component see it."""

    #: module path (in the PEFT / diffusers naming) → its LoRA
    pairs: dict[str, Pair]
    #: other pipeline components named by the file → how many of their modules
    others: dict[str, int] = field(default_factory=dict)
    #: the converter the file went through (for the plan)
    via: str = ""


def placeholders(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Tensors standing for a header's: meta tensors of the right shape and dtype (scalars as ones)."""
    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
              "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
    out = {}
    for name, (dtype, shape) in tensors.items():
        if math.prod(shape) == 1 and len(shape) <= 2:
            out[name] = torch.ones(shape, dtype=torch.float32)  # alpha: a value some converters .item()
        else:
            out[name] = torch.empty(shape, dtype=dtypes[dtype], device="meta")
    return out


def convert(state: dict[str, torch.Tensor], root: nn.Module, component: str, file: str) -> Converted:
    """The LoRA of each module of ``root`` (the pipeline component ``component``, ``""`` for a
    plain model) that ``state`` (a LoRA file's tensors, or their :func:`placeholders`) names."""
    bad = sorted(k for k in state if _NOT_LORA.search(k))
    if bad:
        raise TransformError(f"{file}: '{printable(bad[0])}' ({len(bad)} such keys) belongs to an adapter that is "
                             "not a plain LoRA (DoRA, LoKr, LoHa, IA3...): only LoRA (A and B matrices) is supported")
    for key, tensor in state.items():
        if key.endswith("alpha") and isinstance(tensor, torch.Tensor) and tensor.numel() != 1:
            raise TransformError(f"{file}: '{printable(key)}' has shape {tuple(tensor.shape)}: a LoRA's alpha is "
                                 "one number (it scales its module's delta)")
    state, alphas, via = _library_conversion(dict(state), root, file)
    pairs: dict[str, dict[str, Any]] = {}
    others: dict[str, set[str]] = {}
    leftovers = []
    for key, tensor in state.items():
        owner, rest = _split_component(key, root)
        if owner is not None and owner != (component or _own_component(root)):
            others.setdefault(owner, set()).add(rest.split(".lora")[0])
            continue
        if rest.endswith(".alpha"):
            alphas[rest[: -len(".alpha")]] = tensor
            continue
        match = _PEFT_KEY.match(rest)
        if match is None:
            leftovers.append(key)
            continue
        if match["tensor"] == "bias":
            raise TransformError(f"{file}: '{printable(key)}': a LoRA with a bias on B is not supported (merge it "
                                 "with the library that made it, or train without lora_bias)")
        pairs.setdefault(match["module"], {})[match["part"]] = tensor
    if leftovers:
        more = f" (and {len(leftovers) - 3} more)" if len(leftovers) > 3 else ""
        raise TransformError(f"{file}: keys in no LoRA format diffusers or PEFT reads for a "
                             f"{type(root).__name__}: {', '.join(map(printable, leftovers[:3]))}{more}")
    out: dict[str, Pair] = {}
    for module, parts in pairs.items():
        shown = printable(module)
        if set(parts) != {"lora_A", "lora_B"}:
            missing = "lora_B" if "lora_A" in parts else "lora_A"
            raise TransformError(f"{file}: module '{shown}' has no {missing} (a LoRA needs both A and B)")
        alpha = alphas.get(module, alphas.get(id(parts["lora_A"])))
        if isinstance(alpha, torch.Tensor) and alpha.numel() != 1:
            raise TransformError(f"{file}: module '{shown}' has an alpha of shape {tuple(alpha.shape)}: a LoRA's "
                                 "alpha is one number")
        alpha = None if alpha is None else _number(alpha)
        if alpha is not None and not math.isfinite(alpha):
            raise TransformError(f"{file}: module '{shown}' has alpha {alpha}: a LoRA's alpha must be a finite "
                                 "number (it scales the delta added to the weight)")
        if alpha is not None and abs(alpha) > MAX_ALPHA:
            raise TransformError(f"{file}: module '{shown}' has alpha {alpha:g}: a LoRA's alpha is at most "
                                 f"{MAX_ALPHA:g} (of its rank's order; this one would make the model compute inf/NaN)")
        for part in ("lora_A", "lora_B"):
            tensor = parts[part]
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta and tensor.is_floating_point() \
                    and not bool(torch.isfinite(tensor if tensor.element_size() > 1 else tensor.float()).all()):
                # (isfinite has no float8 kernel: those, a byte each, are widened first)
                raise TransformError(f"{file}: module '{shown}': its {part} holds NaN or infinite values "
                                     "(the model would compute NaN)")
        out[module] = Pair(parts["lora_A"], parts["lora_B"], alpha)
    return Converted(out, {k: len(v) for k, v in others.items()}, via)


def _number(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _own_component(root: nn.Module) -> str:
    """The prefix diffusers gives the keys of a denoiser of this class (``transformer``, ``unet``)."""
    name = type(root).__name__
    return "unet" if "UNet" in name else "transformer" if type(root).__module__.startswith("diffusers") else ""


def _split_component(key: str, root: nn.Module) -> tuple[str | None, str]:
    """``(pipeline component, the rest)`` of a key diffusers prefixed with its component (``unet.``,
    ``transformer.``...); ``(None, key)`` otherwise, and when the model itself has a child of that name
    (DistilBERT's ``transformer``, T5's ``decoder``): then the key is the model's own path."""
    if key.startswith(PEFT_PREFIX):
        return None, key[len(PEFT_PREFIX):]
    head, _, rest = key.partition(".")
    if head in COMPONENTS and rest and head not in root._modules:
        return head, rest
    return None, key


def _library_conversion(state: dict, root: nn.Module, file: str) -> tuple[dict, dict, str]:
    """``state`` through the library converters for ``root``'s class; (state, alphas by the identity of
    their A tensor, what converted it)."""
    alphas: dict[Any, Any] = {}
    via = "as written (diffusers/PEFT keys)"
    mixin_name = MIXINS.get(type(root).__name__) if type(root).__module__.startswith("diffusers") else None
    if mixin_name is None and any(k.startswith(("lora_te", "lora_unet_")) for k in state):
        # kohya keys for a pipeline's text encoder (lora_te_, lora_te1_...): the Stable Diffusion loader's
        mixin_name = "StableDiffusionLoraLoaderMixin"
    if mixin_name is not None:
        import diffusers.loaders as loaders

        mixin = getattr(loaders, mixin_name, None)
        if mixin is not None:
            try:
                result = mixin.lora_state_dict(state, return_alphas=True) if "return_alphas" in \
                    _parameters(mixin.lora_state_dict) else mixin.lora_state_dict(state)
            except TypeError:
                result = mixin.lora_state_dict(state)
            except Exception as exc:
                if any(t.is_meta for t in state.values()):
                    raise NeedsValues(f"{type(exc).__name__}: {exc}") from exc
                raise TransformError(f"{file}: diffusers' {mixin_name} cannot read this LoRA for a "
                                     f"{type(root).__name__}: {type(exc).__name__}: {exc}") from exc
            if isinstance(result, tuple):
                state = result[0]
                network_alphas = result[1] if len(result) > 1 and isinstance(result[1], dict) else None
            else:
                state, network_alphas = result, None
            via = f"diffusers {mixin_name}.lora_state_dict"
            alphas.update(_alphas_by_tensor(state, network_alphas or {}))
    if any(".lora.down." in k or ".lora.up." in k or "_lora.down." in k or "_lora.up." in k
           or "lora_linear_layer" in k for k in state):
        state = _older_diffusers_to_peft(state, root)
        via += " + diffusers' convert_*_to_peft"
    # PEFT keys with the adapter's name (`lora_A.default.weight`) read as the plain ones.
    return state, alphas, via


def _older_diffusers_to_peft(state: dict, root: nn.Module) -> dict:
    """diffusers' older keys in PEFT's form, converted as diffusers' loaders do: a text encoder's with
    ``convert_state_dict_to_diffusers`` then ``convert_state_dict_to_peft`` (and without the
    ``text_model.`` level that transformers 5's CLIPTextModel no longer has), a denoiser's with
    ``convert_unet_state_dict_to_peft``."""
    from diffusers.utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    parts: dict[str, dict] = {}
    for key, value in state.items():
        owner, rest = _split_component(key, root)
        parts.setdefault(owner or "", {})[rest] = value
    out = {}
    for owner, part in parts.items():
        text = owner.startswith("text_encoder") or (not owner and not type(root).__module__.startswith("diffusers"))
        if text:
            part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
            if not hasattr(root, "text_model"):
                part = {k.removeprefix("text_model."): v for k, v in part.items()}
        elif not all("lora_A" in k or "lora_B" in k or k.endswith(".alpha") for k in part):
            part = convert_unet_state_dict_to_peft(part)
        out.update({f"{owner}.{k}" if owner else k: v for k, v in part.items()})
    return out


def _parameters(function) -> tuple[str, ...]:
    import inspect

    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _alphas_by_tensor(state: dict, network_alphas: dict) -> dict:
    """diffusers' ``network_alphas`` (``unet.x.alpha``, or ``<A key>.alpha`` in its older keys) keyed by
    the identity of the A tensor they scale: the key conversions that follow rename keys but keep
    the tensors, so the alpha finds its module whatever the module ends up being called."""
    out = {}
    for key, value in network_alphas.items():
        stem = key[: -len(".alpha")] if key.endswith(".alpha") else key
        for candidate in (stem, f"{stem}.lora.down.weight", f"{stem}.lora_A.weight", f"{stem}.lora_down.weight"):
            if candidate in state:
                out[id(state[candidate])] = value
                break
    return out


# --------------------------------------------------------------------------- modules


def nearest(path: str, names: list[str], n: int = 3) -> list[str]:
    """The module names closest to ``path`` (for "matches no module" errors)."""
    return difflib.get_close_matches(path, names, n=n, cutoff=0.5)
