"""Quantization that learns from calibration data: ``method=gptq``, ``method=awq``, ``smooth=ALPHA``.

The statement's targets are fitted block by block (:func:`transformdsl.calibration.sequential.calibrate`)
on ``ctx.calibration``; each layer ends up in the mode's own format (the same layer class, state
dict and record as ``method=rtn``), so ``load``, ``device_map``, exports and the packed kernels see
no difference, and a save reloads bit-exactly without the data.  Every change goes through the
edit log: a failure or Ctrl-C at any block leaves the model as it was.

- GPTQ (:mod:`transformdsl.calibration.gptq`): each layer's Hessian from its inputs (one per
  input tensor: ``q_proj``, ``k_proj``, ``v_proj`` share theirs), then column-by-column rounding.
- AWQ and SmoothQuant (:mod:`transformdsl.calibration.scales`): per-input-channel scales folded
  into the module that produced the layers' input (a norm's weight, or the rows of a linear layer
  whose output is read linearly), checked exactly on the block's output before they are kept.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import TransformError
from ...extend import ApplyContext
from .weights import float_weight, state_bytes


class _Layers:
    """Builds each fitted layer in the statement's format and keeps its record entry."""

    def __init__(self, transform, ctx: ApplyContext):
        self.transform = transform
        self.ctx = ctx
        self.backend = transform.backend(transform.options)
        self.entries: dict[str, dict] = {}
        self.before = self.after = 0
        self.notes: list[str] = []

    def replace(self, path: str, grid, weight: torch.Tensor) -> None:
        old = self.ctx.root.get_submodule(path)
        original, bias = float_weight(old)
        new = self.transform.build_on_grid(self.backend, self.transform.options, grid, weight, bias, original.dtype)
        new.train(old.training)
        self.entries[path] = self.transform.describe(path, old, original, bias, new)
        self.before += state_bytes(old)
        self.after += state_bytes(new)
        self.ctx.edit.replace(self.ctx.root, path, new)

    def rounded(self, path: str, weight: torch.Tensor | None = None) -> None:
        """A layer rounded to nearest (``weight``: a float weight to round instead of its own)."""
        old = self.ctx.root.get_submodule(path)
        original, _ = float_weight(old)
        source = (original if weight is None else weight).float()
        self.replace(path, self.transform.calibration_grid(self.transform.options, source), source)


def apply_calibrated(transform, ctx: ApplyContext, targets: list[str]) -> dict:
    """``apply`` of a quantize statement whose options learn from data (its record as ``rtn``'s)."""
    from ...calibration.sequential import calibrate

    data = ctx.calibration
    if data is None:  # the plan and the executor refuse this before anything runs; a plugin may not
        from ...calibration import missing_data_message

        raise TransformError(missing_data_message(transform))
    layers = _Layers(transform, ctx)
    method = _method(transform, layers)
    report = calibrate(ctx.root, targets, data.samples, method, progress=ctx.progress,
                       desc=f"{transform.key()} {getattr(transform.options, 'method', '')}".strip(),
                       activations=data.activations)
    for path in targets:  # a target the pass never reached (it ran on no sample): to nearest, said
        if path not in layers.entries:
            layers.rounded(path)
            layers.notes.append(f"{path} read no calibration input; rounded to nearest")
    ctx.notes.setdefault("calibration", []).extend(report.notes + layers.notes)
    return {"layers": [layers.entries[p] for p in targets], "bytes_before": layers.before,
            "bytes_after": layers.after}


def apply_calibrated_blocks(transform, ctx: ApplyContext, targets: list[str], stream, blocks: list[str]) -> dict:
    """``apply`` of a calibrated quantize statement on the ``targets`` of ``blocks`` (loaded, in
    order), the samples' inputs carried by ``stream`` (a
    :class:`~transformdsl.calibration.sequential.BlockStream`): what ``convert`` runs per unit,
    whose records :meth:`~transformdsl.extend.Transform.merge_records` joins into ``apply``'s."""
    layers = _Layers(transform, ctx)
    for block in blocks:
        stream.advance(block, lambda: _method(transform, layers))
    for path in targets:
        if path not in layers.entries:
            layers.rounded(path)
            layers.notes.append(f"{path} read no calibration input; rounded to nearest")
    ctx.notes.setdefault("calibration", []).extend(layers.notes)
    return {"layers": [layers.entries[p] for p in targets], "bytes_before": layers.before,
            "bytes_after": layers.after}


def _method(transform, layers: _Layers):
    options = transform.options
    smooth = getattr(options, "smooth", 0.0)
    if options.method == "awq":
        from ...calibration.scales import AWQ

        return AWQ(transform, layers, options.awq_grid)
    fit = GPTQ(transform, layers) if options.method == "gptq" else None
    if smooth:
        from ...calibration.scales import SmoothQuant

        return SmoothQuant(transform, layers, smooth, then=fit)
    return fit


