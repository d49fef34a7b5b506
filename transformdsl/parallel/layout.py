"""A model's tensor-parallel plan resolved into one :class:`Placement` per layer, or refused.

The plan is transformers' (``model.tp_plan``: the config's ``base_model_tp_plan`` plus the model's
own, e.g. Llama's ``q/k/v_proj`` and ``gate/up_proj`` ``"colwise"``, ``o_proj`` and ``down_proj``
``"rowwise"``, ``embed_tokens`` ``"embedding_rowwise"``, ``lm_head`` ``"colwise_gather_output"``),
with ``*`` standing for a layer number, optionally overridden by a dict of ``{module pattern: style}``
(transformers' meaning of ``tp_plan={...}``: the model's plan updated with it).  A transformed
layer is placed the way the plan places the float layer it replaced.  A fused ``qkv_proj`` (``fuse
qkv``) replaces three column-parallel projections: each rank keeps its heads of each of q, k and v
(three row ranges), never a contiguous third of the fused weight.

Nothing here needs a process group: :func:`describe` answers for any world size in one process.
Every problem is collected before the first is raised, and the :class:`LoadError` lists them all,
each naming the layer and what would work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..errors import LoadError
from .shards import EMBEDDING_KINDS, LINEAR_KINDS, Ranges, layer_class

#: transformers' styles that transformdsl applies: style -> (axis, gather the output, slice the input).
STYLES: dict[str, tuple[str, bool, bool]] = {
    "colwise": ("rows", False, False),
    "colwise_gather_output": ("rows", True, False),
    "colwise_rep": ("rows", True, False),
    "rowwise": ("columns", False, False),
    "rowwise_rep": ("columns", False, True),
    "rowwise_split_input": ("columns", False, True),
    "embedding_rowwise": ("vocabulary", False, False),
    "replicate": ("replicated", False, False),
}
#: The projections a fused ``qkv_proj`` replaced, in the order of its rows.
FUSED_SOURCES = ("q_proj", "k_proj", "v_proj")
#: Children of an attention module whose features come in heads of ``head_dim``.
HEAD_PROJECTIONS = (*FUSED_SOURCES, "o_proj", "qkv_proj")
#: Modules of classes from these packages keep a layout of their own: never cut.
OPAQUE_PACKAGES = {"bitsandbytes": "bitsandbytes", "hqq": "hqq"}
#: Our classes wrapping those packages' layers (transformdsl.transforms.quantize.layers).
OPAQUE_CLASSES = {"Int8Linear": "bitsandbytes int8", "FourBitLinear": "bitsandbytes 4-bit", "HQQLayer": "hqq"}
#: Kernel rules a shard must still meet: int4's packed kernels take out_features in multiples of 16,
#: int8 matmul kernels (torch._int_mm on CUDA) multiples of 8.
INT4_OUT_MULTIPLE, W8A8_MULTIPLE = 16, 8
#: int4 group sizes (:data:`transformdsl.transforms.quantize.INT4_GROUP_SIZES`), for the hint.
INT4_GROUPS = (32, 64, 128, 256)


@dataclass(frozen=True)
class Placement:
    """How one layer is placed on one rank of ``world`` ranks."""

    path: str
    style: str
    #: ``"rows"`` (column-parallel), ``"columns"`` (row-parallel), ``"vocabulary"`` or ``"replicated"``
    axis: str
    kind: str
    #: this rank's features along ``axis`` (several ranges for a fused q|k|v: one per projection)
    ranges: Ranges
    #: the layer's features along ``axis``
    size: int
    rank: int
    world: int
    #: a fused q|k|v: this rank's out_features of each of q, k and v (the attention's ``qkv_split``)
    fused_split: tuple[int, ...] | None = None
    gather: bool = False
    split_input: bool = False

    def describe(self) -> str:
        """One line for the plan: style, kind, and this rank's share."""
        if self.axis == "replicated":
            return f"{self.path}: replicated ({self.kind})"
        shares = ", ".join(f"{a}:{b}" for a, b in self.ranges)
        what = {"rows": "output features", "columns": "input features", "vocabulary": "rows"}[self.axis]
        fused = " (fused q|k|v: this rank's heads of each)" if self.fused_split else ""
        return (f"{self.path}: {self.style}, {self.kind}, {what} {shares} of {self.size} on rank "
                f"{self.rank} of {self.world}{fused}")


