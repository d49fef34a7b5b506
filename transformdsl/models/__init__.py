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
imports neither.  One module per job: :mod:`.builtin` (the models), :mod:`.inputs` (their sample
inputs, and a run), :mod:`.resolve` (``--model SPEC``).  This package is a front door: it re-exports
all three, and :mod:`.resolve` loads directories through :func:`transformdsl.load`, so the rest of the
library (the verification of ``transform(..., verify=True)``) imports :mod:`.builtin` and :mod:`.inputs`
directly, never this package (``tools/imports.py`` LAYERS).
"""

from __future__ import annotations

from .builtin import (
    BUILTIN,
    FLUX_CONFIG,
    GPT2_CONFIG,
    LLAMA_CONFIG,
    SD3_CONFIG,
    UNET_CONFIG,
    tiny_clip_tokenizer,
    tiny_flux,
    tiny_gpt2,
    tiny_llama,
    tiny_sd3,
    tiny_sd_pipeline,
    tiny_unet,
)
from .inputs import SAMPLE_KINDS, one_tensor, run, sample_inputs, sample_inputs_problem

__all__ = [
    "BUILTIN",
    "UNET_CONFIG",
    "SD3_CONFIG",
    "FLUX_CONFIG",
    "LLAMA_CONFIG",
    "GPT2_CONFIG",
    "tiny_unet",
    "tiny_sd3",
    "tiny_flux",
    "tiny_llama",
    "tiny_gpt2",
    "tiny_sd_pipeline",
    "tiny_clip_tokenizer",
    "sample_inputs",
    "sample_inputs_problem",
    "SAMPLE_KINDS",
    "run",
    "one_tensor",
    "resolve_model",
]


def __getattr__(name: str):
    """:func:`resolve_model`, imported on first access: importing :mod:`.builtin` or :mod:`.inputs` runs this
    ``__init__`` first, and must not import the loaders :mod:`.resolve` stands on."""
    if name != "resolve_model":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .resolve import resolve_model

    globals()[name] = resolve_model
    return resolve_model
