"""``fuse qkv``: one projection (and one matmul) instead of separate q, k and v (implementation).

What users may rely on (spec.md, "fuse qkv"):

- A fused attention module holds ONE ``nn.Linear`` whose weight (and bias) is the
  concatenation, along the output dimension and in q, k, v order, of the projections it
  replaces; the old projections are deleted, so parameter bytes do not change.
- Names come from one table, :data:`PROJECTIONS`: diffusers ``to_q/to_k/to_v`` → ``to_qkv``
  (self-attention) or ``to_k/to_v`` → ``to_kv`` (cross-attention, ``to_q`` kept);
  ``add_q_proj/add_k_proj/add_v_proj`` → ``to_added_qkv``; transformers ``q_proj/k_proj/v_proj``
  → ``qkv_proj``; ``query/key/value`` → ``query_key_value``; T5 ``q/k/v`` → ``qkv``; ...  These
  are the state_dict keys a saved model has.
- Outputs equal the unfused module's (fp32: max abs diff <= 1e-5; bit-equal in our CPU tests
  with one thread, ~1e-7 apart with several, where the wider matmul is partitioned
  differently).  A module that cannot be fused exactly is not fused: the plan lists it with
  the reason.

How a fused module computes, per layout (:data:`LAYOUTS`):

- diffusers ``Attention``: its processor becomes the library's fused counterpart
  (``AttnProcessor2_0`` → ``FusedAttnProcessor2_0``, ``JointAttnProcessor2_0`` →
  ``FusedJointAttnProcessor2_0``), only where that counterpart computes the same thing.
- diffusers ``FluxAttention``: ``fused_projections = True``, which ``FluxAttnProcessor``
  reads to take its own fused path.
- transformers ``LlamaAttention``: it has no fused path, so the module's class becomes a
  subclass whose ``forward`` is Llama's, with one ``qkv_proj`` matmul and a split in place of
  the three projections (grouped-query attention included: the split sizes differ).
- every other module with projections named in :data:`PROJECTIONS` (all of transformers, and
  diffusers processors without an exact fused counterpart, e.g. qk-norm joint attention): a
  *shared fused projection* (:mod:`.shared_projection`): the old attributes become parameter-free
  slices of the fused Linear and the module's own forward runs unchanged.

Cross-attention (q reads other states than k/v) is decided from what the model declares, never
from shapes alone: an ``is_cross_attention`` attribute (diffusers, BERT), a class or module name
saying so (:data:`CROSS_WORDS`: ``BertCrossAttention``, T5's ``EncDecAttention``, BART/Whisper
``encoder_attn``), or q reading another width than k/v.  Then only k and v fuse.

This module is the transform; the folder holds its parts: :mod:`.analysis` (the layouts and how one
module fuses), :mod:`.install` (changing a module), :mod:`.shared_projection` (the slices of the
shared layout) and :mod:`.export` (the library formats).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from ...edit import Edit
from ...errors import LoadError, TransformError
from ...extend import ApplyContext
from ...selectors import select, topmost
from ...tree import ModuleInfo, ModuleTree, below_any
from . import QKVFusion as declared_fusion
from . import QKVOptions, shared_projection
from .analysis import PROJECTIONS, Fusion, analyse
from .install import concatenated, install, uninitialised

#: Record versions :meth:`QKVFusion.rebuild` reads (the declaration's ``record_version`` is the newest):
#: every entry a version 1 record can hold means the same in version 2.
READABLE_VERSIONS = (1, 2)


# --------------------------------------------------------------------------- the transform


class QKVFusion(declared_fusion):

    def _planned(self, path: str, module: nn.Module) -> Fusion | str:
        """:func:`analyse`, once per module while planning (``apply`` analyses afresh)."""
        cache = self.__dict__.setdefault("_analysed", {})
        key = (path, id(module))
        if key not in cache:
            cache[key] = (module, analyse(module, self.options, path))   # the module kept: ids stay unique
        return cache[key][1]

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        if info.module is None:
            return "not in the model yet (added by an earlier statement)"
        fusion = self._planned(info.path, info.module)
        if isinstance(fusion, str):
            return fusion
        if any(tree.get(f"{info.path}.{s}") is None or tree[f"{info.path}.{s}"].cls is shared_projection.ProjectionSlice
               for g in fusion.groups for s in g.sources):
            # The live module is still unfused, but an earlier statement's plan effect fused it.
            return "already fused by an earlier statement"
        return None

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        kinds: dict[str, int] = {}
        for path in targets:
            fusion = self._planned(path, tree[path].module)
            kinds[fusion.kind] = kinds.get(fusion.kind, 0) + 1
        notes = []
        if kinds.get("cross"):
            notes.append(f"{kinds['cross']} cross-attention module(s): k/v fused (to_kv, kv_proj, ...), q kept apart "
                         "(cross=kv)")
        if not self.statement.target:
            notes.extend(self._unselected(tree))
        return notes

    def _unselected(self, tree: ModuleTree) -> list[str]:
        """Modules in scope with separate q/k/v projections that the default target (``*Attention``)
        does not name (HunyuanDiT's ``HunyuanDiTAttentionPool``), each with what fusing it would do."""
        scope = self.statement.scope
        roots = frozenset(topmost([p for selector in scope for p in select(selector, tree, None)]) if scope else [""])
        found = []
        for info in tree:
            module = info.module
            if module is None or not below_any(info.path, roots) or not any(
                    isinstance(module._modules.get(row.k), nn.Linear)
                    and isinstance(module._modules.get(row.v), nn.Linear) for row in PROJECTIONS):
                continue
            if any(fnmatchcase(name, pattern) for name in info.class_names for pattern in self.default_target):
                continue
            fusion = analyse(module, self.options, info.path)
            why = fusion if isinstance(fusion, str) else f"it would fuse: name it (fuse qkv in {info.path})"
            found.append(f"{info.path or '<root>'} ({info.cls.__name__}: {why})")
        if not found:
            return []
        return [f"not selected (not named {', '.join(self.default_target)}), though it has separate q/k/v "
                "projections: " + "; ".join(found[:3]) + (f" (+{len(found) - 3})" if len(found) > 3 else "")]

    def plan_effect(self, tree: ModuleTree, targets: list[str]) -> None:
        for path in targets:
            fusion = self._planned(path, tree[path].module)
            for group in fusion.groups:
                sources = [tree[f"{path}.{s}"] for s in group.sources]
                for source, size in zip(sources, group.splits):
                    if fusion.forward == "shared":
                        # The projection stays, as a parameter-free slice of the fused Linear.
                        tree.replace(source.path, shared_projection.ProjectionSlice, own_bytes=0, out_features=size)
                        tree[source.path].facts.pop("weight_shape", None)
                    else:
                        tree.remove(source.path)
                # The real module gets the fused Linear as its last child: same place here.
                tree.add(f"{path}.{group.name}", nn.Linear, own_bytes=sum(s.own_bytes for s in sources),
                         after=path, in_features=group.in_features, out_features=group.out_features,
                         weight_shape=(group.out_features, group.in_features),
                         dtype=sources[0].facts.get("dtype"),
                         **({"meta": True} if sources[0].facts.get("meta") else {}))

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        """Fuse each target; returns ``{"modules": [{"path", **Fusion.to_json()}]}``."""
        fused = []
        for path in ctx.progress(targets, total=len(targets), desc="fuse qkv"):
            module = ctx.root.get_submodule(path)
            fusion = analyse(module, self.options, path)
            if isinstance(fusion, str):
                raise TransformError(f"fuse qkv: {path or '<root>'}: {fusion} (the model changed after planning)")
            install(ctx.edit, module, fusion, concatenated)
            fused.append({"path": path, **fusion.to_json()})
        return {"modules": fused}

    @classmethod
    def export(cls, step, out) -> None:
        from .export import export_unfused

        export_unfused(step, out)

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: QKVOptions) -> None:
        """Replay ``record`` on a skeleton: same Linears (uninitialised), processors and classes.

        Each module must analyse, on the skeleton, to exactly the recorded fusion: another
        architecture, or a library version whose attention this pass no longer mirrors, is a
        :class:`LoadError`, never a model that loads and then computes something else.
        """
        # Saves made before record versions were saved beside the step carried theirs here.
        if record.get("version", 1) not in READABLE_VERSIONS:
            raise LoadError(f"fuse qkv: record version {record.get('version')!r}, expected one of "
                            f"{', '.join(map(str, READABLE_VERSIONS))} (saved by a newer transformdsl?)")
        edit = Edit()   # nothing to roll back on a skeleton; the Edit just carries the changes
        for entry in record["modules"]:
            path = entry["path"]
            saved = Fusion.from_json(entry)
            try:
                module = root.get_submodule(path)
            except AttributeError as error:
                raise LoadError(f"fuse qkv: the model has no module {path!r} to fuse: {error}") from None
            here = analyse(module, options, path)
            if isinstance(here, str):
                raise LoadError(f"fuse qkv: {path} cannot be fused on this model: {here}")
            if here != saved:
                raise LoadError(f"fuse qkv: {path} was saved as {saved.describe()}, "
                                f"but fuses as {here.describe()} on this model")
            install(edit, module, saved, uninitialised)
        edit.commit()
