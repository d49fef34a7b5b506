"""``lora "PATH"``: a LoRA from a safetensors file, merged into the weights or kept switchable (declaration).

``merge=true`` (the default) folds ``scale * alpha/rank * B @ A`` into the float weights *before* any
statement that changes the weight format or layout (``fuse *``, ``quantize *``, ``fp8 *``), so a fused
``to_qkv`` gets the delta of its three parts in its rows and a quantized layer quantizes the merged
weight, whatever order the lines are written in.  ``merge=false`` keeps the adapter beside the layer,
*after* those statements (QLoRA-style: beside a quantized, fp8 or fused layer, the parts' adapters on
the fused layer's rows), switchable at run time with :func:`transformdsl.set_lora`.

The implementation: :mod:`.files` (the file's checks: a bounded, regular safetensors file, header
only, no pickle), :mod:`.keys` (key formats, through diffusers' and PEFT's converters),
:mod:`.layers` (the adapters and the fused-slice maths), :mod:`.apply` (planning, merging, reload)
and :mod:`.runtime` (:func:`transformdsl.set_lora`, :func:`transformdsl.lora_adapters`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...extend import Transform, option

#: Statements that change the weights' format or layout: a merged LoRA runs before them (into the
#: float weights), a switchable one after them (beside the layers they leave).
WEIGHT_FORMAT = ("fuse *", "quantize *", "fp8 *")


#: The largest alpha a LoRA may have, in its file or as ``alpha=`` (an alpha is of its rank's order, 1 to a few
#: hundred; ``alpha=1e38`` gives finite weights that overflow at the first matmul).
MAX_ALPHA = 1e6

#: Why ``quantize``/``fp8`` leave a layer that holds switchable adapters alone (they would drop them).
HOLDS_ADAPTERS = ("holds switchable LoRA adapters (lora ... merge=false); change its weight format in the script "
                  "that adds them, which puts them beside the new layer")
#: The class name every layer holding switchable adapters has among its bases (``layers.LoraLayerMixin``).
ADAPTER_CLASS = "LoraLayerMixin"


def file_name(path: str) -> str:
    """A path's last part (``loras/style.safetensors`` → ``style.safetensors``), ``/`` or ``\\`` separated."""
    return path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class LoraOptions:
    scale: float = option(1.0, "multiplier of the LoRA's delta (on top of its alpha / rank)", min=-100.0, max=100.0)
    name: str = option("", "the adapter's name (default: the file name without its extension)")
    merge: bool = option(True, "fold the delta into the float weights (true), or keep the adapter beside each "
                         "layer, switchable at run time (false)")
    alpha: float = option(0.0, "LoRA alpha for a file that stores none (PEFT keeps it in adapter_config.json's "
                          "lora_alpha); 0: the file's own, else each module's rank (alpha / rank = 1)", min=0.0,
                          max=MAX_ALPHA)
    unmatched: str = option("error", "LoRA keys that name no module of the model: an error (listing the nearest "
                            "module names), or ignore them (listed in the plan)", choices=("error", "ignore"))

    def __post_init__(self):
        if self.name and not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(f"name={self.name!r}: an adapter name is letters, digits, '_' and '-' (it is a "
                             "state_dict key in the save)")


class Lora(Transform):
    verb = "lora"
    summary = "apply a LoRA from a safetensors file: merged into the weights, or switchable (merge=false)"
    Options = LoraOptions
    argument = 'the LoRA file (a .safetensors path, quoted)|lora "loras/style.safetensors" scale=0.8'
    #: The modules the file names (within the ``in`` clause's): the root, which the plan resolves.
    default_target = None
    #: A LoRA changes what the model computes by design: no bound on the output's change.
    error_bound = None
    record_version = 1
    implementation = ".apply:Lora"

    @property
    def runs_before(self) -> tuple[str, ...]:  # depends on the options (validate._rule_key)
        return (*WEIGHT_FORMAT, "compile*") if self.options.merge else ("compile*",)

    @property
    def runs_after(self) -> tuple[str, ...]:
        return () if self.options.merge else WEIGHT_FORMAT

    def recorded_argument(self) -> str:
        """The file's name: a save records it and the file's SHA-256, never the directories above it."""
        return file_name(self.statement.argument.text)

    @property
    def adapter_name(self) -> str:
        """The adapter's name: ``name=``, else the file name without its extension."""
        if self.options.name:
            return self.options.name
        stem = file_name(self.statement.argument.text) if self.statement.argument else "lora"
        stem = stem.rsplit(".", 1)[0] if "." in stem else stem
        return "".join(c if c.isalnum() or c in "_-" else "_" for c in stem) or "lora"

    def incompatible(self, other: Transform) -> str | None:
        if other.verb != "lora" or other is self or other.statement.line < self.statement.line:
            return None
        same_file = os.path.normpath(other.statement.argument.text) == os.path.normpath(self.statement.argument.text)
        if same_file and other.common.component == self.common.component and self.options.merge \
                and other.options.merge:
            # Two merged LoRAs for one layer both add their deltas (script order); the same file twice is
            # almost always a copy-paste slip that doubles it, and a scale says it on purpose.
            return (f"the same LoRA file twice, merged: its delta would be added twice; keep one statement "
                    f"(scale={self.options.scale + other.options.scale:g} on it, if the sum is meant)")
        if other.adapter_name == self.adapter_name and other.common.component == self.common.component \
                and not self.options.merge and not other.options.merge:  # merged LoRAs leave no adapter
            return (f"two LoRAs named '{self.adapter_name}'; give one another name (name=...) so that "
                    "set_lora can tell them apart")
        return None
