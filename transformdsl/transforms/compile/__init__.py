"""``compile`` and ``compile regional``: torch.compile, whole-model or per block (declarations).

Both compile in place with ``nn.Module.compile``: the module object, its class, its state_dict keys
and the pipeline holding it stay the same.  Compiled artefacts are not portable, so nothing compiled
is saved: ``load()`` compiles again (:mod:`.run`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...extend import RuntimeTransform, option

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    fullgraph: bool = option(False, "fail on graph breaks instead of falling back to Python")
    mode: str = option("default", "torch.compile mode", choices=MODES)
    dynamic: str = option("auto", "dynamic shapes: auto, true or false", choices=("auto", "true", "false"))
    backend: str = option("inductor", "torch.compile backend", choices=("inductor", "eager", "aot_eager"))
    kv_cache: str = option("dynamic", "static: generate() runs its decode step compiled on a fixed-size KV cache "
                           "(a transformers LM)", choices=("dynamic", "static"))


class Compile(RuntimeTransform):
    verb = "compile"
    Options = CompileOptions
    default_target = None
    runs_after = ("*",)

    def incompatible(self, other):
        if other.verb == "compile" and other is not self:
            return "a model is compiled once; keep one compile statement"
        return None


class WholeCompile(Compile):
    summary = "torch.compile the denoiser (or the model)"
    implementation = ".run:WholeCompile"


class RegionalCompile(Compile):
    mode = "regional"
    summary = "torch.compile each selected block; repeated blocks share one graph"
    requires_scope = True
    implementation = ".run:RegionalCompile"
