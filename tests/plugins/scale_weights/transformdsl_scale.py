"""A transformdsl plugin in one file: ``scale weights factor=F`` multiplies Linear outputs by F.

Installed with pip, it is found through the entry point ``transformdsl.transforms`` (pyproject.toml):
``transformdsl check`` validates it without importing torch (torch is imported inside the methods),
and ``transform``/``save``/``load`` run it like a built-in transform.  It imports ``transformdsl.extend``
only: the API the built-in transforms are written against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from transformdsl.extend import ApplyContext, LoadError, Transform, TransformError, option, put_module


@dataclass(frozen=True)
class ScaleOptions:
    factor: float = option(2.0, "what each selected Linear's output is multiplied by", min=0.0)
    learnable: bool = option(False, "keep the factor as a trainable parameter (needs factor > 0)")

    def __post_init__(self):  # a rule across fields: `check` runs it
        if self.learnable and self.factor == 0:
            raise ValueError("learnable=true needs factor > 0; a zero factor learns nothing")


@functools.cache
def scaled_linear_class():
    """The layer, defined on first use so that importing this module imports no torch."""
    import torch
    from torch import nn

    class ScaledLinear(nn.Module):
        """``linear(x) * factor``: the original Linear as a child, the factor as a buffer."""

        def __init__(self, linear: nn.Module, factor: torch.Tensor):
            super().__init__()
            self.linear = linear
            self.register_buffer("factor", factor)

        def forward(self, x):
            return self.linear(x) * self.factor

    return ScaledLinear


class ScaleWeights(Transform):
    verb = "scale"
    mode = "weights"
    summary = "multiply each selected Linear's output by a factor"
    Options = ScaleOptions
    default_target = ("Linear",)
    default_except = ("lm_head",)
    runs_before = ("quantize *", "fp8 *")   # the factor is folded in before weights change format
    exclusive = "weights"                    # two statements of this group may not touch one module
    error_bound = None                       # it changes the output on purpose
    requires_api = 1                         # the transformdsl.extend API_VERSION it is written against

    #: Set by finalize() on load: tests read it to see that the loader called it.
    finalized: list = []

    def incompatible(self, other):
        # A rule that depends on both statements' options: e4m3 holds at most 448.
        if other.key() == "fp8 storage" and self.options.factor > 448:
            return (f"factor={self.options.factor:g} would overflow fp8 storage's float8 range (448); "
                    "use a factor <= 448")
        return None

    def candidate(self, info, tree):
        return None if info.cls.__name__ == "Linear" else "not a Linear"

    def plan_effect(self, tree, targets):
        # What apply() will do, on the planning snapshot: each Linear gets a child `linear` (the original),
        # so a later statement selects it there.  The wrapper keeps the Linear's class in the snapshot:
        # a later statement of the "weights" group that selects it too is a conflict on that path.
        for path in targets:
            info = tree[path]
            tree.add(f"{path}.linear", info.cls, own_bytes=info.own_bytes, after=path, **info.facts)
            tree.replace(path, info.cls, own_bytes=0)

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        import torch

        cls = scaled_linear_class()
        for path in targets:
            old = ctx.root.get_submodule(path)
            if old.weight.is_meta:
                raise TransformError(f"{path}: its weight is not loaded")
            factor = torch.tensor(self.options.factor, dtype=old.weight.dtype)
            ctx.edit.replace(ctx.root, path, cls(old, factor))
        return {"layers": list(targets)}

    @classmethod
    def rebuild(cls, root, record, options) -> None:
        import torch

        layer_class = scaled_linear_class()
        for path in record.get("layers", []):
            try:
                old = root.get_submodule(path)
            except AttributeError:
                raise LoadError(f"scale weights: the model has no module {path!r}") from None
            factor = torch.empty((), dtype=old.weight.dtype, device="meta")
            put_module(root, path, layer_class(old, factor), cls.key())  # on a skeleton: nothing to undo

    @classmethod
    def finalize(cls, root, record, options) -> None:
        cls.finalized.append(len(record.get("layers", [])))
