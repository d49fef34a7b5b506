"""Built-in tiny models, sample inputs for them, and ``--model SPEC`` resolution.

The built-ins are the real classes of diffusers and transformers built from small configs with
random weights, so that transforms are tested on the code paths users run, in well under a second:

=============== ================================================ =====================================
name            factory                                          class
=============== ================================================ =====================================
``unet``        :func:`tiny_unet`                                ``diffusers.UNet2DConditionModel``
``sd3``         :func:`tiny_sd3`                                 ``diffusers.SD3Transformer2DModel``
``flux``        :func:`tiny_flux`                                ``diffusers.FluxTransformer2DModel``
``llama``       :func:`tiny_llama`                               ``transformers.LlamaForCausalLM``
``gpt2``        :func:`tiny_gpt2`                                ``transformers.GPT2LMHeadModel``
``sd-pipeline`` :func:`tiny_sd_pipeline`                         ``diffusers.StableDiffusionPipeline``
=============== ================================================ =====================================

What a caller may rely on:

* every factory takes ``seed`` (default 0) and returns the model in eval mode, float32, on the CPU;
  the same seed gives bit-identical weights, and building does not touch the global RNG state;
* dropout probabilities are 0, so outputs do not depend on train/eval mode;
* :func:`sample_inputs` gives ``(args, kwargs)`` for ``model(*args, **kwargs)``, shaped from the model's
  own config (so a loaded model of a supported class works too), deterministic for a seed; every token
  count (batch x sequence) is a multiple of 16, as CUDA fp8 matmuls require;
* :func:`run` calls the model on those inputs under ``torch.no_grad()`` and returns one tensor;
* :func:`resolve_model` turns the CLI's ``--model SPEC`` into a model, never reaching a model hub.

diffusers and transformers are imported inside the functions that need them; importing this module
imports neither.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

__all__ = [
    "BUILTIN",
    "tiny_unet",
    "tiny_sd3",
    "tiny_flux",
    "tiny_llama",
    "tiny_gpt2",
    "tiny_sd_pipeline",
    "tiny_clip_tokenizer",
    "sample_inputs",
    "run",
    "resolve_model",
]

# --------------------------------------------------------------------------- configs

#: ``UNet2DConditionModel`` config.  diffusers reads ``attention_head_dim`` here as the number of heads
#: (8 heads: head size 4 in the 32-channel block, 8 in the 64-channel ones).
UNET_CONFIG: dict[str, Any] = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=8,
)

#: ``SD3Transformer2DModel`` config (4 heads of 8 = 32 = ``caption_projection_dim``, as diffusers requires).
SD3_CONFIG: dict[str, Any] = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    out_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=32,
    caption_projection_dim=32,
    pooled_projection_dim=16,
    pos_embed_max_size=8,
)

#: ``FluxTransformer2DModel`` config (``axes_dims_rope`` sums to the head size 8).
FLUX_CONFIG: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    axes_dims_rope=(2, 2, 4),
    guidance_embeds=False,
)

#: ``LlamaConfig``: grouped-query attention, 4 query heads of 16 sharing 2 key/value heads.
LLAMA_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
)

#: ``GPT2Config`` (dropout off; bos/eos inside the small vocabulary).
GPT2_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    n_positions=64,
    n_embd=64,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=255,
    eos_token_id=255,
)

#: Attention implementation of the transformers built-ins; bit-reproducible on the CPU.
LLM_ATTENTION = "sdpa"

#: ``AutoencoderKL`` of the tiny pipeline: 2 blocks, so latents are half the image size.
VAE_CONFIG: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(16, 32),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=32,
)

#: ``CLIPTextConfig`` of the tiny pipeline (hidden size = the UNet's ``cross_attention_dim``); the
#: vocabulary size and special token ids come from the tokenizer.
CLIP_TEXT_CONFIG: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
    projection_dim=32,
)

#: ``DDIMScheduler`` config of Stable Diffusion 1.x (the defaults draw deprecation warnings).
DDIM_CONFIG: dict[str, Any] = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
)

#: Words the tiny CLIP tokenizer knows whole; anything else is split into byte-level characters.
TOKENIZER_WORDS = ("a", "an", "the", "of", "cat", "dog", "photo", "painting", "red", "blue")
#: Prompt length of the tiny pipeline (the tokenizer pads and truncates to it).
PROMPT_TOKENS = 16

#: Batch and sequence lengths of :func:`sample_inputs` (batch x sequence is a multiple of 16).
BATCH = 2
TEXT_TOKENS = 8
#: Flux latent grid (height x width tokens; Flux has no ``sample_size``).
FLUX_GRID = (4, 4)
#: What :func:`sample_inputs` gives a pipeline.
PIPELINE_PROMPT = "a cat"
PIPELINE_CALL: dict[str, Any] = dict(num_inference_steps=2, height=32, width=32, output_type="np")


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed the CPU generator for the block and restore the caller's RNG state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def _ready(model: nn.Module) -> nn.Module:
    """Eval mode, float32, CPU (casting only when needed: diffusers warns on every ``.to(dtype)``).

    A model built under ``torch.device("meta")`` stays there: that is how ``load(dir, model=tiny_flux)``
    calls a factory (a meta tensor cannot be copied to the CPU).
    """
    if any(t.dtype != torch.float32 or t.device.type not in ("cpu", "meta") for t in model.parameters()):
        model = model.to(device="cpu", dtype=torch.float32)
    return model.eval()


# --------------------------------------------------------------------------- factories


def tiny_unet(seed: int = 0) -> nn.Module:
    """A ``diffusers.UNet2DConditionModel`` (:data:`UNET_CONFIG`, 0.79 M parameters).

    Four transformer blocks (first down block, mid block, two in the last up block), each with ``attn1``
    (self-attention) and ``attn2`` (cross-attention: ``to_k``/``to_v`` read 32-wide text states): eight
    ``Attention`` modules with ``to_q/to_k/to_v/to_out.0``.
    """
    from diffusers import UNet2DConditionModel

    with _seeded(seed):
        return _ready(UNet2DConditionModel(**UNET_CONFIG))


def tiny_sd3(seed: int = 0) -> nn.Module:
    """A ``diffusers.SD3Transformer2DModel`` (:data:`SD3_CONFIG`, two joint blocks).

    Joint attention: each block's ``attn`` has ``to_q/to_k/to_v`` and ``add_q_proj/add_k_proj/add_v_proj``;
    the last block is ``context_pre_only`` (no ``to_add_out``).
    """
    from diffusers import SD3Transformer2DModel

    with _seeded(seed):
        return _ready(SD3Transformer2DModel(**SD3_CONFIG))


def tiny_flux(seed: int = 0) -> nn.Module:
    """A ``diffusers.FluxTransformer2DModel`` (:data:`FLUX_CONFIG`): one double block, two single blocks.

    Single blocks' ``FluxAttention`` are ``pre_only`` (no ``to_out``).  No guidance embedding.
    """
    from diffusers import FluxTransformer2DModel

    with _seeded(seed):
        return _ready(FluxTransformer2DModel(**FLUX_CONFIG))


def tiny_llama(seed: int = 0) -> nn.Module:
    """A ``transformers.LlamaForCausalLM`` (:data:`LLAMA_CONFIG`) with grouped-query attention.

    ``k_proj``/``v_proj`` are 64 -> 32, ``q_proj``/``o_proj`` 64 -> 64; untied ``lm_head``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_CONFIG, attn_implementation=LLM_ATTENTION)
    with _seeded(seed):
        return _ready(LlamaForCausalLM(config))


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A ``transformers.GPT2LMHeadModel`` (:data:`GPT2_CONFIG`).

    Attention is ``c_attn`` (already fused q/k/v) and ``c_proj``, both ``Conv1D`` with (in, out) weights.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(**GPT2_CONFIG, attn_implementation=LLM_ATTENTION)
    with _seeded(seed):
        return _ready(GPT2LMHeadModel(config))


