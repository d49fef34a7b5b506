"""``fuse bias_act_dropout|bias_dropout_residual|bias_dropout_residual_layernorm`` (implementation).

Replaces the elementwise chain that follows a linear layer with one fused function,
keeping the same parameters under the same state_dict keys.

How.  A matched module (diffusers ``FeedForward``, an MLP, BERT's ``SelfOutput``...) is
replaced by a *fused copy*: an instance of a subclass of its own class whose ``forward``
runs the projection's matmul without its bias, then one fused function (bias add,
activation, dropout, residual add, LayerNorm; compiled with inductor) for the rest.  The
copy shares the original's children (the same ``Linear`` objects and parameters), so its
state_dict is the original's key for key, in both directions, and the unfused path is
just the original class's ``forward`` (``super().forward``), taken when the global switch
is off:

>>> from transformdsl.transforms.elementwise import FUSED
>>> FUSED.set(False); FUSED.enabled
False
>>> FUSED.set(None)  # back to the default (TRANSFORMDSL_DISABLE_FUSED unset: on)

A chain is matched at a module boundary only: where the residual add sits inside a
block's ``forward`` (most diffusers and transformers blocks), fusing it would mean
rewriting that forward, so the plan lists the block as a near miss quoting the line.
Every match is checked at plan time by running the original and the fused formula on a
small probe input (eval mode): a forward that computes something else is a near miss too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from ...extend import ApplyContext, LoadError, TransformError
from ...selectors import select, topmost
from ...tree import ModuleInfo, ModuleTree, is_below
from ..common.modules import is_conv1d, put_module
from . import BiasActDropout as BiasActDropoutDeclaration
from . import BiasDropoutResidual as BiasDropoutResidualDeclaration
from . import BiasDropoutResidualLayerNorm as BiasDropoutResidualLayerNormDeclaration
from .patterns import PATTERNS, Mismatch, activation_kind, fused_class, fused_copy, is_fused, residual_line, verify

# --------------------------------------------------------------------------- the transforms


@dataclass(frozen=True)
class Chain:
    """One chain found at plan time."""

    path: str
    pattern: str
    spec: dict

    def describe(self) -> str:
        return PATTERNS[self.pattern].describe(self.spec)


class ElementwiseBehaviour:
    """What the three modes do (mixed into each declaration)."""

    #: Patterns this mode fuses, tried in order.
    patterns: ClassVar[tuple[str, ...]] = ()
    #: What the mode looks for, for near-miss messages.
    looks_for: ClassVar[str] = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._chains: dict[str, Chain] = {}
        #: Every path candidate() judged (matched or near miss), for notes().
        self._seen: set[str] = set()

    # -- matching (shared by planning and apply)

    def match(self, module: nn.Module, path: str) -> tuple[Chain | None, str | None]:
        """The chain at ``module`` (its own boundary), or the reason there is none."""
        if is_fused(type(module)):
            return None, "already fused by an earlier statement"
        if "forward" in module.__dict__:
            return None, "its forward is replaced on the instance (a hook?); fusing would bypass it"
        for name in self.patterns:
            pattern = PATTERNS[name]
            try:
                spec = pattern.match(module)
            except Mismatch as error:
                return None, str(error)
            if spec is not None:
                spec = self.adjust(spec)
                if isinstance(spec, str):
                    return None, spec
                return Chain(path, name, spec), None
        return None, self.no_chain_reason(module)

    @staticmethod
    def adjust(spec: dict) -> dict | str:
        """Mode-specific filtering of a spec: the spec to use, or a reason."""
        return spec

    def no_chain_reason(self, module: nn.Module) -> str:
        cls = type(module)
        line = residual_line(cls)
        if line:
            return (f"the residual add is inside {cls.__name__}.forward() (`{line}`), not at a module boundary; "
                    "fusing it needs that forward rewritten")
        return f"no {self.looks_for} at its boundary"

    # -- planning

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        self._seen.add(info.path)
        if info.module is None:
            if is_fused(info.cls):
                return "already fused by an earlier statement"
            return "replaced by an earlier statement; not inspectable at plan time"
        if info.path == "":
            return "the root module cannot be swapped for a fused copy; fuse the modules inside it"
        chain, reason = self.match(info.module, info.path)
        if chain is None:
            return reason
        if self.options.verify:
            reason = verify(info.module, PATTERNS[chain.pattern], chain.spec)
            if reason:
                return reason
        self._chains[info.path] = chain
        return None

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        groups: dict[str, list[str]] = {}
        for path in targets:
            groups.setdefault(self._chains[path].describe(), []).append(path)
        lines = [f"chain {text}: {len(paths)} × at {', '.join(paths)}" for text, paths in groups.items()]
        lines.extend(self.inline_near_misses(tree))
        if targets and self.options.kernel == "inductor":
            lines.append("kernel=inductor: each fused function compiles at its first call (seconds, once "
                         "per process and dtype)")
        return lines

    def inline_near_misses(self, tree: ModuleTree) -> list[str]:
        """Chains the default targets do not select because they are written inside a larger
        forward (a projection and an activation module that are siblings), listed as near misses."""
        return []

    def scope_roots(self, tree: ModuleTree) -> list[str]:
        """The statement's ``in`` scope (the whole component without one)."""
        if not self.statement.scope:
            return [""]
        return topmost([p for selector in self.statement.scope for p in select(selector, tree)])

    def plan_effect(self, tree: ModuleTree, targets: list[str]) -> None:
        for path in targets:
            tree.replace(path, fused_class(PATTERNS[self._chains[path].pattern], tree[path].cls))

    # -- execution

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        chains = []
        for path in ctx.progress(targets, total=len(targets), desc=self.key()):
            module = ctx.root.get_submodule(path)
            chain, reason = self.match(module, path)
            if chain is None:  # the model changed since it was planned
                raise TransformError(f"{path}: {reason} (the model changed after planning)")
            ctx.edit.replace(ctx.root, path, fused_copy(module, PATTERNS[chain.pattern], chain.spec,
                                                        self.options.kernel))
            chains.append({"path": path, "pattern": chain.pattern, "spec": chain.spec})
        return {"chains": chains, "kernel": self.options.kernel}

    @classmethod
    def export(cls, step, out) -> None:
        """The keys never changed: the library runs the unfused forward."""
        out.notes.append(f"{out.where(step)}: same keys as the original; {out.library} runs the unfused forward "
                         "(same outputs); transformdsl.load fuses again")

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: Any) -> None:
        """Swap the recorded modules of a skeleton for fused copies (no tensor is touched)."""
        for chain in record["chains"]:
            path = chain["path"]
            parent_path, _, name = path.rpartition(".")
            parent = root.get_submodule(parent_path) if parent_path else root
            # The recorded chain must be what the module is (a record cannot swap GELU for ReLU).
            try:
                found = PATTERNS[chain["pattern"]].match(parent._modules[name])
            except Mismatch as exc:
                found = f"no {chain['pattern']} chain ({exc})"
            if isinstance(found, dict):  # as apply saw it: the mode decides e.g. whether the norm is fused
                found = cls.adjust(found)
            if json.loads(json.dumps(found)) != chain["spec"]:
                raise LoadError(f"{cls.key()}: {path}: the record describes {chain['spec']!r}; the module is "
                                f"{found!r}")
            put_module(root, path, fused_copy(parent._modules[name], PATTERNS[chain["pattern"]], chain["spec"],
                                              record.get("kernel", "inductor")), cls.key())