#: Layers named per refusal in a LoadError (the others counted).
MAX_NAMED = 4


@dataclass
class _Problems:
    """Refusals by reason, each with the layers it concerns (one reason per kind of layer, not per block)."""

    items: dict[str, list[str]] = field(default_factory=dict)

    def add(self, path: str, reason: str) -> None:
        self.items.setdefault(reason, []).append(path)

    def message(self, world: int) -> str:
        parts = []
        for reason, paths in self.items.items():
            named = ", ".join(paths[:MAX_NAMED]) + (f" and {len(paths) - MAX_NAMED} more" if len(paths) > MAX_NAMED
                                                     else "")
            parts.append(f"{named}: {reason}")
        return f"load(tp_plan=...) over {world} ranks: " + "; ".join(parts)


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan (transformers' ``model.tp_plan``), or ``{}``."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def requested_plan(model: nn.Module, tp_plan: str | dict) -> dict[str, str]:
    """``"auto"``: the model's plan; a dict: the model's plan updated with it (keys must name modules)."""
    own = model_plan(model)
    if tp_plan == "auto":
        if not own:
            raise LoadError(f"load(tp_plan='auto'): {type(model).__name__} has no tensor-parallel plan (transformers "
                            "models declare one as base_model_tp_plan); give one: tp_plan={'module.pattern': "
                            "'colwise' | 'rowwise' | ...}")
        return own
    if not isinstance(tp_plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items()):
        raise LoadError(f"load(tp_plan={tp_plan!r}): give 'auto' or a dict {{module pattern: style}}")
    names = [name for name, _ in model.named_modules()]
    unknown = [key for key in tp_plan if key not in own and not any(_pattern(key).fullmatch(n) for n in names)]
    if unknown:
        raise LoadError(f"load(tp_plan=...): {', '.join(map(repr, unknown))} match no module of "
                        f"{type(model).__name__} (a '*' stands for a layer number)")
    return own | tp_plan


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def describe(model: nn.Module, world: int, tp_plan: str | dict = "auto", rank: int = 0) -> list[Placement]:
    """Every layer's placement on ``rank`` of ``world`` ranks, in plan order; a :class:`LoadError`
    listing every layer that cannot be sharded (and what would work) otherwise."""
    plan = requested_plan(model, tp_plan)
    modules = dict(model.named_modules())
    problems = _Problems()
    placements: list[Placement] = []
    fused: dict[str, dict[str, str]] = {}
    for key, style in plan.items():
        if style not in STYLES:
            problems.add(key, f"tp_plan style {style!r} is not one transformdsl shards with (it applies "
                         f"{', '.join(STYLES)}); override it (tp_plan={{{key!r}: 'replicate'}} with the layers it "
                         "pairs with) or load without tp_plan")
            continue
        rx = _pattern(key)
        matched = [name for name in modules if rx.fullmatch(name)]
        parent_key, _, leaf = key.rpartition(".")
        if not matched and leaf in FUSED_SOURCES:
            parent_rx = _pattern(parent_key)
            for name, module in modules.items():
                if parent_rx.fullmatch(name) and _fused_attention(module):
                    fused.setdefault(name, {})[leaf] = style
        for name in matched:
            placement = _place(name, modules[name], _parent(modules, name), style, rank, world, problems)
            if placement is not None:
                placements.append(placement)
    for name, styles in fused.items():
        placement = _place_fused(name, modules[name], styles, rank, world, problems)
        if placement is not None:
            placements.append(placement)
    if problems.items:
        raise LoadError(problems.message(world))
    return placements


def _parent(modules: dict[str, nn.Module], name: str) -> nn.Module | None:
    return modules.get(name.rpartition(".")[0]) if "." in name else modules.get("")


def _fused_attention(module: nn.Module) -> bool:
    return isinstance(getattr(module, "qkv_split", None), tuple) and isinstance(
        getattr(module, "qkv_proj", None), nn.Module)


def _kind(path: str, module: nn.Module, axis: str, problems: _Problems) -> str | None:
    cls = layer_class(module)
    lora = " + switchable LoRA" if cls is not type(module) else ""
    package = cls.__module__.partition(".")[0]
    opaque = OPAQUE_PACKAGES.get(package) or (
        OPAQUE_CLASSES.get(cls.__name__) if cls.__module__.endswith("transforms.quantize.layers") else None)
    if opaque:
        problems.add(path, f"{cls.__name__} ({opaque}) keeps that library's own packed layout, which cannot be "
                     "cut into shards: quantize it with 'quantize int8 weight_only=true', 'quantize int4' or "
                     "'quantize w8a8' (they shard), or load without tp_plan")
        return None
    kinds = EMBEDDING_KINDS if axis == "vocabulary" else LINEAR_KINDS
    if axis == "replicated":
        return (LINEAR_KINDS.get(cls) or EMBEDDING_KINDS.get(cls) or cls.__name__) + lora
    if cls not in kinds or (lora and axis == "vocabulary"):
        shardable = "nn.Embedding, fp8 embeddings" if axis == "vocabulary" else (
            "nn.Linear, weight-only int8, w8a8, int4 and fp8 linear layers")
        problems.add(path, f"{cls.__name__} has no tensor-parallel shard in transformdsl (it shards {shardable}); "
                     "load without tp_plan, or replicate it and the layers it pairs with (tp_plan={...: "
                     "'replicate'})")
        return None
    return kinds[cls] + lora


def _even(path: str, size: int, world: int, what: str, problems: _Problems) -> bool:
    if size % world:
        problems.add(path, f"its {size} {what} do not split evenly over {world} ranks: use a number of ranks "
                     "that divides it, or load without tp_plan")
        return False
    return True


def _heads(path: str, parts: tuple[int, ...], parent: nn.Module | None, world: int, problems: _Problems) -> bool:
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return True
    for size in parts:
        heads, rest = divmod(size, head_dim)
        if rest == 0 and heads % world:
            problems.add(path, f"its {heads} heads (of {head_dim}) do not split over {world} ranks: use a number "
                         f"of ranks that divides every projection's heads, or load without tp_plan")
            return False
    return True


def _ranges(parts: tuple[int, ...], rank: int, world: int) -> Ranges:
    out, offset = [], 0
    for size in parts:
        share = size // world
        out.append((offset + share * rank, offset + share * (rank + 1)))
        offset += size
    return tuple(out)


def _heads_read_from_the_module(path: str, parent: nn.Module | None, problems: _Problems) -> bool:
    """Whether ``parent`` is an attention that reads its number of heads from an attribute (diffusers'
    ``Attention``: its processors split q, k, v into ``attn.heads`` heads), where a sharded projection
    would cut every head's features instead of the heads: a wrong result with no error.  Said."""
    if parent is None or not type(parent).__module__.startswith("diffusers.") or not isinstance(
            getattr(parent, "heads", None), int):
        return False
    problems.add(path, f"{type(parent).__name__} splits its projections into attn.heads={parent.heads} heads "
                 "whatever their width, so a shard would split each head's features instead of the heads (a wrong "
                 "result, no error); replicate its projections (tp_plan={...: 'replicate'}) and shard the "
                 "feed-forward layers, or load without tp_plan")
    return True


def _place(path: str, module: nn.Module, parent: nn.Module | None, style: str, rank: int, world: int,
           problems: _Problems) -> Placement | None:
    axis, gather, split_input = STYLES[style]
    kind = _kind(path, module, axis, problems)
    if kind is None:
        return None
    if axis in ("rows", "columns") and _heads_read_from_the_module(path, parent, problems):
        return None
    if axis == "replicated":
        return Placement(path, style, axis, kind, (), 0, rank, world)
    if axis == "vocabulary":
        size = module.num_embeddings
        if not _even(path, size, world, "embedding rows", problems):
            return None
        return Placement(path, style, axis, kind, _ranges((size,), rank, world), size, rank, world)
    size = module.out_features if axis == "rows" else module.in_features
    what = "output features" if axis == "rows" else "input features"
    if not _even(path, size, world, what, problems):
        return None
    leaf = path.rpartition(".")[2]
    if leaf in HEAD_PROJECTIONS and not _heads(path, (size,), parent, world, problems):
        return None
    if not _fits_kernels(path, module, kind, axis, size // world, problems):
        return None
    return Placement(path, style, axis, kind, _ranges((size,), rank, world), size, rank, world,
                     gather=gather, split_input=split_input)


def _place_fused(path: str, attention: nn.Module, styles: dict[str, str], rank: int, world: int,
                 problems: _Problems) -> Placement | None:
    fused_path = f"{path}.qkv_proj"
    chosen = {styles.get(name) for name in FUSED_SOURCES}
    if chosen == {"replicate"}:
        return Placement(fused_path, "replicate", "replicated", "fused q|k|v", (), 0, rank, world)
    if chosen != {"colwise"}:
        problems.add(fused_path, f"fused q|k|v, but the plan places {', '.join(FUSED_SOURCES)} as "
                     f"{', '.join(str(styles.get(n)) for n in FUSED_SOURCES)}; a fused projection shards only when "
                     "all three are 'colwise' (or all 'replicate'); load a save without 'fuse qkv'")
        return None
    if _heads_read_from_the_module(fused_path, attention, problems):
        return None
    layer = attention.qkv_proj
    kind = _kind(fused_path, layer, "rows", problems)
    splits = tuple(attention.qkv_split)
    if kind is None:
        return None
    if any(part % world for part in splits):
        problems.add(fused_path, f"its q, k, v widths {splits} do not split evenly over {world} ranks: use a "
                     "number of ranks that divides them, or load without tp_plan")
        return None
    if not _heads(fused_path, splits, attention, world, problems):
        return None
    local = tuple(part // world for part in splits)
    if not _fits_kernels(fused_path, layer, kind, "rows", sum(local), problems):
        return None
    return Placement(fused_path, "colwise", "rows", f"fused q|k|v, {kind}", _ranges(splits, rank, world),
                     sum(splits), rank, world, fused_split=local)


def _fits_kernels(path: str, module: nn.Module, kind: str, axis: str, local: int, problems: _Problems) -> bool:
    """Whether a shard of ``local`` features along ``axis`` still meets the layer's kernel rules."""
    if kind.startswith("int4") and axis == "rows" and local % INT4_OUT_MULTIPLE:
        problems.add(path, f"int4 shards of {local} output features: the packed int4 kernels take multiples of "
                     f"{INT4_OUT_MULTIPLE}; use fewer ranks, or load without tp_plan")
        return False
    if kind.startswith("int4") and axis == "columns" and local % module.group_size:
        fitting = [g for g in INT4_GROUPS if local % g == 0]
        fix = f"'quantize int4 group_size={fitting[-1]}'" if fitting else "fewer ranks"
        problems.add(path, f"int4 group_size={module.group_size} would be split: each rank gets {local} of its "
                     f"{module.in_features} input features; {fix} shards, or load without tp_plan")
        return False
    if kind.startswith("w8a8") and local % W8A8_MULTIPLE:
        problems.add(path, f"w8a8 shards of {local} features: int8 matmul kernels take multiples of "
                     f"{W8A8_MULTIPLE}; use fewer ranks, or load without tp_plan")
        return False
    if kind.startswith("fp8") and getattr(module, "native", False) and axis == "columns":
        problems.add(path, "fp8 native quantizes each token's activations over the whole row; a row-parallel "
                     "shard sees part of it and would round differently: use 'fp8 storage' for this layer, or load "
                     "without tp_plan")
        return False
    return True
