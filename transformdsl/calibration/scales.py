"""Per-input-channel scales learnt from activations: AWQ (Lin et al., 2023) and SmoothQuant (Xiao et al., 2022).

Both multiply each input channel ``j`` of the layers that read one tensor by ``s_j`` and divide
the tensor itself by ``s_j``, which the model computes the same (exact algebra), but moves
quantization error between activations and weights:

- AWQ (``quantize int4 method=awq``): ``s = x_mean^r / w_mean^(1-r)``, ``r`` searched on a grid
  of ``awq_grid`` points for the least output error of the layers rounded to int4 (AutoAWQ's
  "duo scaling"), then each layer's groups clipped to the shrink ratio (down to 0.5) with the
  least error of its partial outputs (AutoAWQ's ``auto_clip``; not for query/key projections).
- SmoothQuant (``quantize w8a8 smooth=ALPHA``): ``s = max|x|^α / max|W|^(1-α)``, so that the
  activations' outlier channels shrink before their per-token int8 rounding.

Where the division goes: into the module that produced the tensor, when it is a norm (its weight
and bias divided by ``s``) or a linear layer whose output the tensor is linear in (its rows
divided: ``up_proj`` before ``down_proj``, ``v_proj`` before ``o_proj`` without grouped heads).
Candidates are found from the block itself (the producer, or, for a tensor no module produced,
the two linear layers of its width just before the group), and a fold is kept only if the float
block computes the same output with it on the first sample (within float rounding): a layer whose
producer is nonlinear, shared with other readers, or a norm computing ``(1 + w) x`` is never scaled
wrongly.  The checks run the block, so the groups are checked together and split in halves only
where a check fails: a few runs per block (UNetSpatioTemporalConditionModel's SmoothQuant went
from 356 s to 23 s, one run per group and candidate before).
Groups with nowhere to fold keep ``s = 1`` (AWQ still clips them).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..transforms.common.modules import is_conv1d
from .sequential import Unit

#: Input rows kept per group for AWQ's searches (evenly spread over the samples).
AWQ_TOKENS = 1024
#: Input rows of AWQ's clipping search (AutoAWQ: 512).
CLIP_TOKENS = 512
#: The smallest shrink ratio of AWQ's clipping search (AutoAWQ's max_shrink 0.5).
MAX_SHRINK = 0.5
#: Layers AWQ does not clip: query and key projections (attention logits are sensitive to
#: clipping; AutoAWQ skips the same names).
NO_CLIP = ("q_proj", "k_proj", "query", "key", "to_q", "to_k", "q", "k", "wq", "wk")
#: Relative error of a block's output under which a fold counts as exact.
EXACT = {torch.float32: 1e-4, torch.float64: 1e-8}
EXACT_HALF = 2e-2
#: Linear layers tried, nearest first, for a group whose input no module produced.
FALLBACK_CANDIDATES = 2


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight.detach()
    return weight.t() if is_conv1d(type(module), module) else weight


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(type(module), module)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a - b‖ / ‖b‖`` of two :func:`_floats`."""
    if b.numel() == 0:  # a unit that returns no tensor (it writes its result elsewhere): nothing moved
        return 0.0
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _floats(output) -> torch.Tensor:
    """Every floating-point tensor of a unit's output (nested tuples, lists, dicts, model outputs), flat."""
    found: list[torch.Tensor] = []

    def walk(value, depth=0):
        if depth > 8:
            return
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.append(value.reshape(-1).float())
        elif hasattr(value, "to_tuple"):
            walk(value.to_tuple(), depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item, depth + 1)

    walk(output)
    return torch.cat(found) if found else torch.zeros(0)


class _Stats:
    """What one group's inputs look like: per channel mean and max of |x|, and a sample of rows."""

    def __init__(self, columns: int, rows_per_call: int, device):
        self.abs_sum = torch.zeros(columns, dtype=torch.float64, device=device)
        self.abs_max = torch.zeros(columns, dtype=torch.float32, device=device)
        self.count = 0
        self.rows_per_call = rows_per_call
        self.kept: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if not x.shape[0]:
            return
        magnitude = x.abs()
        self.abs_sum += magnitude.sum(0, dtype=torch.float64)
        self.abs_max = torch.maximum(self.abs_max, magnitude.amax(0))
        self.count += x.shape[0]
        if self.rows_per_call:
            stride = max(1, x.shape[0] // self.rows_per_call)
            self.kept.append(x[::stride][: self.rows_per_call].clone())

    @property
    def mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).float()

    def rows(self) -> torch.Tensor:
        return torch.cat(self.kept) if self.kept else torch.empty(0)