class BiasActDropout(ElementwiseBehaviour, BiasActDropoutDeclaration):
    patterns = ("feedforward", "mlp", "gated_mlp")
    looks_for = "projection → activation (→ dropout)"

    def inline_near_misses(self, tree):
        roots = self.scope_roots(tree)
        groups: dict[str, list[str]] = {}
        for info in tree:
            if not info.path or not any(is_below(info.path, r) for r in roots):
                continue
            if any(is_below(info.path, seen) for seen in self._seen):
                continue  # a target, or inside one: already reported
            children = tree.children(info.path)
            projections = [c.name for c in children if issubclass(c.cls, nn.Linear) or is_conv1d(c.cls, c.module)]
            activations = [c.name for c in children
                           if "act" in c.name and c.module is not None and activation_kind(c.module)]
            if projections and activations:
                text = (f"{info.cls.__name__}: {', '.join(projections)} and {activations[0]} are called inside "
                        "its forward(), which does more than the chain; fusing needs that forward rewritten")
                groups.setdefault(text, []).append(info.path)
        return [f"near miss (not selected): {text}: {len(paths)} × at {', '.join(paths)}"
                for text, paths in groups.items()]


class BiasDropoutResidual(ElementwiseBehaviour, BiasDropoutResidualDeclaration):
    patterns = ("residual",)
    looks_for = "dense → dropout → residual add (forward(hidden_states, input_tensor))"

    @staticmethod
    def adjust(spec):
        return {**spec, "fuse_norm": False}


class BiasDropoutResidualLayerNorm(ElementwiseBehaviour, BiasDropoutResidualLayerNormDeclaration):
    patterns = ("residual",)
    looks_for = "dense → dropout → residual add → LayerNorm (forward(hidden_states, input_tensor))"

    @staticmethod
    def adjust(spec):
        if not spec["layernorm"]:
            return "no LayerNorm after the residual add; use 'fuse bias_dropout_residual'"
        return spec
