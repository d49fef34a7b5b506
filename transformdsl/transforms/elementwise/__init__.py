"""``fuse bias_act_dropout|bias_dropout_residual|bias_dropout_residual_layernorm`` (declarations).

Replaces the elementwise chain that follows a linear layer with one fused function, keeping the same
parameters under the same state_dict keys.  The implementation: :mod:`.patterns` (the chains it
recognises and the fused copies), :mod:`.kernels` (the fused functions) and :mod:`.apply`.

The runtime switch :data:`FUSED` turns every fused module's fast path off (it then runs its
original class's ``forward``: the unfused computation, same parameters), for debugging:

>>> with FUSED.turned(False):
...     FUSED.enabled
False
"""

from __future__ import annotations

from dataclasses import dataclass

from ...extend import Transform, option
from ...switches import Switch

#: How the fused functions run.
KERNELS = ("inductor", "eager")

#: Off: fused modules run their original, unfused ``forward``.  ``TRANSFORMDSL_DISABLE_FUSED=1`` (or
#: true/yes/on) starts every process with it off.
FUSED = Switch("fuse.fused", "fused modules take their fused path", default=True,
               environment="TRANSFORMDSL_DISABLE_FUSED", when_set=False)


@dataclass(frozen=True)
class ElementwiseOptions:
    kernel: str = option("inductor", "how the fused function runs: inductor (torch.compile, compiled at the "
                         "first call) or eager (plain PyTorch, no compiler)", choices=KERNELS)
    verify: bool = option(True, "at plan time, check each match against its forward on a probe input")


class Elementwise(Transform):
    verb = "fuse"
    runs_after = ("fuse qkv",)
    runs_before = ("quantize *", "fp8 *")
    changes_weights = False
    Options = ElementwiseOptions
    switches = (FUSED,)


class BiasActDropout(Elementwise):
    mode = "bias_act_dropout"
    summary = "fuse bias + activation + dropout after a projection"
    default_target = ("FeedForward", "*MLP", "*Intermediate")
    implementation = ".apply:BiasActDropout"


class BiasDropoutResidual(Elementwise):
    mode = "bias_dropout_residual"
    summary = "fuse bias + dropout + residual add"
    default_target = ("*Block", "*Layer", "*Output")
    implementation = ".apply:BiasDropoutResidual"


class BiasDropoutResidualLayerNorm(Elementwise):
    mode = "bias_dropout_residual_layernorm"
    summary = "fuse bias + dropout + residual add + layernorm"
    default_target = ("*Block", "*Layer", "*Output")
    implementation = ".apply:BiasDropoutResidualLayerNorm"
