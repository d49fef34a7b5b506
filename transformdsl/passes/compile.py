"""``compile`` and ``compile regional``: torch.compile, whole-model or per block."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import option
from ..registry import register
from .base import Transform

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    fullgraph: bool = option(False, "fail on graph breaks instead of falling back to Python")
    mode: str = option("default", "torch.compile mode", choices=MODES)
    dynamic: str = option("auto", "dynamic shapes: auto, true or false", choices=("auto", "true", "false"))
    backend: str = option("inductor", "torch.compile backend", choices=("inductor", "eager", "aot_eager"))


class _Compile(Transform):
    verb = "compile"
    Options = CompileOptions
    default_target = None
    runs_after = ("*",)
    changes_weights = False

    def incompatible(self, other):
        if other.verb == "compile" and other is not self:
            return "a model is compiled once; keep one compile statement"
        return None


@register
class WholeCompile(_Compile):
    summary = "torch.compile the denoiser (or the model)"


@register
class RegionalCompile(_Compile):
    mode = "regional"
    summary = "torch.compile each selected block; repeated blocks share one graph"
    requires_scope = True
