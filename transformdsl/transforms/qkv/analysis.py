"""``fuse qkv``: the layouts it knows and the analysis of one attention module (implementation).

:data:`PROJECTIONS` names every q/k/v layout; :func:`analyse` says how one module fuses (a
:class:`Fusion`: its groups and how it then computes) or why it does not (a reason, for the plan).
A :class:`Fusion` is also the per-module record a save holds.  Nothing here changes a module:
:mod:`.install` does.  What users may rely on is in :mod:`.fusion`'s docstring and spec.md.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ...errors import LoadError
from . import QKVOptions

DIFFUSERS_ATTENTION = "diffusers.models.attention_processor.Attention"
FLUX_ATTENTION = "diffusers.models.transformers.transformer_flux.FluxAttention"
LLAMA_ATTENTION = "transformers.models.llama.modeling_llama.LlamaAttention"

#: diffusers processor → its fused counterpart.  Only pairs whose fused processor computes
#: exactly what the unfused one does (conditions in :func:`_diffusers_attention`).
FUSED_PROCESSORS = {
    "AttnProcessor2_0": "FusedAttnProcessor2_0",
    "JointAttnProcessor2_0": "FusedJointAttnProcessor2_0",
}


@dataclass(frozen=True)
class Projections:
    """One naming convention of separate q, k, v projections and the names of their fusions."""

    q: str
    k: str
    v: str
    #: the fused Linear of q+k+v, and of k+v alone (cross-attention: q reads other states)
    qkv: str
    kv: str
    #: whether the module's cross-attention declaration concerns these projections (the
    #: added/context projections of joint attention all read the encoder states together)
    declared_cross: bool = True

    @property
    def names(self) -> tuple[str, str, str]:
        return (self.q, self.k, self.v)


#: Which attributes count as q, k and v: one line per naming convention.  A new architecture
#: that uses a convention listed here costs no code; a new convention costs one line.
PROJECTIONS = (
    Projections("to_q", "to_k", "to_v", "to_qkv", "to_kv"),                          # diffusers
    Projections("add_q_proj", "add_k_proj", "add_v_proj", "to_added_qkv", "to_added_kv",
                declared_cross=False),                                            # diffusers joint/added
    Projections("to_q_t", "to_k_t", "to_v_t", "to_qkv_t", "to_kv_t", declared_cross=False),  # HiDream text
    Projections("q_proj", "k_proj", "v_proj", "qkv_proj", "kv_proj"),                # most of transformers
    Projections("query", "key", "value", "query_key_value", "key_value"),           # BERT family, ...
    Projections("q", "k", "v", "qkv", "kv"),                                         # T5, UMT5
    Projections("q_lin", "k_lin", "v_lin", "qkv_lin", "kv_lin"),                    # DistilBERT
    Projections("query_proj", "key_proj", "value_proj", "qkv_proj", "kv_proj"),    # DeBERTa-v2
    Projections("linear_q", "linear_k", "linear_v", "linear_qkv", "linear_kv"),     # Conformer
    Projections("wq", "wk", "wv", "wqkv", "wkv"),
    Projections("to_query", "to_key", "to_value", "to_qkv", "to_kv"),
)

#: Fused Linear → the projections it replaces, concatenated in this order (from :data:`PROJECTIONS`).
GROUP_SOURCES: dict[str, tuple[str, ...]] = {}
for _row in PROJECTIONS:
    GROUP_SOURCES.setdefault(_row.qkv, _row.names)
    GROUP_SOURCES.setdefault(_row.kv, (_row.k, _row.v))
#: a fused name shared by two conventions: the record's sources say which
GROUP_ALTERNATIVES = {(row.qkv, row.names) for row in PROJECTIONS} | {(row.kv, (row.k, row.v)) for row in PROJECTIONS}

#: Attributes that mean "q, k and v are already projected together".
ALREADY_FUSED = ("to_qkv", "to_kv", "to_added_qkv", "qkv_proj", "c_attn", "qkv", "Wqkv",
                 "query_key_value", "in_proj_weight", "to_added_kv", "kv_proj", "key_value")

#: Words that, in an attention module's class name or its own name, declare a cross-attention.
CROSS_WORDS = ("cross", "encdec", "encoder_attn")

#: Fingerprint of the ``LlamaAttention.forward`` that :func:`.install.fused_llama_class` mirrors
#: (transformers 5.24, comments and blank lines ignored).  Another forward is not fused:
#: outputs could silently change.
LLAMA_FORWARD_FINGERPRINT = "5cab7e5f7ca737e5"



# --------------------------------------------------------------------------- what a fusion is


@dataclass(frozen=True)
class Group:
    """One fused projection: ``sources`` concatenated, in order, into the Linear ``name``."""

    name: str
    sources: tuple[str, ...]
    #: out_features of each source, i.e. how the fused output splits back into q, k, v.
    splits: tuple[int, ...]
    in_features: int
    bias: bool
    #: sources without a bias of their own in a group with a bias (Whisper's ``k_proj``): their
    #: rows of the fused bias are zeros (adding 0 changes nothing: the fusion stays exact).
    zero_bias: tuple[str, ...] = ()

    @property
    def out_features(self) -> int:
        return sum(self.splits)


@dataclass(frozen=True)
class Fusion:
    """How one attention module is fused: its groups and how it then computes.

    This is also the per-module record (:meth:`to_json`) that :meth:`QKVFusion.rebuild` replays.
    """

    #: ``self`` (q/k/v), ``cross`` (k/v only; q reads other states) or ``joint`` (also the
    #: added/context projections).
    kind: str
    groups: tuple[Group, ...]
    #: diffusers processor class installed (one of :data:`FUSED_PROCESSORS`' values), or None.
    processor: str | None = None
    #: whether ``fused_projections = True`` is set (diffusers' own flag).
    fused_projections: bool = False
    #: ``"llama"``: the module's class becomes one whose forward reads ``qkv_proj``;
    #: ``"shared"``: the sources become slices of the fused Linear (:mod:`.shared_projection`).
    forward: str | None = None

    @property
    def mechanism(self) -> str:
        """How the module computes with the fused layout, in words."""
        if self.forward == "shared":
            return "slices of the shared fused projection"
        if self.forward == "llama":
            return "the fused Llama forward"
        return self.processor or "the processor's fused path"

    def describe(self) -> str:
        """``to_qkv = to_q+to_k+to_v (32+32+32 x 32) through FusedAttnProcessor2_0``, for messages."""
        groups = "; ".join(f"{g.name} = {'+'.join(g.sources)} ({'+'.join(map(str, g.splits))} x {g.in_features})"
                           for g in self.groups)
        return f"{groups} through {self.mechanism}"

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "groups": [{"name": g.name, "sources": list(g.sources), "splits": list(g.splits),
                        "in_features": g.in_features, "bias": g.bias,
                        **({"zero_bias": list(g.zero_bias)} if g.zero_bias else {})} for g in self.groups],
            "processor": self.processor,
            "fused_projections": self.fused_projections,
            "forward": self.forward,
        }

    @classmethod
    def from_json(cls, data: dict) -> Fusion:
        """The record written by :meth:`to_json`, checked: only what this pass can produce."""
        groups = tuple(Group(g["name"], tuple(g["sources"]), tuple(int(s) for s in g["splits"]),
                             int(g["in_features"]), bool(g["bias"]), tuple(g.get("zero_bias", ())))
                       for g in data["groups"])
        fusion = cls(data["kind"], groups, data.get("processor"), bool(data.get("fused_projections")),
                     data.get("forward"))
        if (fusion.kind not in ("self", "cross", "joint") or not groups
                or any((g.name, g.sources) not in GROUP_ALTERNATIVES or len(g.splits) != len(g.sources)
                       or not set(g.zero_bias) < set(g.sources) or (g.zero_bias and not g.bias)
                       for g in groups)
                or fusion.processor not in (None, *FUSED_PROCESSORS.values())
                or fusion.forward not in (None, "llama", "shared")):
            raise LoadError(f"fuse qkv: malformed record entry {data!r}")
        return fusion


# --------------------------------------------------------------------------- analysis


def analyse(module: nn.Module, options: QKVOptions, path: str = "") -> Fusion | str:
    """The fusion for ``module`` (at ``path``), or the reason it cannot be fused exactly (a plan
    near miss).  A module with an exact fused path of its own (:data:`LAYOUTS`) uses it; any
    other, the shared fused projection."""
    fused = next((n for n in ALREADY_FUSED
                  if module._modules.get(n) is not None or module._parameters.get(n) is not None), None)
    if fused is not None:
        kind = type(module._modules[fused]).__name__ if fused in module._modules else "parameter"
        return f"already fused: {fused} ({kind}) projects q, k and v together"
    reads = _reads_weights_itself(type(module))
    if reads:
        return (f"{type(module).__name__}.forward reads {reads} itself and never calls the projections "
                "(F.multi_head_attention_forward): a fused projection would never run")
    for base, layout in LAYOUTS:
        klass = _base_class(module, base)
        if klass is None:
            continue
        if type(module).forward is klass.forward:
            own = layout(module, options)
            if isinstance(own, Fusion):
                return own
        break
    return _shared(module, options, path)


def _shared(module: nn.Module, options: QKVOptions, path: str) -> Fusion | str:
    """A shared fused projection for every convention of :data:`PROJECTIONS` the module has."""
    groups: list[Group] = []
    cross = False
    children = module._modules
    for row in PROJECTIONS:
        if children.get(row.k) is None or children.get(row.v) is None:
            continue    # nothing to fuse (q alone, or none of these names)
        q = children.get(row.q)
        reads_other = q is None or (row.declared_cross and _declared_cross(module, path)) \
            or not _same_input(q, children[row.k])
        if reads_other:
            if options.cross == "skip":
                return CROSS_SKIPPED
            cross = cross or q is not None
            group = _group(module, row.kv, False, (row.k, row.v))
        else:
            group = _group(module, row.qkv, False, row.names)
        if isinstance(group, str):
            return group
        if module._modules.get(group.name) is not None or group.name in module.__dict__ \
                or group.name in module._parameters or group.name in module._buffers:
            return f"{group.name} already exists: the fused projection needs that name"
        groups.append(group)
    if not groups:
        return _no_projections(module)
    kind = "cross" if cross else ("joint" if len(groups) > 1 else "self")
    return Fusion(kind, tuple(groups), forward="shared")


_PROJECTION_NAMES = sorted({name for row in PROJECTIONS for name in row.names}, key=len, reverse=True)
_WEIGHT_READ = re.compile(r"self\.(" + "|".join(map(re.escape, _PROJECTION_NAMES)) + r")\.weight\b")


@functools.lru_cache(maxsize=256)
def _reads_weights_itself(cls: type) -> str | None:
    """``k_proj.weight`` (say) when ``cls.forward`` passes its projections' weights to a function
    itself (HunyuanDiT's ``AttentionPool``: ``F.multi_head_attention_forward(q_proj_weight=...)``)
    instead of calling them.  Read once per class; library attention modules call their
    projections (diffusers' through the processor), so this costs one source read per class."""
    forward = cls.forward
    if forward is nn.Module.forward or getattr(forward, "__module__", "").startswith("torch."):
        return None
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    found = sorted(set(_WEIGHT_READ.findall(source)))
    return ", ".join(f"{name}.weight" for name in found) or None


def _no_projections(module: nn.Module) -> str:
    for name, child in module._modules.items():
        if child is not None and any(child._modules.get(row.k) is not None for row in PROJECTIONS):
            return (f"no q/k/v projections of its own: they are in its submodule {name} "
                    f"({type(child).__name__}), fused on its own")
    return f"no separate q/k/v projections with the names this pass knows in {type(module).__name__}"


def _declared_cross(module: nn.Module, path: str) -> bool:
    """Whether the model declares ``module`` a cross-attention (q reads other states than k/v)."""
    if module.__dict__.get("is_cross_attention") is True:   # diffusers Attention, WanAttention, BertAttention
        return True
    names = (type(module).__name__.lower(), path.rpartition(".")[2].lower())
    return any(word in name for word in CROSS_WORDS for name in names)


def _same_input(q: nn.Module | None, k: nn.Module) -> bool:
    """q may read the input k reads (same width); a q that is not a Linear is left alone."""
    return q is not None and getattr(q, "in_features", None) == getattr(k, "in_features", None)


def _base_class(module: nn.Module, qualified: str) -> type | None:
    """The class of ``module``'s MRO named ``qualified`` (matched by name: no library import)."""
    return _base_of(type(module), qualified)


@functools.lru_cache(maxsize=4096)
def _base_of(cls: type, qualified: str) -> type | None:
    for klass in cls.__mro__:
        if f"{klass.__module__}.{klass.__qualname__}" == qualified:
            return klass
    return None


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` (or a subclass computing what it computes: ``forward`` not overridden)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _group(module: nn.Module, name: str, equal: bool, sources: tuple[str, ...] | None = None) -> Group | str:
    """A :class:`Group` if the projections ``name`` replaces can become one Linear, else the reason.

    ``equal``: the consumer splits the fused output into equal parts (diffusers' processors),
    so the projections must have the same width.
    """
    sources = sources or GROUP_SOURCES[name]
    linears = []
    for source in sources:
        linear = module._modules.get(source)
        if linear is None:
            return f"{source} is missing"
        if "lora_adapters" in linear._modules:  # lora merge=false's adapters (no import of that family)
            return (f"{source} carries switchable LoRA adapters from an earlier call: fuse qkv maps adapters onto "
                    "the fused rows only when both are in one script (it runs before lora there); put them in one "
                    "script, or merge the LoRA (merge=true)")
        if not _plain_linear(linear):
            # Quantized or otherwise replaced layers compute differently.
            return (f"{source} is a {type(linear).__name__}, not a plain nn.Linear (in one script fuse qkv runs "
                    "before the statements that replace layers: put them in one script, or fuse first)")
        if linear._forward_hooks or linear._forward_pre_hooks or "_diffusers_hook" in linear.__dict__ \
                or "_hf_hook" in linear.__dict__:
            # Offloading/casting hooks would be lost on the fused Linear.
            return f"{source} has hooks (offloading, layerwise casting, ...) a fused Linear would not keep"
        linears.append(linear)
    first = linears[0]
    for source, linear in zip(sources[1:], linears[1:]):
        if linear.in_features != first.in_features:
            return (f"projections read different inputs: {source} has in_features {linear.in_features}, "
                    f"{sources[0]} {first.in_features}")
        if linear.weight.dtype != first.weight.dtype or linear.weight.device != first.weight.device:
            return f"{source} and {sources[0]} differ in dtype or device"
    splits = tuple(linear.out_features for linear in linears)
    if equal and len(set(splits)) > 1:
        return (f"{'/'.join(sources)} have different widths {splits} and the fused processor splits "
                "its output into equal parts")
    biased = [linear.bias is not None for linear in linears]
    zero_bias = tuple(source for source, has in zip(sources, biased) if not has) if any(biased) else ()
    return Group(name, sources, splits, first.in_features, any(biased), zero_bias)


def _groups(module: nn.Module, names: list[str], equal: bool = True) -> tuple[Group, ...] | str:
    """Every group, or the first reason one of them cannot be made (a module fuses whole or not)."""
    groups = []
    for name in names:
        group = _group(module, name, equal)
        if isinstance(group, str):
            return group
        groups.append(group)
    return tuple(groups)


CROSS_SKIPPED = "cross-attention (k/v read the encoder states): left alone, cross=skip"


def _diffusers_attention(module: nn.Module, options: QKVOptions) -> Fusion | str:
    """diffusers ``Attention``: swap its processor for the library's fused counterpart."""
    from diffusers.models import attention_processor as ap

    processor = type(module.processor)
    if processor is ap.AttnProcessor2_0:
        if module.is_cross_attention:
            # FusedAttnProcessor2_0 projects q from the hidden states and k/v, through to_kv,
            # from the encoder states: the same inputs as AttnProcessor2_0.
            if options.cross == "skip":
                return CROSS_SKIPPED
            groups = _groups(module, ["to_kv"])
            kind = "cross"
        else:
            groups = _groups(module, ["to_qkv"])
            kind = "self"
        if isinstance(groups, str):
            return groups
        return Fusion(kind, groups, processor="FusedAttnProcessor2_0", fused_projections=True)
    if processor is ap.JointAttnProcessor2_0:
        reason = _joint_reason(module)
        if reason:
            return reason
        groups = _groups(module, ["to_qkv", "to_added_qkv"])
        if isinstance(groups, str):
            return groups
        return Fusion("joint", groups, processor="FusedJointAttnProcessor2_0", fused_projections=True)
    return (f"attention processor {processor.__name__} has no exact fused counterpart "
            f"(fused: {', '.join(FUSED_PROCESSORS)})")


def _joint_reason(module: nn.Module) -> str | None:
    """Why ``FusedJointAttnProcessor2_0`` would not compute what ``JointAttnProcessor2_0`` does."""
    if module.is_cross_attention:
        return "joint attention built as cross-attention: unknown layout"
    if any(getattr(module, n, None) is None for n in GROUP_SOURCES["to_added_qkv"]):
        # e.g. SD3.5's second attention: FusedJointAttnProcessor2_0 requires encoder states.
        return "joint processor without add_q_proj/add_k_proj/add_v_proj: FusedJointAttnProcessor2_0 needs them"
    norms = [n for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k") if getattr(module, n, None) is not None]
    if norms:
        return (f"qk-norm ({', '.join(norms)}): diffusers' FusedJointAttnProcessor2_0 skips it, "
                "so fusing would change outputs")
    return None


def _flux_attention(module: nn.Module, options: QKVOptions) -> Fusion | str:
    """diffusers ``FluxAttention``: ``FluxAttnProcessor`` has a fused path, taken when
    ``fused_projections`` is set; it reads ``to_qkv`` and, with encoder states, ``to_added_qkv``
    (both split with ``chunk(3)``, hence equal widths)."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    if type(module.processor) is not FluxAttnProcessor:
        return f"attention processor {type(module.processor).__name__} has no fused path (FluxAttnProcessor has)"
    if not getattr(module, "_supports_qkv_fusion", True):
        return f"{type(module).__name__} does not support q/k/v fusion"
    names = ["to_qkv"]
    if module.added_kv_proj_dim is not None:
        # The fused path reads to_added_qkv whenever encoder states are passed: fuse both or neither.
        names.append("to_added_qkv")
    groups = _groups(module, names)
    if isinstance(groups, str):
        return groups
    return Fusion("joint" if len(groups) > 1 else "self", groups, fused_projections=True)


def _llama_attention(module: nn.Module, options: QKVOptions) -> Fusion | str:
    """transformers ``LlamaAttention``: q/k/v may differ in width (grouped-query attention)."""
    klass = _base_class(module, LLAMA_ATTENTION)
    if _fingerprint(klass.forward) != LLAMA_FORWARD_FINGERPRINT:
        return (f"{klass.__name__}.forward of this transformers version differs from the one this pass "
                "mirrors: fusing could change outputs")
    groups = _groups(module, ["qkv_proj"], equal=False)
    if isinstance(groups, str):
        return groups
    return Fusion("self", groups, forward="llama")


@functools.lru_cache(maxsize=256)
def _fingerprint(function: Callable) -> str:
    """A hash of a function's code, ignoring indentation, blank lines and comments.

    Cached per function: reading source is slow (ms), and a model repeats one class per layer."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return ""
    lines = [line.strip() for line in source.splitlines()]
    code = "\n".join(line for line in lines if line and not line.startswith("#"))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


#: (qualified base class, analysis): tried in order; the first base found in a module's MRO decides.
LAYOUTS: tuple[tuple[str, Callable[[nn.Module, QKVOptions], Fusion | str]], ...] = (
    (DIFFUSERS_ATTENTION, _diffusers_attention),
    (FLUX_ATTENTION, _flux_attention),
    (LLAMA_ATTENTION, _llama_attention),
)
