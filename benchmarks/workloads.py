"""The models the comparison runs on: architectures, sizes, inputs, outputs.

A workload is one architecture at one size.  ``tiny`` is the project's built-in model
(``transformdsl.models.BUILTIN``); the larger sizes are configs of the same classes with
realistic widths and few layers, so that they fit 24 GB and a few minutes on 2 cores.

Every measurement reads its model the way a user does, with ``from_pretrained`` from a
directory that :func:`prepare` wrote once (random weights, seed 0): both sides of a
comparison start from the same bytes, and "transform again" has a real reading cost.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

WORK = Path(__file__).resolve().parent / "_work"
#: A local torchao (``pip install --no-deps --target benchmarks/_work/torchao-site torchao==0.18.0``),
#: put on the path only by the benchmark scripts: installed in the project's environment,
#: diffusers would import it (and torch._dynamo) on every import, seconds for every test run.
TORCHAO_SITE = WORK / "torchao-site"


@dataclass(frozen=True)
class Workload:
    """One architecture (``family``, a built-in name) at one size; ``config`` None = the built-in."""

    family: str            # flux | sd3 | unet | llama
    size: str              # tiny | large | a scaling label
    config: dict | None = field(default=None, hash=False, compare=False)

    @property
    def key(self) -> str:
        return f"{self.family}-{self.size}"


def flux_config(heads: int, double: int = 1, single: int = 1) -> dict:
    """Flux with heads of 128 like FLUX.1 (24 heads = its width, 3072) and few blocks."""
    return dict(num_layers=double, num_single_layers=single, attention_head_dim=128, num_attention_heads=heads,
                joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64, axes_dims_rope=(16, 56, 56))


#: Llama at the width of Llama-3.2-3B (3072, grouped-query 24/8 heads), two layers, 32k vocabulary.
LLAMA_LARGE = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=24,
                   num_key_value_heads=8, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)

#: diffusers class (or transformers) per family.
CLASSES = {"flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel", "unet": "UNet2DConditionModel",
           "llama": "LlamaForCausalLM"}


def tiny(family: str) -> Workload:
    return Workload(family, "tiny")


def flux(size: str, heads: int) -> Workload:
    return Workload("flux", size, flux_config(heads))


def llama(size: str, config: dict) -> Workload:
    return Workload("llama", size, config)


def model_class(family: str):
    if family == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM
    import diffusers

    return getattr(diffusers, CLASSES[family])


def build(workload: Workload) -> torch.nn.Module:
    """A new model with random weights (seed 0): the built-in one for ``tiny``."""
    from transformdsl.models import BUILTIN
    from transformdsl.models.builtin import LLM_ATTENTION

    if workload.config is None:
        return BUILTIN[workload.family]()
    torch.manual_seed(0)
    cls = model_class(workload.family)
    if workload.family == "llama":
        from transformers import LlamaConfig

        return cls(LlamaConfig(**workload.config, attn_implementation=LLM_ATTENTION)).eval()
    return cls(**workload.config).eval()


def directory(workload: Workload, dtype: torch.dtype = torch.float32) -> Path:
    """Where :func:`prepare` saves the workload (in ``dtype``); the name changes when the config does."""
    from transformdsl import models

    config = workload.config or getattr(models, f"{workload.family.upper()}_CONFIG", None)
    digest = hashlib.sha1(json.dumps([workload.family, config], sort_keys=True, default=str).encode()).hexdigest()
    suffix = "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
    return WORK / "models" / f"{workload.key}-{digest[:8]}{suffix}"


def prepare(workload: Workload, dtype: torch.dtype = torch.float32) -> Path:
    """Save the workload's model (``save_pretrained``, safetensors) once; return the directory.

    In another ``dtype`` than float32 it is the float32 checkpoint cast (``model.to(dtype)``),
    saved in that dtype: what a user of a bf16 model (FLUX.1-dev, Llama) downloads.
    """
    path = directory(workload, dtype)
    if not (path / "done").exists():
        model = build(workload) if dtype == torch.float32 else read(workload).to(dtype)
        model.save_pretrained(path, safe_serialization=True)
        (path / "done").write_text("")
    return path


def read(workload: Workload, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model as a user gets it: ``from_pretrained`` on the saved directory, eval.

    Read in the dtype it was saved in, safetensors memory-maps the file and the parameters keep
    those pages (nothing is copied): the way a bf16 checkpoint reaches a bf16 job.
    """
    cls = model_class(workload.family)
    return cls.from_pretrained(directory(workload, dtype), torch_dtype=dtype).eval()


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sample(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> tuple[tuple, dict]:
    """The built-in sample input (``transformdsl.models.sample_inputs``, seed 0) in ``dtype``.

    Shapes come from the model's config: batch 2, 8 text tokens, a 4x4 latent grid; so the
    larger models run the same number of tokens as the tiny ones.
    """
    from transformdsl.models import sample_inputs

    return sample_inputs(model, 0, dtype=dtype)


def reference(workload: Workload, model: torch.nn.Module) -> torch.Tensor:
    """The original fp32 model's output on :func:`sample`: computed by the first job that needs
    it and kept beside the weights, so that the other jobs do not pay a forward for it."""
    path = directory(workload) / "reference.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    with torch.inference_mode():
        output = forward(model, sample(model)).clone()
    torch.save(output, path)
    return output


def forward(model, inputs: tuple[tuple, dict]) -> torch.Tensor:
    """The model's main output tensor (latent prediction or logits)."""
    args, kwargs = inputs
    out = model(*args, **kwargs)
    for name in ("logits", "sample"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out[0] if isinstance(out, (tuple, list)) else out
