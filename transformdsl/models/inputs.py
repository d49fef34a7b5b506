"""Sample inputs for a model (:func:`sample_inputs`), and one run of it (:func:`run`): what ``verify`` and the
benchmarks feed a model, shaped from the model's own config.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from .builtin import BUILTIN, BUILTIN_CONFIGS, unknown_builtin

#: Batch and sequence lengths of :func:`sample_inputs` (batch x sequence is a multiple of 16).
BATCH = 2
TEXT_TOKENS = 8
#: Flux latent grid (height x width tokens; Flux has no ``sample_size``).
FLUX_GRID = (4, 4)
#: What :func:`sample_inputs` gives a pipeline.
PIPELINE_PROMPT = "a cat"
PIPELINE_CALL: dict[str, Any] = dict(num_inference_steps=2, height=32, width=32, output_type="np")


_BUILTIN_KINDS = {"unet": "unet", "sd3": "sd3", "flux": "flux", "llama": "lm", "gpt2": "lm", "sd-pipeline": "pipeline"}

#: Class name (anywhere in the model's MRO) -> kind of inputs.  Checked in order.
_CLASS_KINDS = (
    ("UNet2DConditionModel", "unet"),
    ("UNet2DModel", "unet2d"),
    ("SD3Transformer2DModel", "sd3"),
    ("FluxTransformer2DModel", "flux"),
    ("PreTrainedModel", "transformers"),  # by its main input: see _TRANSFORMERS_INPUTS
    ("DiffusionPipeline", "pipeline"),
)
#: A transformers model's ``main_input_name`` -> kind of inputs.
_TRANSFORMERS_INPUTS = {"input_ids": "lm", "pixel_values": "pixels", "input_features": "speech"}
#: What :func:`sample_inputs` makes inputs for, in words (for messages).
SAMPLE_KINDS = ("UNet2DConditionModel, UNet2DModel, SD3Transformer2DModel, FluxTransformer2DModel, transformers "
                "models whose main input is input_ids, pixel_values or input_features, and diffusers pipelines")


def _unwrap(model: Any) -> Any:
    """The module inside ``torch.compile(module)``."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def _kind(model: Any) -> str:
    names = {cls.__name__ for cls in type(model).__mro__}
    for class_name, kind in _CLASS_KINDS:
        if class_name in names:
            if kind == "transformers":
                main = getattr(model, "main_input_name", "input_ids")
                if main not in _TRANSFORMERS_INPUTS:
                    raise ValueError(f"no sample inputs for a {type(model).__name__} (its main input is {main}); "
                                     f"they are made for {SAMPLE_KINDS}")
                return _TRANSFORMERS_INPUTS[main]
            return kind
    raise ValueError(f"no sample inputs for a {type(model).__name__}; they are made for {SAMPLE_KINDS} "
                     "(and subclasses)")


def sample_inputs_problem(model: Any) -> str | None:
    """The model, in words, if :func:`sample_inputs` cannot make inputs for it (``"a WanTransformer3DModel"``;
    None: it can), without running it."""
    model = _unwrap(model)
    try:
        _kind(model)
    except ValueError:
        main = getattr(model, "main_input_name", None) if isinstance(model, nn.Module) else None
        return f"a {type(model).__name__}" + (f", whose main input is {main}" if isinstance(main, str) else "")
    return None


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _placement(model: Any) -> tuple[torch.device, torch.dtype]:
    """Device of the first real tensor; the float dtype holding most elements (float32 if none)."""
    modules = model.components.values() if not isinstance(model, nn.Module) else [model]
    device = torch.device("cpu")
    counts: Counter = Counter()
    found_device = False
    for module in modules:
        if not isinstance(module, nn.Module):
            continue
        for tensor in [*module.parameters(), *module.buffers()]:
            if not found_device and tensor.device.type != "meta":
                device, found_device = tensor.device, True
            if tensor.dtype in _FLOATS:
                counts[tensor.dtype] += tensor.numel()
    dtype = counts.most_common(1)[0][0] if counts else torch.float32
    return device, dtype


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    return getattr(config, key, default)


