"""Imported once by the fork server of :mod:`measure`: everything a job imports lazily.

One-time process costs (imports, building the script parser) would otherwise land in the first
timed step of every job, seconds that neither side's transform really costs.  Only imports and
pure-Python set-up happen here, no tensor work: the server must fork cleanly (OpenMP state).
``BENCH_PRELOAD`` (comma-separated: bitsandbytes, hqq, torchao, compile) adds the backends the
planned jobs use.
"""

from __future__ import annotations

import gc
import importlib
import os

COMMON = (
    "torch", "safetensors.torch", "transformdsl", "transformdsl.executor", "transformdsl.persist",
    "transformdsl.models", "diffusers.models.transformers.transformer_flux",
    "diffusers.models.transformers.transformer_sd3", "diffusers.models.unets.unet_2d_condition",
    "diffusers.hooks", "transformers.models.llama.modeling_llama", "workloads", "comparisons", "measure",
)
BACKENDS = {
    "bitsandbytes": ("bitsandbytes",),
    "hqq": ("hqq.core.quantize",),
    "torchao": ("torchao.quantization",),
    "compile": ("torch._dynamo", "torch._inductor.compile_fx"),
}


def modules() -> list[str]:
    wanted = [name for name in os.environ.get("BENCH_PRELOAD", "").split(",") if name]
    return [*COMMON, *(m for name in wanted for m in BACKENDS.get(name, ()))]


def warm() -> None:
    for name in modules():
        importlib.import_module(name)
    import transformdsl

    transformdsl.parse("fuse qkv")  # builds the LALR parser once
    from transformdsl import registry

    registry.transforms()  # the passes' modules, which transform() and load() import on first use
    # Move the millions of objects the imports made out of the collector's sight: each
    # gc.collect() in a job would otherwise take half a second scanning them.
    gc.collect()
    gc.freeze()


warm()
