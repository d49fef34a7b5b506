"""The built-in tiny models: the real classes of diffusers and transformers from small configs, random weights.

diffusers and transformers are imported inside the factories; importing this module imports neither.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

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

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "unet": UNET_CONFIG,
    "sd3": SD3_CONFIG,
    "flux": FLUX_CONFIG,
    "llama": LLAMA_CONFIG,
    "gpt2": GPT2_CONFIG,
}


def unknown_builtin(name: str) -> str:
    close = difflib.get_close_matches(name, list(BUILTIN), n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (
        f"unknown built-in model '{name}'{hint}; built-ins: {', '.join(BUILTIN)}; "
        "or give a directory saved with save_pretrained, or package.module:factory"
    )
