"""``lora "PATH"`` (implementation): plan against the file's header, merge or attach, reload.

Planning reads the header only (:mod:`.files`), runs the library converters on placeholders
(:mod:`.keys`) and resolves every module the file names on the model (:mod:`.layers`): a key that
names no module is an error listing the nearest names (``unmatched=ignore`` drops them, listed in
the plan), a rank or shape that does not fit names the module, and a merged LoRA on a layer that
holds no float weight (quantized by an earlier ``transform()``) says how to keep it instead.

Applying reads the file through one descriptor (its SHA-256 streamed over it, each tensor's bytes
once, a change of the file meanwhile refused: :func:`.files.read_tensors`), converts it again with
the real tensors, and either adds ``scale * alpha/rank * B @ A`` to
each weight (rows of a fused one) as a new tensor through the edit log, or attaches adapters.
The record holds the file's name and SHA-256 (never its path), and for a switchable LoRA the shape
of each adapter, so that :meth:`Lora.rebuild` recreates them before the saved tensors load.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ...errors import LoadError, Problem, ScriptError, TransformError
from ...extend import ApplyContext
from ...tree import ModuleInfo, ModuleTree, below_any
from . import Lora as LoraDeclaration
from . import LoraOptions, files, keys, layers
from . import file_name as _display

RECORD_VERSION = 1
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Lora(LoraDeclaration):
    # ------------------------------------------------------------------ planning

    def _fail(self, message: str, hint: str | None = None):
        span = self.statement.argument.span if self.statement.argument is not None else self.statement.span
        raise ScriptError([Problem(message, [span], hint=hint)])

    def check(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        path = self.statement.argument.text
        try:
            header = files.read_header(path)
        except files.LoraFileError as exc:
            self._fail(str(exc))
        # The component's root: the file names modules from there (the `in` clause only narrows them).
        root = tree[""].module if "" in tree and tree[""].module is not None else info.module
        display = _display(path)
        notes = self.__dict__.setdefault("_notes", {})[info.path] = []
        try:
            converted = keys.convert(keys.placeholders(header.tensors), root, self.common.component, display)
        except TransformError as exc:
            self._fail(str(exc))
        except keys.NeedsValues as exc:  # a converter that reads values (a sparsity test): checked when applied
            notes.append(f"{display}: keys checked when applied ({type(exc).__name__} on placeholders: "
                         f"{str(exc)[:80]})")
            return None
        if not converted.pairs:
            self._fail(f"{display}: the file holds no LoRA pair (A/down and B/up tensors): nothing to apply")
        zero = sorted(named for named, pair in converted.pairs.items() if pair.rank == 0)
        if zero:
            self._fail(f"{display}: '{zero[0]}' has rank 0 (A {tuple(converted.pairs[zero[0]].A.shape)}): a LoRA "
                       "pair needs at least one row in A")
        targets, problems = self._resolve(root, converted, display, within=[info.path], notes=notes)
        if problems:
            self._fail(problems[0], hint=problems[1] if len(problems) > 1 else None)
        mode = "merged into the float weights" if self.options.merge else \
            f"kept switchable as adapter '{self.adapter_name}' (transformdsl.set_lora)"
        ranks = sorted({p.rank for p in converted.pairs.values()})
        fused = sum(t.fused for t, _ in targets)
        notes.append(f"{display}: {len(targets)} module(s), rank {'/'.join(map(str, ranks)) or '-'}, {mode}"
                     + (f"; {fused} onto rows of fused layers" if fused else "") + f" (keys: {converted.via})")
        for other, count in converted.others.items():
            notes.append(f"{display}: {count} module(s) of component '{other}' left alone (another statement "
                         f"with component={other} applies them)")
        return None

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        planned = self.__dict__.get("_notes", {})
        return [note for path in targets for note in planned.get(path, [])]

    def _resolve(self, root: nn.Module, converted: keys.Converted, display: str,
                 within: list[str] | None = None, notes: list[str] | None = None):
        """[(Target, Pair)] for the file's modules, and the problems (message, hint) if any."""
        targets, unmatched, problems = [], [], []
        for named, pair in converted.pairs.items():
            if within is not None and not below_any(named, frozenset(within)):
                continue
            label = files.printable(named)
            target = layers.resolve(root, named)
            if isinstance(target, str):
                unmatched.append((named, target))
                continue
            rows = target.stop - target.start
            a_in = pair.A.shape[1] if pair.A.dim() >= 2 else -1
            if pair.A.dim() not in (2, 4) or pair.B.dim() != pair.A.dim() or pair.B.shape[1] != pair.A.shape[0]:
                problems.append(f"{display}: '{label}': A {tuple(pair.A.shape)} and B {tuple(pair.B.shape)} are "
                                "not a LoRA pair (B's columns must equal A's rows, the rank)")
            elif a_in != target.in_features or pair.B.shape[0] != rows:
                problems.append(f"{display}: '{label}': the LoRA maps {a_in} -> {pair.B.shape[0]} features (rank "
                                f"{pair.A.shape[0]}), the module {target.in_features} -> {rows}: made for another "
                                "model or size")
            else:
                problem = self._layer_problem(root, target, pair)
                if problem:
                    problems.append(f"{display}: '{label}': {problem}")
                else:
                    targets.append((target, pair))
        if unmatched and self.options.unmatched == "error":
            names = [n for n, m in root.named_modules() if layers.features(m) or isinstance(m, nn.Conv2d)]
            shown = []
            for named, reason in unmatched[:3]:
                close = keys.nearest(named, names)
                nearest = f"; nearest: {', '.join(close)}" if close else ""
                shown.append(f"'{files.printable(named)}' ({reason}{nearest})")
            more = f" and {len(unmatched) - 3} more" if len(unmatched) > 3 else ""
            problems.insert(0, f"{display}: {len(unmatched)} LoRA module(s) match no module of the "
                            f"{type(root).__name__}: {'; '.join(shown)}{more}")
            problems.insert(1, "a LoRA made for another model? unmatched=ignore applies the others")
        elif unmatched and notes is not None:
            notes.append(
                f"{display}: {len(unmatched)} LoRA module(s) ignored (unmatched=ignore): "
                + ", ".join(files.printable(n) for n, _ in unmatched[:3]) + (" ..." if len(unmatched) > 3 else ""))
        return targets, problems

    def _layer_problem(self, root: nn.Module, target: layers.Target, pair: keys.Pair) -> str | None:
        module = root.get_submodule(target.layer)
        if self.options.merge:
            weight = module._parameters.get("weight")
            if weight is None or not weight.is_floating_point() or weight.element_size() == 1:
                return (f"'{target.layer}' is a {type(module).__name__} with no float weight (quantized?): a merged "
                        "LoRA goes into float weights; put the lora statement in the script that quantizes (it runs "
                        "first), or keep it beside the layer with merge=false")
            if pair.A.dim() == 4 and not isinstance(module, nn.Conv2d):
                return f"a convolution LoRA for a {type(module).__name__}"
        elif pair.A.dim() == 4 or isinstance(module, nn.Conv2d):
            return ("a switchable LoRA on a convolution is not supported; merge=true merges it into the "
                    "convolution's weight")
        return None

    # ------------------------------------------------------------------ execution

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        path = self.statement.argument.text
        display = _display(path)
        header = files.read_header(path)
        largest = max((p.numel() for p in ctx.root.parameters()), default=0)
        state, digest = files.read_tensors(header, largest)
        converted = keys.convert(state, ctx.root, self.common.component, display)
        pairs, problems = self._resolve(ctx.root, converted, display, within=targets)
        if problems:
            raise TransformError(problems[0] + (f" ({problems[1]})" if len(problems) > 1 else ""))
        by_layer: dict[str, list[tuple[layers.Target, keys.Pair]]] = defaultdict(list)
        for target, pair in pairs:
            by_layer[target.layer].append((target, pair))
        name = self.adapter_name
        record_layers = {}
        for layer, parts in ctx.progress(list(by_layer.items()), total=len(by_layer), desc="lora"):
            module = ctx.root.get_submodule(layer)
            if self.options.merge:
                self._merge(ctx, module, parts)
                record_layers[layer] = {"parts": [t.to_json() for t, _ in parts]}
            else:
                record_layers[layer] = self._attach(ctx, layer, module, parts, name)
        return {"version": RECORD_VERSION, "adapter": name, "file": display, "sha256": digest,
                "merge": self.options.merge, "scale": self.options.scale, "layers": record_layers}

    def _factor(self, pair: keys.Pair) -> float:
        alpha = pair.alpha if pair.alpha is not None else (self.options.alpha or pair.rank)
        return alpha / pair.rank

    def _merge(self, ctx: ApplyContext, module: nn.Module, parts) -> None:
        weight = module.weight
        merged = weight.detach().float().clone()
        for target, pair in parts:
            rows = merged[target.start:target.stop]
            rows += layers.delta(pair.A.to(merged.device), pair.B.to(merged.device),
                                 self.options.scale * self._factor(pair), rows.shape)
        merged = merged.to(weight.dtype)
        if not bool(torch.isfinite(merged if merged.element_size() > 1 else merged.float()).all()):
            raise TransformError(f"{_display(self.statement.argument.text)}: '{parts[0][0].layer}': the merged weight "
                                 f"overflows {str(weight.dtype).removeprefix('torch.')} (infinite or NaN values; its "
                                 "values, alpha or scale are too large): the model would compute inf/NaN")
        ctx.edit.setattr(module, "weight", nn.Parameter(merged, requires_grad=weight.requires_grad))

    def _attach(self, ctx: ApplyContext, path: str, module: nn.Module, parts, name: str) -> dict:
        sizes = layers.features(module)
        dtype, device = _adapter_placement(module)
        A, B = layers.stacked([(t.start, t.stop, p.A.to(device, dtype), p.B.to(device, dtype), self._factor(p))
                               for t, p in parts], sizes[1])
        if not all(bool(torch.isfinite(t if t.element_size() > 1 else t.float()).all()) for t in (A, B)):
            raise TransformError(f"{_display(self.statement.argument.text)}: '{path}': the adapter overflows "
                                 f"{str(dtype).removeprefix('torch.')} (infinite or NaN values once cast; its values "
                                 "or alpha are too large): the model would compute inf/NaN")
        adapter = layers.LoraAdapter(A.contiguous(), B.contiguous(), self.options.scale)
        existing = module._modules.get(layers.ADAPTERS)
        if existing is None:
            ctx.edit.setattr(module, layers.ADAPTERS, nn.ModuleDict())
            old = type(module)
            ctx.edit.on_rollback(lambda: setattr(module, "__class__", old))
            module.__class__ = layers.with_lora(old)
        elif name in existing:
            raise TransformError(f"'{path}' already has a LoRA adapter named '{name}'; give this one another "
                                 "name (name=...)")
        adapters = module._modules[layers.ADAPTERS]
        ctx.edit.touch(adapters)
        adapters[name] = adapter
        return {"rank": int(A.shape[0]), "in": int(A.shape[1]), "out": int(B.shape[0]),
                "dtype": str(dtype).removeprefix("torch."), "parts": [t.to_json() for t, _ in parts]}

    # ------------------------------------------------------------------ other formats

    @classmethod
    def export(cls, step, out) -> None:
        """A merged LoRA is plain weights (a note names the file); a switchable one is refused."""
        if not step.record.get("merge", True):
            raise out.refuse(step, f"a {out.library} checkpoint holds one set of weights, and its LoRAs travel as "
                             "separate adapter files (load_lora_weights, PEFT)",
                             "merge it (merge=true), or save with format='transformdsl', which keeps the adapter "
                             "switchable")
        out.notes.append(f"{out.where(step)}: merged into the weights ({step.record.get('file')}, sha256 "
                         f"{str(step.record.get('sha256'))[:12]}...); {out.library} loads them as plain weights")

    # ------------------------------------------------------------------ loading

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: LoraOptions) -> None:
        if record.get("version") != RECORD_VERSION:
            raise LoadError(f"lora: record version {record.get('version')!r}, expected {RECORD_VERSION}")
        if record.get("merge", True):
            return  # the merged weights are the saved weights
        name = record["adapter"]
        for path, layer in record["layers"].items():
            shown = files.printable(str(path))
            if not isinstance(layer, dict) or not all(
                    type(layer.get(k)) is int and 0 < layer[k] <= files.MAX_DIMENSION for k in ("rank", "in", "out")):
                raise LoadError(f"lora: adapter '{name}' at '{shown}': its rank, in and out must be positive integers")
            try:
                module = root.get_submodule(path)
            except AttributeError:
                raise LoadError(f"lora: adapter '{name}' recorded at '{shown}', which the model does not "
                                "have") from None
            sizes = layers.features(module)
            if sizes is None or isinstance(module, nn.Conv2d):
                raise LoadError(f"lora: adapter '{name}' recorded at '{shown or '(the root module)'}', a "
                                f"{type(module).__name__}: a switchable LoRA sits beside a linear layer only")
            if sizes != (layer["in"], layer["out"]):
                raise LoadError(f"lora: adapter '{name}' at '{shown}' maps {layer['in']} -> {layer['out']} features, "
                                f"the layer {sizes[0]} -> {sizes[1]}")
            dtype = _DTYPES.get(layer["dtype"])
            if dtype is None:
                raise LoadError(f"lora: adapter dtype {layer['dtype']!r} at '{shown}'")
            A = torch.empty((layer["rank"], layer["in"]), dtype=dtype, device="meta")
            B = torch.empty((layer["out"], layer["rank"]), dtype=dtype, device="meta")
            adapter = layers.LoraAdapter(A, B, record.get("scale", 1.0))
            if module._modules.get(layers.ADAPTERS) is None:
                module.add_module(layers.ADAPTERS, nn.ModuleDict())
                module.__class__ = layers.with_lora(type(module))
            module._modules[layers.ADAPTERS][name] = adapter


def _adapter_placement(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device an adapter beside ``module`` computes in: a float weight's, else the
    layer's compute dtype (quantized layers), else float32."""
    weight = module._parameters.get("weight")
    tensors = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)) if t is not None]
    device = tensors[0].device if tensors else torch.device("cpu")
    if weight is not None and weight.is_floating_point() and weight.element_size() > 1 \
            and type(weight) is nn.Parameter:
        return weight.dtype, device
    compute = getattr(module, "compute_dtype", None)
    if isinstance(compute, torch.dtype) and compute in _DTYPES.values():
        return compute, device
    return torch.float32, device


__all__ = ["Lora"]
