"""Tensor-parallel loading over ``torch.distributed``: every rank loads the save, keeps its shards, and
the sharded layers' forwards exchange what they must (spec.md "Past one device").

Each rank (``torchrun --nproc-per-node N``, or processes that called ``init_process_group``) loads the
whole save memory-mapped (nothing is read twice into memory: the pages are the file's), resolves the
plan (:mod:`.layout`), replaces each planned layer with its shard (:mod:`.shards`) and wraps its
``forward`` the way transformers' styles do in inference (local tensors, no DTensor):

- ``colwise``: the input is replicated, the output is this rank's features (the next layer, a
  ``rowwise`` one, reads them as they are); ``colwise_gather_output``/``colwise_rep``: the features of
  all ranks are gathered (``all_gather``) into the full output;
- ``rowwise``: the input is this rank's features; the partial outputs are summed (``all_reduce``) and
  the bias is added once; a ``quantize w8a8`` shard first takes each token's amax over all ranks
  (``all_reduce(MAX)``), so it rounds with the whole row's scale; ``rowwise_rep``: the input is
  replicated and sliced first;
- ``embedding_rowwise``: each rank looks up the ids in its rows of the table, zeros for the others,
  and the lookups are summed.

Inputs must be the same on every rank.  The collectives carry no autograd (inference).  Loading ends
with one exchange between the ranks: if any rank failed (a refused layer, an unreadable file, any
error), every rank raises a :class:`LoadError` with that rank's message; a rank that does not answer
within the process group's timeout (:data:`TIMEOUT` when this module starts the group) ends the others
with a :class:`LoadError` too, never a hang.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import LoadError, TransformError
from . import shards
from .layout import Placement, describe

#: The process group's timeout when :func:`load_tensor_parallel` starts it (torchrun's environment):
#: any collective, the end-of-load exchange included, fails after this long instead of waiting forever.
TIMEOUT = timedelta(minutes=10)
#: What torchrun sets and ``init_process_group("env://")`` reads.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TensorParallel:
    """What a tensor-parallel load did, kept on the model as ``model.tensor_parallel``."""

    rank: int
    world_size: int
    placements: tuple[Placement, ...]

    def describe(self) -> str:
        """The plan: one line per layer (style, kind, this rank's share)."""
        return "\n".join(p.describe() for p in self.placements)


def requested(tp_plan: Any, distributed_config: Any) -> str | dict:
    """The plan asked for with ``tp_plan=`` or transformers' ``DistributedConfig(tp_plan=..., tp_size=...)``."""
    if distributed_config is None:
        return tp_plan
    if tp_plan is not None:
        raise LoadError("load(tp_plan=..., distributed_config=...): give one (the config's tp_plan is the plan)")
    for name in ("dp_size", "pp_size", "ep_size", "fsdp_size", "dp_replicate_size"):
        if (getattr(distributed_config, name, None) or 1) > 1:
            raise LoadError(f"load(distributed_config=...): {name}={getattr(distributed_config, name)}: "
                            "transformdsl loads tensor-parallel only (tp_size, tp_plan)")
    size = getattr(distributed_config, "tp_size", None)
    if size is not None and dist.is_initialized() and size != dist.get_world_size():
        raise LoadError(f"load(distributed_config=...): tp_size={size}, but the process group has "
                        f"{dist.get_world_size()} ranks: tensor parallelism spans every rank")
    return getattr(distributed_config, "tp_plan", None) or "auto"


def process_group(device: str | torch.device | None) -> tuple[torch.device, int, int]:
    """``(this rank's device, rank, world size)``, starting the default process group from torchrun's
    environment when none is running (gloo on CPUs, NCCL for CUDA)."""
    if not dist.is_available():
        raise LoadError("load(tp_plan=...): this torch has no torch.distributed")
    kind = torch.device(device).type if device is not None else None
    if not dist.is_initialized():
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise LoadError(f"load(tp_plan=...): torch.distributed is not running and {', '.join(missing)} "
                            "are not set: run the script with `torchrun --nproc-per-node N script.py`, or call "
                            "torch.distributed.init_process_group first")
        if kind is None:
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            if kind == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if kind == "cuda" else "gloo", timeout=TIMEOUT)
        except (RuntimeError, ValueError) as exc:
            raise LoadError(f"load(tp_plan=...): cannot start torch.distributed: {exc}") from None
    if kind is None:
        kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if kind == "cuda":
        index = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
        return torch.device("cuda", index), dist.get_rank(), dist.get_world_size()
    if kind != "cpu":
        raise LoadError(f"load(tp_plan=..., device={device!r}): tensor parallelism runs on 'cpu' (gloo) or "
                        "'cuda' (NCCL, one GPU per rank)")
    return torch.device("cpu"), dist.get_rank(), dist.get_world_size()