def tiny_clip_tokenizer():
    """A ``transformers.CLIPTokenizer`` built in memory: byte-level BPE over :data:`TOKENIZER_WORDS`.

    Every byte is in the vocabulary (no unknown tokens); the listed words are single tokens.  Pads and
    truncates to :data:`PROMPT_TOKENS`.  Never reads a file or a hub.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    alphabet = sorted(ByteLevel.alphabet())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    for word in TOKENIZER_WORDS:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            parts = [parts[0] + parts[1], *parts[2:]]
            if pair not in merges:
                merges.append(pair)
                tokens.append(parts[0])
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=PROMPT_TOKENS)


def tiny_sd_pipeline(seed: int = 0):
    """A ``diffusers.StableDiffusionPipeline`` of tiny parts, without safety checker.

    * ``unet``: :func:`tiny_unet` with the same weights for the same seed, but ``sample_size=16`` so that
      the default image is 32x32;
    * ``vae``: an ``AutoencoderKL`` (:data:`VAE_CONFIG`; like SD's, its mid block has an ``Attention``);
    * ``text_encoder``: a ``CLIPTextModel`` (:data:`CLIP_TEXT_CONFIG`) with ``tokenizer``
      :func:`tiny_clip_tokenizer`;
    * ``scheduler``: ``DDIMScheduler`` (:data:`DDIM_CONFIG`).

    ``pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="np")`` runs offline in about
    0.1 s on one CPU thread.  The progress bar is off.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = tiny_clip_tokenizer()
    text_config = CLIPTextConfig(
        **CLIP_TEXT_CONFIG,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _seeded(seed):
        unet = _ready(UNet2DConditionModel(**{**UNET_CONFIG, "sample_size": 16}))
        vae = _ready(AutoencoderKL(**VAE_CONFIG))
        text_encoder = _ready(CLIPTextModel(text_config))
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(**DDIM_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: Built-in name -> factory (each takes ``seed: int = 0``).
BUILTIN: dict[str, Callable[..., Any]] = {
    "unet": tiny_unet,
    "sd3": tiny_sd3,
    "flux": tiny_flux,
    "llama": tiny_llama,
    "gpt2": tiny_gpt2,
    "sd-pipeline": tiny_sd_pipeline,
}

# --------------------------------------------------------------------------- sample inputs

_BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "unet": UNET_CONFIG,
    "sd3": SD3_CONFIG,
    "flux": FLUX_CONFIG,
    "llama": LLAMA_CONFIG,
    "gpt2": GPT2_CONFIG,
}
_BUILTIN_KINDS = {"unet": "unet", "sd3": "sd3", "flux": "flux", "llama": "lm", "gpt2": "lm", "sd-pipeline": "pipeline"}

#: Class name (anywhere in the model's MRO) -> kind of inputs.  Checked in order.
_CLASS_KINDS = (
    ("UNet2DConditionModel", "unet"),
    ("SD3Transformer2DModel", "sd3"),
    ("FluxTransformer2DModel", "flux"),
    ("PreTrainedModel", "lm"),  # any transformers model that takes input_ids
    ("DiffusionPipeline", "pipeline"),
)


def _unwrap(model: Any) -> Any:
    """The module inside ``torch.compile(module)``."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def _kind(model: Any) -> str:
    names = {cls.__name__ for cls in type(model).__mro__}
    for class_name, kind in _CLASS_KINDS:
        if class_name in names:
            return kind
    supported = ", ".join(name for name, _ in _CLASS_KINDS)
    raise ValueError(f"no sample inputs for a {type(model).__name__}; supported: {supported} and subclasses")


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
    * a transformers model: ``(input_ids,)`` + ``use_cache=False``;
    * a diffusers pipeline: ``("a cat",)`` + 2 steps, 32x32, ``output_type="np"`` and a CPU generator.

    Batch 2, text length 8.  Tensors are drawn from a private generator seeded with ``seed`` (the global
    RNG is untouched), then put on ``device`` (default: the model's) in ``dtype`` (floating inputs only;
    default: the float dtype that holds most of the model's weights, float32 for a name).
    """
    if isinstance(name_or_model, str):
        if name_or_model not in BUILTIN:
            raise ValueError(_unknown_builtin(name_or_model))
        kind = _BUILTIN_KINDS[name_or_model]
        config = SimpleNamespace(**_BUILTIN_CONFIGS.get(name_or_model, {}))
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
    if kind == "lm":
        vocab = _config_get(config, "vocab_size", 256)
        ids = torch.randint(0, vocab, (BATCH, TEXT_TOKENS), generator=generator).to(device)
        return (ids,), {"use_cache": False}
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
        model = resolve_model(model)
    args, kwargs = sample_inputs(model, seed)
    with torch.no_grad():
        return one_tensor(model(*args, **kwargs))


# --------------------------------------------------------------------------- --model SPEC

_FACTORY_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _unknown_builtin(name: str) -> str:
    close = difflib.get_close_matches(name, list(BUILTIN), n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (
        f"unknown built-in model '{name}'{hint}; built-ins: {', '.join(BUILTIN)}; "
        "or give a directory saved with save_pretrained, or package.module:factory"
    )


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith((".", "~"))


def resolve_model(spec: str) -> Any:
    """The model named by ``spec`` (the CLI's ``--model SPEC``), in eval mode.  Never reaches a hub.

    ``spec`` is, in this order of precedence:

    * a built-in name (:data:`BUILTIN`), built with seed 0 (write ``./unet`` for a directory of that name);
    * ``package.module:factory`` -- the module is imported (the current directory is searched too, as
      ``python -m`` would) and ``factory`` (a dotted attribute path) is called with no arguments; it must
      return an ``nn.Module`` or a diffusers pipeline;
    * a directory written by ``save_pretrained``: ``model_index.json`` -> a diffusers pipeline;
      ``config.json`` with ``_class_name`` -> that diffusers model class; ``config.json`` with
      ``architectures`` -> that transformers class.  Loaded with ``local_files_only=True`` and
      ``use_safetensors=True``.

    Anything else raises ``ValueError`` saying what was expected (with the built-in names and a
    close match for a mistyped name).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--model needs a built-in name, a directory or package.module:factory, not {spec!r}")
    if spec in BUILTIN:
        return BUILTIN[spec]()
    path = Path(spec).expanduser()
    if not path.exists() and _FACTORY_SPEC.match(spec):
        return _from_factory(spec)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"--model {spec}: {path} is a file; expected a directory saved with save_pretrained")
        return _from_directory(path)
    if _looks_like_path(spec):
        raise ValueError(f"--model {spec}: no such directory: {path}")
    raise ValueError(_unknown_builtin(spec))


def _eval(model: Any) -> Any:
    if isinstance(model, nn.Module):
        return model.eval()
    for component in model.components.values():
        if isinstance(component, nn.Module):
            component.eval()
    return model


def _import(module_name: str, spec: str):
    """Import ``module_name``; retry with the current directory on ``sys.path`` (for the installed CLI)."""
    try:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            cwd = os.getcwd()
            if error.name != module_name.split(".")[0] or cwd in sys.path or "" in sys.path:
                raise
            sys.path.insert(0, cwd)
            try:
                return importlib.import_module(module_name)
            finally:
                with contextlib.suppress(ValueError):
                    sys.path.remove(cwd)
    except ImportError as error:
        raise ValueError(f"--model {spec}: cannot import module '{module_name}': {error}") from error


def _from_factory(spec: str) -> Any:
    module_name, attribute_path = spec.split(":", 1)
    target: Any = _import(module_name, spec)
    for part in attribute_path.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"--model {spec}: '{module_name}' has no attribute '{attribute_path}'{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model {spec}: '{attribute_path}' is a {type(target).__name__}, not a callable factory")
    model = target()
    if not (isinstance(model, nn.Module) or isinstance(getattr(model, "components", None), dict)):
        raise ValueError(
            f"--model {spec}: the factory returned a {type(model).__name__}; "
            "expected a torch.nn.Module or a diffusers pipeline"
        )
    return _eval(model)


def _from_directory(path: Path) -> Any:
    load_kwargs = {"local_files_only": True, "use_safetensors": True}
    if (path / "model_index.json").is_file():
        from diffusers import DiffusionPipeline

        return _eval(_load(DiffusionPipeline, path, load_kwargs))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"--model {path}: not a model directory: no model_index.json (diffusers pipeline) "
            "or config.json (diffusers or transformers model)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {path}: cannot read {config_file}: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"--model {path}: {config_file} is not a JSON object")
    if (path / "transformdsl.json").is_file() or isinstance(config.get("quantization_config"), dict):
        from .persist.api import load  # our save in a library's layout, or a quantized checkpoint: our layers

        return load(path)
    if "_class_name" in config:
        import diffusers

        cls = getattr(diffusers, str(config["_class_name"]), None)
        library = "diffusers"
    elif config.get("architectures"):
        import transformers

        cls = getattr(transformers, str(config["architectures"][0]), None)
        library = "transformers"
    else:
        raise ValueError(
            f"--model {path}: {config_file} names neither a diffusers class ('_class_name') "
            "nor a transformers architecture ('architectures')"
        )
    if cls is None:
        name = config.get("_class_name") or config["architectures"][0]
        raise ValueError(f"--model {path}: {library} has no class '{name}' (named in {config_file})")
    return _eval(_load(cls, path, load_kwargs))


def _load(cls: Any, path: Path, load_kwargs: dict[str, Any]) -> Any:
    try:
        return cls.from_pretrained(str(path), **load_kwargs)
    except OSError as error:
        raise ValueError(f"--model {path}: cannot load it as {cls.__name__}: {error}") from error