class GPTQ:
    """GPTQ over a unit: a Hessian per input tensor, then each member rounded column by column."""

    def __init__(self, transform, layers: _Layers):
        self.transform = transform
        self.options = transform.options
        self.layers = layers
        self.hessians: list[Any] = []

    def begin(self, unit) -> None:
        from ...calibration.gptq import HessianAccumulator

        self.unit = unit
        self.hessians = []
        for group in unit.groups:
            module = unit.root.get_submodule(group.paths[0])
            columns = float_weight(module)[0].shape[1]
            device = float_weight(module)[0].device
            self.hessians.append(HessianAccumulator(columns, device))

    def observe(self, group: int, x: torch.Tensor) -> None:
        self.hessians[group].add(x, self.unit.part)

    def finish(self, unit, weights: dict[str, torch.Tensor] | None = None,
               scaled: dict[int, torch.Tensor] | None = None) -> None:
        """Round the unit's members (``weights``: float weights to round instead of their own;
        ``scaled``: per group index, the scales ``s`` its input was divided by (SmoothQuant), whose
        Hessian is then ``S^-1 H S^-1``).

        With processes sharing the samples (``convert --workers N``), the Hessians are summed over them
        first; then each member is rounded by one of them (the members dealt out by their cost) and
        its rounded weight sent to the others, so that every process replaces every member with the
        same bytes, in the same order as one process."""
        share = unit.share
        hessians = []
        for index, accumulator in enumerate(self.hessians):
            hessian, _ = accumulator.total(share)  # in every process sharing the samples, in group order
            if hessian is not None and index in (scaled or {}):
                inverse = (1.0 / scaled[index]).to(hessian.device)
                hessian = hessian * inverse[:, None] * inverse[None, :]
            hessians.append(hessian)
        self.hessians = []
        members = [(index, path) for index, group in enumerate(unit.groups) for path in group.paths
                   if hessians[index] is not None]
        weight_of = lambda path: self._weight(unit, path, weights)  # noqa: E731 - read where it is needed
        owners = dict(zip(members, share.deal([_cost(unit, path) for _, path in members])))
        factors: dict[int, Any] = {}  # one factor of a Hessian for every member that reads it (q, k and v)
        # more than one process: this one's members first, so that the processes round theirs at once
        held = {member: self._round(hessians, factors, member, weight_of(member[1]))
                for member in members if share.size > 1 and owners[member] == share.rank}
        factors.clear()
        for index, group in enumerate(unit.groups):
            factors.pop(index - 1, None)  # a factor is as large as its Hessian (764 MB for a 13824-wide input)
            for path in group.paths:
                weight = weight_of(path)
                if hessians[index] is None:
                    self.layers.rounded(path, weight)
                    self.layers.notes.append(f"{path} read no calibration input; rounded to nearest")
                    continue
                member = (index, path)
                if member in held:
                    result, grid = held.pop(member)
                elif owners[member] == share.rank:
                    result, grid = self._round(hessians, factors, member, weight)
                else:
                    result, grid = None, self.transform.calibration_grid(self.options, weight)
                if share.size > 1:
                    result = _exchanged(share, result, owners[member], weight.shape)
                if result.rounded:
                    self.layers.notes.append(f"{path}: its Hessian is not positive definite even dampened "
                                             f"{result.damp:g}; rounded to nearest")
                elif result.damp != self.options.damp:
                    self.layers.notes.append(f"{path}: its Hessian needed damp={result.damp:g} (not "
                                             f"{self.options.damp:g}) to be positive definite")
                self.layers.replace(path, grid, result.weight)

    def _weight(self, unit, path: str, weights: dict[str, torch.Tensor] | None) -> torch.Tensor:
        weight = (weights or {}).get(path)
        return weight if weight is not None else float_weight(unit.root.get_submodule(path))[0].float()

    def _round(self, hessians: list, factors: dict, member: tuple[int, str], weight: torch.Tensor):
        """``(GPTQ's result, the grid)`` for one member (its group's factor made on first use)."""
        from ...calibration.gptq import factor, gptq

        index, _ = member
        if index not in factors:
            factors[index] = factor(hessians[index], damp=self.options.damp, act_order=self.options.act_order)
        grid = self.transform.calibration_grid(self.options, weight)
        return gptq(weight, None, grid, block_size=self.options.block_size, prepared=factors[index]), grid


def _cost(unit, path: str) -> float:
    """GPTQ's work on a member, roughly: the lazy updates touch ``out x in`` once per column."""
    out, columns = float_weight(unit.root.get_submodule(path))[0].shape
    return float(out) * columns * columns


def _exchanged(share, result, owner: int, shape) -> Any:
    """``result`` (a GPTQ :class:`~transformdsl.calibration.gptq.Result`, in process ``owner``) in every
    process sharing the samples."""
    from ...calibration.gptq import Result

    mine = owner == share.rank
    weight = result.weight.contiguous() if mine else torch.empty(tuple(shape), dtype=torch.float32)
    flags = torch.tensor([result.damp, float(result.rounded)] if mine else [0.0, 0.0], dtype=torch.float64)
    share.broadcast(weight, owner)
    share.broadcast(flags, owner)
    return Result(weight, float(flags[0]), bool(flags[1]))


def module_weight(module: nn.Module) -> torch.Tensor:
    """A linear layer's float weight as (out, in) (GPT-2's Conv1D transposed): a view."""
    return float_weight(module)[0]