class _Folds:
    """Where each group's scales go, found and checked on the unit (see the module docstring)."""

    def __init__(self, unit: Unit, edit):
        self.unit = unit
        self.edit = edit

    def candidates(self, group) -> list[tuple[str, str]]:
        """``(path, kind)`` of modules the group's scales could be folded into, most likely first."""
        root = self.unit.root
        columns = _weight(root.get_submodule(group.paths[0])).shape[1]
        out = []
        if group.producer is not None and not group.other_readers:
            producer = root.get_submodule(group.producer)
            weight = getattr(producer, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.shape[0] == columns \
                    and weight.is_floating_point():
                out.append((group.producer, "norm"))
            elif _is_linear(producer) and _weight(producer).shape[0] == columns:
                out.append((group.producer, "rows"))
        if not out and group.producer is None:
            # The tensor came from no module (attention's output, before ``o_proj``): the linear layers
            # of its width just before the group, nearest first (``v_proj``).  Only a few: each one is
            # checked by running the unit, and a block of a UNet holds hundreds of layers.
            members = set(group.paths)
            prefix = self.unit.path + "." if self.unit.path else ""
            before = []
            for name, module in self.unit.module.named_modules():
                path = prefix + name
                if path == group.paths[0]:
                    break
                if name and path not in members and _is_linear(module) and _weight(module).shape[0] == columns \
                        and isinstance(module.weight, nn.Parameter) and module.weight.is_floating_point():
                    before.append((path, "rows"))
            out = before[::-1][:FALLBACK_CANDIDATES]
        return out

    def fold(self, path: str, kind: str, scales: torch.Tensor) -> None:
        """Divide ``path``'s output channels by ``scales`` (through the edit log)."""
        module = self.unit.root.get_submodule(path)
        self.edit.touch(module)
        weight = module.weight
        s = scales.to(weight.device)
        if kind == "norm":
            new = weight.detach().float() / s
        elif is_conv1d(type(module), module):
            new = weight.detach().float() / s[None, :]
        else:
            new = weight.detach().float() / s[:, None]
        self.edit.setattr(module, "weight", nn.Parameter(new.to(weight.dtype), requires_grad=weight.requires_grad))
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            self.edit.setattr(module, "bias", nn.Parameter((bias.detach().float() / s).to(bias.dtype),
                                                           requires_grad=bias.requires_grad))

    def scale_inputs(self, path: str, scales: torch.Tensor) -> None:
        """Multiply ``path``'s input channels by ``scales`` (its float weight, through the edit log)."""
        module = self.unit.root.get_submodule(path)
        weight = module.weight
        s = scales.to(weight.device)
        new = weight.detach().float() * (s[:, None] if is_conv1d(type(module), module) else s[None, :])
        self.edit.touch(module)
        self.edit.setattr(module, "weight", nn.Parameter(new.to(weight.dtype), requires_grad=weight.requires_grad))

    def tolerance(self) -> float:
        dtype = next((p.dtype for p in self.unit.module.parameters()), torch.float32)
        return EXACT.get(dtype, EXACT_HALF)

    def apply(self, plans: list[tuple[object, torch.Tensor]]) -> list[tuple[object, str | None]]:
        """Fold every group's scales where they keep the block exact; ``(group, where or None)``.

        Each check runs the unit, so groups are tried together in their likeliest places and split
        in halves only where a check fails (a few runs per block, not one per group and candidate)."""
        sample = self.unit.inputs[0]
        reference = _floats(self.unit.run(sample))  # flattened once: every check compares to it
        tolerance = self.tolerance()
        options = {id(group): self.candidates(group) for group, _ in plans}
        where: dict[int, str] = {}

        def exact() -> bool:
            return _relative(_floats(self.unit.run(sample)), reference) <= tolerance

        def attempt(batch: list[tuple[object, torch.Tensor, tuple[str, str]]]) -> bool:
            saved = [item for group, _, (path, _) in batch for item in self._save(group, path)]
            for group, scales, (path, kind) in batch:
                self.fold(path, kind, scales)
                for member in group.paths:
                    self.scale_inputs(member, scales)
            if exact():
                for group, _, (path, _) in batch:
                    where[id(group)] = path
                return True
            self._restore(saved)
            return False

        def settle(batch) -> None:
            places = [path for _, _, (path, _) in batch]
            if len(set(places)) == len(places) and attempt(batch):
                return
            if len(batch) > 1:
                middle = len(batch) // 2
                settle(batch[:middle])
                settle(batch[middle:])
                return
            group, scales, _ = batch[0]
            for place in options[id(group)][1:]:  # the likeliest place failed alone: the others, one by one
                if attempt([(group, scales, place)]):
                    return

        batch = [(group, scales, options[id(group)][0]) for group, scales in plans if options[id(group)]]
        if batch:
            settle(batch)
        return [(group, where.get(id(group))) for group, _ in plans]

    def _save(self, group, path: str) -> list[tuple[nn.Module, str, object]]:
        saved = []
        for name in (path, *group.paths):
            module = self.unit.root.get_submodule(name)
            for attr in ("weight", "bias"):
                saved.append((module, attr, module._parameters.get(attr)))
        return saved

    def _restore(self, saved) -> None:
        for module, attr, value in saved:
            if module._parameters.get(attr) is not value:
                self.edit.setattr(module, attr, value)


def _normalised(scales: torch.Tensor) -> torch.Tensor:
    scales = scales.clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


class _ScaleMethod:
    rows_per_sample = 0

    def __init__(self, transform, layers):
        self.transform = transform
        self.options = transform.options
        self.layers = layers
        self.stats: list[_Stats] = []

    def begin(self, unit: Unit) -> None:
        per_call = math.ceil(self.rows_per_sample / max(len(unit.inputs), 1)) if self.rows_per_sample else 0
        self.stats = []
        for group in unit.groups:
            weight = _weight(unit.root.get_submodule(group.paths[0]))
            self.stats.append(_Stats(weight.shape[1], per_call, weight.device))

    def observe(self, group: int, x: torch.Tensor) -> None:
        self.stats[group].add(x)


class AWQ(_ScaleMethod):
    """``quantize int4 method=awq``."""

    rows_per_sample = AWQ_TOKENS

    def __init__(self, transform, layers, grid_points: int = 20):
        super().__init__(transform, layers)
        self.grid_points = grid_points

    def finish(self, unit: Unit) -> None:
        root = unit.root
        plans = []
        searched = {}
        for group, stats in zip(unit.groups, self.stats):
            if not stats.count:
                continue
            weights = [_weight(root.get_submodule(p)).float() for p in group.paths]
            scales = self._search(weights, stats)
            searched[id(group)] = scales
            if scales is not None:
                plans.append((group, scales))
        folds = _Folds(unit, self.layers.ctx.edit).apply(plans)
        kept = {id(group): self._kept_scales(searched[id(group)]) for group, where in folds if where is not None}
        for group, stats in zip(unit.groups, self.stats):
            if not stats.count:
                for path in group.paths:
                    self.layers.rounded(path)
                    self.layers.notes.append(f"{path} read no calibration input; rounded to nearest")
                continue
            scales = kept.get(id(group))
            x = stats.rows()
            if scales is not None:
                x = x / scales
            for path in group.paths:
                weight = _weight(root.get_submodule(path)).float()  # already scaled if the fold was kept
                self._quantize(path, weight, x)
        self.stats = []

    @staticmethod
    def _kept_scales(scales):
        return scales

    def _search(self, weights: list[torch.Tensor], stats: _Stats) -> torch.Tensor | None:
        x = stats.rows()
        if not x.shape[0]:
            return None
        options = self.options
        gs = options.group_size
        joined = torch.cat(weights)
        grouped = joined.abs().reshape(joined.shape[0], -1, gs)
        w_mean = (grouped / grouped.amax(dim=2, keepdim=True).clamp(min=1e-6)).reshape(joined.shape).mean(0)
        x_mean = stats.mean
        reference = x @ joined.T
        best, best_loss = None, float("inf")
        for step in range(self.grid_points):
            ratio = step / self.grid_points
            scales = _normalised(x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4))
            scaled = joined * scales[None, :]
            grid = self.transform.calibration_grid(options, scaled)
            fake = grid.fake(scaled) / scales[None, :]
            loss = float((x @ fake.T - reference).pow(2).mean())
            if loss < best_loss:
                best, best_loss = (None if step == 0 else scales), loss
        return best

    def _quantize(self, path: str, weight: torch.Tensor, x: torch.Tensor) -> None:
        options = self.options
        name = path.rsplit(".", 1)[-1]
        if name in NO_CLIP or not x.shape[0]:
            grid = self.transform.calibration_grid(options, weight)
        else:
            low, high = self._clip(weight, x[:CLIP_TOKENS] if x.shape[0] > CLIP_TOKENS else x)
            grid = self.transform.calibration_grid(options, weight, low, high)
        self.layers.replace(path, grid, grid.fake(weight))

    def _clip(self, weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (row, group) ranges ``[low, high]`` clipped to the shrink ratio with the least error."""
        gs = self.options.group_size
        rows, cols = weight.shape
        w = weight.reshape(rows, -1, gs)
        xg = x.reshape(x.shape[0], -1, gs)
        low, high = w.amin(dim=2), w.amax(dim=2)
        amax = w.abs().amax(dim=2)
        best_low, best_high = low.clone(), high.clone()
        best_err = torch.full_like(amax, float("inf"))
        batch = max(1, (1 << 24) // max(x.shape[0] * cols, 1))
        for start in range(0, rows, batch):
            end = min(rows, start + batch)
            wb = w[start:end]
            original = torch.einsum("tgk,ogk->otg", xg, wb)
            for step in range(int(MAX_SHRINK * self.grid_points)):
                ratio = 1 - step / self.grid_points
                limit = amax[start:end] * ratio
                clipped_low = torch.maximum(low[start:end], -limit)
                clipped_high = torch.minimum(high[start:end], limit)
                grid = self.transform.calibration_grid(self.options, weight[start:end], clipped_low, clipped_high)
                fake = grid.fake(weight[start:end]).reshape(end - start, -1, gs)
                err = (torch.einsum("tgk,ogk->otg", xg, fake) - original).pow(2).mean(dim=1)
                better = err < best_err[start:end]
                best_err[start:end] = torch.where(better, err, best_err[start:end])
                best_low[start:end] = torch.where(better, clipped_low, best_low[start:end])
                best_high[start:end] = torch.where(better, clipped_high, best_high[start:end])
        return best_low, best_high


class SmoothQuant(_ScaleMethod):
    """``quantize w8a8 smooth=ALPHA`` (then GPTQ with ``method=gptq``, else rounded to nearest)."""

    def __init__(self, transform, layers, alpha: float, then=None):
        super().__init__(transform, layers)
        self.alpha = alpha
        self.then = then

    def begin(self, unit: Unit) -> None:
        super().begin(unit)
        if self.then is not None:
            self.then.begin(unit)

    def observe(self, group: int, x: torch.Tensor) -> None:
        super().observe(group, x)
        if self.then is not None:
            self.then.observe(group, x)

    def finish(self, unit: Unit) -> None:
        root = unit.root
        plans = []
        for group, stats in zip(unit.groups, self.stats):
            if not stats.count:
                continue
            joined = torch.cat([_weight(root.get_submodule(p)).float() for p in group.paths])
            w_max = joined.abs().amax(dim=0).clamp(min=1e-5)
            scales = (stats.abs_max.clamp(min=1e-5).pow(self.alpha) / w_max.pow(1 - self.alpha)).clamp(min=1e-5)
            plans.append((group, scales))
        folds = _Folds(unit, self.layers.ctx.edit).apply(plans)
        scaled = {id(group): scales for (group, scales), (_, where) in zip(plans, folds) if where is not None}
        if self.then is not None:
            self.then.finish(unit, scaled={index: scaled[id(group)] for index, group in enumerate(unit.groups)
                                           if id(group) in scaled})
        else:
            for group in unit.groups:
                for path in group.paths:
                    self.layers.rounded(path)
        self.stats = []