def sample_inputs(
    name_or_model: str | Any,
    seed: int = 0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` such that ``model(*args, **kwargs)`` runs the model once.

    ``name_or_model`` is a built-in name or a model; a model is recognised by its class (or a base
    class; ``torch.compile`` wrappers are looked through), and the shapes come from its config:

    * ``UNet2DConditionModel``: ``(sample,)`` + ``timestep``, ``encoder_hidden_states`` (and SDXL's
      ``added_cond_kwargs`` when its config asks for them);
    * ``SD3Transformer2DModel``: ``(hidden_states,)`` + ``encoder_hidden_states``, ``pooled_projections``,
      ``timestep``;
    * ``FluxTransformer2DModel``: ``(hidden_states,)`` (packed tokens of a 4x4 grid) +
      ``encoder_hidden_states``, ``pooled_projections``, ``timestep``, ``img_ids``, ``txt_ids``
      (and ``guidance`` if the model embeds it);
    * ``UNet2DModel``: ``(sample,)`` + ``timestep`` (and ``class_labels`` when it embeds classes);
    * a transformers model, by its ``main_input_name``: ``(input_ids,)``, ``(pixel_values,)`` (from
      ``image_size`` and ``num_channels``) or ``(input_features,)`` (``num_mel_bins`` x twice
      ``max_source_positions`` frames); models whose ``forward`` takes ``decoder_input_ids`` get
      those too, and ``use_cache=False`` where ``forward`` takes it;
    * a diffusers pipeline: ``("a cat",)`` + 2 steps, 32x32, ``output_type="np"`` and a CPU generator.

    Batch 2, text length 8.  Tensors are drawn from a private generator seeded with ``seed`` (the global
    RNG is untouched), then put on ``device`` (default: the model's) in ``dtype`` (floating inputs only;
    default: the float dtype that holds most of the model's weights, float32 for a name).
    """
    if isinstance(name_or_model, str):
        if name_or_model not in BUILTIN:
            raise ValueError(unknown_builtin(name_or_model))
        kind = _BUILTIN_KINDS[name_or_model]
        config = SimpleNamespace(**BUILTIN_CONFIGS.get(name_or_model, {}))
        model_device, model_dtype = torch.device("cpu"), torch.float32
    else:
        model = _unwrap(name_or_model)
        kind = _kind(model)
        config = getattr(model, "config", SimpleNamespace())
        model_device, model_dtype = _placement(model)
    device = torch.device(device) if device is not None else model_device
    dtype = dtype or model_dtype
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    if kind == "pipeline":
        return (PIPELINE_PROMPT,), {**PIPELINE_CALL, "generator": generator}
    if kind in ("lm", "pixels", "speech"):
        return _transformers_inputs(name_or_model, kind, config, randn, generator, device)
    if kind == "unet2d":
        size = config.sample_size or 32  # None: any size the blocks divide
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        kwargs = {"timestep": torch.tensor([10, 500][:BATCH], device=device)}
        if _config_get(config, "num_class_embeds"):
            kwargs["class_labels"] = torch.randint(0, config.num_class_embeds, (BATCH,), generator=generator).to(device)
        return (randn(BATCH, config.in_channels, *size),), kwargs

    if kind == "unet":
        size = config.sample_size
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        cross = config.cross_attention_dim
        cross = cross[0] if isinstance(cross, (list, tuple)) else cross
        kwargs: dict[str, Any] = {
            "timestep": torch.tensor([10, 500][:BATCH], device=device),
            "encoder_hidden_states": randn(BATCH, TEXT_TOKENS, cross),
        }
        if _config_get(config, "addition_embed_type") == "text_time":
            time_ids = 6 * config.addition_time_embed_dim
            text_embeds = config.projection_class_embeddings_input_dim - time_ids
            kwargs["added_cond_kwargs"] = {"text_embeds": randn(BATCH, text_embeds), "time_ids": randn(BATCH, 6)}
        return (randn(BATCH, config.in_channels, *size),), kwargs
    if kind == "sd3":
        size = config.sample_size
        return (randn(BATCH, config.in_channels, size, size),), {
            "encoder_hidden_states": randn(BATCH, TEXT_TOKENS, config.joint_attention_dim),
            "pooled_projections": randn(BATCH, config.pooled_projection_dim),
            "timestep": torch.tensor([10.0, 500.0][:BATCH], device=device, dtype=dtype),
        }
    if kind == "flux":
        rows, cols = FLUX_GRID
        img_ids = torch.zeros(rows, cols, 3)
        img_ids[..., 1] = torch.arange(rows)[:, None]
        img_ids[..., 2] = torch.arange(cols)[None, :]
        kwargs = {
            "encoder_hidden_states": randn(BATCH, TEXT_TOKENS, config.joint_attention_dim),
            "pooled_projections": randn(BATCH, config.pooled_projection_dim),
            "timestep": torch.tensor([0.01, 0.5][:BATCH], device=device, dtype=dtype),
            "img_ids": img_ids.reshape(rows * cols, 3).to(device=device, dtype=dtype),
            "txt_ids": torch.zeros(TEXT_TOKENS, 3, device=device, dtype=dtype),
        }
        if _config_get(config, "guidance_embeds"):
            kwargs["guidance"] = torch.full((BATCH,), 3.5, device=device, dtype=dtype)
        return (randn(BATCH, rows * cols, config.in_channels),), kwargs
    raise AssertionError(kind)  # pragma: no cover


def _forward_parameters(model: Any) -> set[str] | None:
    """Names ``model.forward`` takes (None for a built-in name or when they cannot be read)."""
    import inspect

    try:
        return set(inspect.signature(_unwrap(model).forward).parameters)
    except (AttributeError, TypeError, ValueError):
        return None


def _transformers_inputs(model: Any, kind: str, config: Any, randn, generator, device) -> tuple[tuple, dict]:
    """Inputs of a transformers model, by the kind of its main input."""
    vocab = _config_get(config, "vocab_size", 256)

    def ids() -> torch.Tensor:
        return torch.randint(0, vocab, (BATCH, TEXT_TOKENS), generator=generator).to(device)

    if kind == "pixels":
        size = _config_get(config, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        args: tuple = (randn(BATCH, _config_get(config, "num_channels", 3), *size),)
    elif kind == "speech":
        args = (randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions),)
    else:
        args = (ids(),)
    takes = _forward_parameters(model)
    kwargs: dict[str, Any] = {}
    if takes is None or "use_cache" in takes:
        kwargs["use_cache"] = False
    if takes is not None and "decoder_input_ids" in takes and _config_get(config, "is_encoder_decoder"):
        kwargs["decoder_input_ids"] = ids()
    return args, kwargs


def one_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    for attribute in ("sample", "logits", "last_hidden_state", "images"):
        value = getattr(output, attribute, None)
        if value is not None:
            if isinstance(value, (tuple, list)):  # e.g. Z-Image: one sample tensor per batch item
                return one_tensor(value)
            return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if isinstance(output, (tuple, list)) and output:
        return one_tensor(output[0])
    raise TypeError(f"cannot find the output tensor in a {type(output).__name__}")


def run(model: Any, seed: int = 0) -> torch.Tensor:
    """Call ``model`` on :func:`sample_inputs` ``(model, seed)`` under ``torch.no_grad()``; one tensor.

    The tensor is ``.sample`` (diffusers models), ``.logits`` (transformers models) or, for a pipeline,
    the images (``(batch, height, width, 3)`` float32 in [0, 1], from 2 steps at 32x32).  Same model and
    seed -> bit-identical output on the same machine.  ``model`` may also be a built-in name.
    """
    if isinstance(model, str):
        model = BUILTIN[model]() if model in BUILTIN else _unknown(model)
    args, kwargs = sample_inputs(model, seed)
    with torch.no_grad():
        return one_tensor(model(*args, **kwargs))


def _unknown(name: str):
    raise ValueError(unknown_builtin(name))