def load_tensor_parallel(load: Callable[[torch.device], Any], tp_plan: Any = None, distributed_config: Any = None,
                         device: str | torch.device | None = None) -> nn.Module:
    """Load with ``load(torch.device("cpu"))`` in every rank, shard by the plan, move to this rank's device.

    Every rank returns its model or raises the same :class:`LoadError` (see the module docstring).
    """
    target, rank, world = process_group(device)
    plan = requested(tp_plan, distributed_config)
    model, error = None, None
    try:
        model = load(torch.device("cpu"))
        if not isinstance(model, nn.Module):
            raise LoadError("load(tp_plan=...): this save is a pipeline: load it without tp_plan (tensor "
                            "parallelism shards one model)")
        if world > 1:
            placements = describe(model, world, plan, rank)
            for placement in placements:
                install(model, placement, dist.group.WORLD)
            model.tensor_parallel = TensorParallel(rank, world, tuple(placements))
        model.to(target)
    except Exception as exc:  # every failure is told to the other ranks first
        error = exc
    agree(error, rank, world, target)
    return model


def agree(error: BaseException | None, rank: int, world: int, device: torch.device | None = None) -> None:
    """Tell every rank whether this one failed; raise the same :class:`LoadError` in all if any did.

    The messages travel as UTF-8 bytes in tensors on ``device`` (NCCL exchanges GPU tensors only;
    nothing is pickled)."""
    device = torch.device("cpu") if device is None else device
    if world == 1:
        if error is not None:
            raise error
        return
    mine = b"" if error is None else _message(error).encode("utf-8", "replace")
    try:
        lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(lengths, torch.tensor([len(mine)], dtype=torch.int64, device=device))
        sizes = [int(n) for n in lengths]
        answers = []
        if max(sizes):
            padded = torch.zeros(max(sizes), dtype=torch.uint8)
            if mine:
                padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            gathered = [torch.zeros(max(sizes), dtype=torch.uint8, device=device) for _ in range(world)]
            dist.all_gather(gathered, padded.to(device))
            answers = [bytes(g[:n].tolist()).decode("utf-8", "replace") for g, n in zip(gathered, sizes)]
    except RuntimeError as exc:  # torch.distributed's errors derive from it
        raise LoadError(f"load(tp_plan=...): rank {rank} heard nothing back from the other ranks ({exc}): another "
                        "rank failed before the end of its load or stopped answering") from error
    failed = {r: text for r, text in enumerate(answers) if text}
    if not failed:
        return
    texts = set(failed.values())
    if len(texts) == 1 and len(failed) == world:
        message = texts.pop()
    else:
        message = "tensor-parallel load failed on " + "; ".join(f"rank {r}: {t}" for r, t in failed.items())
    raise LoadError(message) from error


def _message(error: BaseException) -> str:
    return str(error) if isinstance(error, TransformError) else f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------- sharded forwards


def install(model: nn.Module, placement: Placement, group: Any) -> None:
    """Put ``placement``'s shard of its layer in place, with the collectives its forward needs."""
    if placement.axis == "replicated":
        return
    parent_path, _, name = placement.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    layer = parent.get_submodule(name)
    if placement.axis == "rows":
        local = shards.rows(layer, placement.ranges)
        if placement.fused_split is not None:
            parent.qkv_split = placement.fused_split
        if placement.gather:
            _gather_output(local, group, placement.world)
    elif placement.axis == "columns":
        local, bias = shards.columns(layer, placement.ranges)
        _reduce_output(local, bias, placement, group)
    else:
        local = shards.vocabulary(layer, *placement.ranges[0])
        _masked_lookup(local, placement.ranges[0], group)
    setattr(parent, name, local)


def _gather_output(layer: nn.Module, group: Any, world: int) -> None:
    forward = layer.forward

    def gathered(*args, **kwargs):
        out = forward(*args, **kwargs).contiguous()
        pieces = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(pieces, out, group=group)
        return torch.cat(pieces, dim=-1)

    layer.forward = gathered


def _reduce_output(layer: nn.Module, bias: torch.Tensor | None, placement: Placement, group: Any) -> None:
    has_bias = bias is not None
    if has_bias:
        layer.register_buffer("parallel_bias", bias, persistent=False)  # follows .to(); added once, after the sum
    if isinstance(layer, shards.Int8DynamicLinear):
        def whole_row_amax(amax: torch.Tensor) -> None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)

        layer.reduce_amax = whole_row_amax
    start, end = placement.ranges[0]
    forward = layer.forward

    def reduced(x, *args, **kwargs):
        if placement.split_input:
            x = x[..., start:end]
        out = forward(x, *args, **kwargs).contiguous()
        dist.all_reduce(out, group=group)
        return out + layer.parallel_bias.to(out.dtype) if has_bias else out

    layer.forward = reduced


def _masked_lookup(layer: nn.Module, rows: tuple[int, int], group: Any) -> None:
    start, end = rows
    forward = layer.forward

    def looked_up(ids, *args, **kwargs):
        outside = (ids < start) | (ids >= end)
        out = forward((ids - start).masked_fill(outside, 0), *args, **kwargs)
        out = out.masked_fill(outside.unsqueeze(-1), 0).contiguous()
        dist.all_reduce(out, group=group)
        return out

    layer.forward = looked_up
