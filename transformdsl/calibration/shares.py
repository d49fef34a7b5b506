"""Calibration samples split between processes (``convert --workers N``), and the statistics summed back.

A statement that learns from data carries its samples from block to block, so blocks cannot go to
different processes; the samples can.  Each process holds a contiguous :class:`Share` of them, runs
every block on its share, and the statistics a method fits on (GPTQ's Hessians) are summed over the
processes before the fit.  Every process then fits the same layers from the same sums.

Why a canonical order: float addition is not associative, so "sum over the samples" must name one
order for the result to be the same bytes whatever the split.  The samples are cut into
:data:`SLICES` contiguous slices, the same for any number of processes.  Within a slice the sum runs
sample after sample.  The slices' sums are combined as the leaves of a balanced binary tree.  A
process holds whole slices (whole subtrees where the split allows), so it can sum its subtrees
itself.  The tree is then completed from every process's subtrees in the same order one process
would use.  Memory: at most ``log2(SLICES) + 1`` partial sums per statistic at a time (four
matrices of a layer's input width, squared).

:class:`Share` with ``group=None`` is one process holding every sample: what ``transform`` and
one-process ``convert`` use, through the same code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TransformError

#: Contiguous slices the samples are cut into; at most this many processes share them.
SLICES = 8

#: ``(first slice, slices covered, sum)``: one node of the tree over the slices.
Node = tuple[int, int, torch.Tensor]


def bounds(total: int) -> list[int]:
    """The first sample of each slice (and ``total``): slice ``k`` is ``[b[k], b[k + 1])``, maybe empty."""
    return [k * total // SLICES for k in range(SLICES + 1)]


def split(total: int, processes: int) -> list[tuple[int, int]]:
    """``(first sample, count)`` of each process's share: whole slices, contiguous, in order; processes
    that would hold no sample are left out (so there may be fewer shares than ``processes``)."""
    edges = bounds(total)
    processes = max(1, min(processes, SLICES))
    shares = []
    for rank in range(processes):
        first, last = edges[rank * SLICES // processes], edges[(rank + 1) * SLICES // processes]
        if last > first:
            shares.append((first, last - first))
    return shares


@dataclass(frozen=True)
class Share:
    """The samples one process holds: ``count`` of them from sample ``first``, of ``total``; ``group``
    (a gloo process group of ``size`` processes, this one ``rank``) sums statistics with the others."""

    first: int
    count: int
    total: int
    group: Any = None
    rank: int = 0
    size: int = 1

    @classmethod
    def whole(cls, total: int) -> Share:
        """Every sample, in one process."""
        return cls(0, total, total)

    def slice_of(self, local: int) -> int:
        """The slice of this share's sample ``local`` (its index in the share)."""
        index = self.first + local
        return ((index + 1) * SLICES + self.total - 1) // self.total - 1

    # ------------------------------------------------------------------ collectives (every process, in order)

    def same(self, text: str, what: str) -> None:
        """Refuse, in every process, unless ``text`` is the same in all of them (``what`` it describes)."""
        if self.group is None:
            return
        digest = torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8).to(torch.int64)
        low, high = digest.clone(), digest.clone()
        self.group.allreduce([low], _op("MIN")).wait()
        self.group.allreduce([high], _op("MAX")).wait()
        if not torch.equal(low, high):
            raise TransformError(f"calibration across {self.size} processes: {what} differs between their samples "
                                 "(the model takes another path on some of them), so their statistics cannot be "
                                 "summed layer by layer: convert with one process (no --workers)")

    def count_sum(self, value: int) -> int:
        """``value`` summed over the processes (exact: integers)."""
        if self.group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        self.group.allreduce([tensor]).wait()
        return int(tensor.item())

    def gather(self, nodes: list[Node], shape: tuple[int, ...], dtype: torch.dtype) -> list[Node]:
        """Every process's nodes (each process's own, in rank order)."""
        if self.group is None:
            return list(nodes)
        gathered: list[Node] = []
        for root in range(self.size):
            mine = root == self.rank
            header = torch.tensor([len(nodes) if mine else 0], dtype=torch.int64)
            self._broadcast(header, root)
            for index in range(int(header.item())):
                where = torch.tensor(nodes[index][:2] if mine else (0, 0), dtype=torch.int64)
                matrix = nodes[index][2] if mine else torch.empty(shape, dtype=dtype)
                self._broadcast(where, root)
                self._broadcast(matrix, root)
                gathered.append((int(where[0]), int(where[1]), matrix))
        return gathered

    def deal(self, costs: list[float]) -> list[int]:
        """The process to do each of these jobs (the costliest first, each to the least loaded process;
        the same answer in every process); all 0 in one process."""
        loads = [0.0] * self.size
        owners = [0] * len(costs)
        for job in sorted(range(len(costs)), key=lambda job: -costs[job]):
            owners[job] = min(range(self.size), key=lambda rank: loads[rank])
            loads[owners[job]] += costs[job]
        return owners

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """``tensor`` as process ``root`` holds it, in every process (in place; collective)."""
        if self.group is not None:
            self._broadcast(tensor, root)

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = root
        self.group.broadcast([tensor], options).wait()


def _op(name: str):
    import torch.distributed as dist

    options = dist.AllreduceOptions()
    options.reduceOp = getattr(dist.ReduceOp, name)
    return options


class TreeSum:
    """A sum over slices in the canonical order (see the module's docstring): :meth:`add` the terms of
    each slice in sample order (:meth:`start` the first, add to :meth:`current` in place), slices in
    increasing order; :meth:`total` over every process."""

    def __init__(self) -> None:
        assert SLICES & (SLICES - 1) == 0, "the tree's leaves: a power of two"
        self.nodes: list[list] = []  # [first slice, width, sum]: complete subtrees, then the open slice

    def current(self, part: int) -> torch.Tensor | None:
        """Slice ``part``'s sum so far, to add to in place, or None if the slice has no term yet."""
        if self.nodes and self.nodes[-1][0] == part and self.nodes[-1][1] == 1:
            return self.nodes[-1][2]
        return None

    def start(self, part: int, term: torch.Tensor) -> None:
        """Slice ``part``'s first term (slices start in increasing order)."""
        self._settle()
        self.nodes.append([part, 1, term])

    def _settle(self) -> None:
        """Join the last two nodes while they are the two halves of one subtree."""
        while len(self.nodes) >= 2:
            (a, width, left), (b, other, right) = self.nodes[-2], self.nodes[-1]
            if width != other or b != a + width or a % (2 * width):
                break
            left.add_(right)
            self.nodes[-2:] = [[a, 2 * width, left]]

    def total(self, share: Share, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The sum over every process's slices (collective when ``share`` has a group), or None if empty."""
        self._settle()
        nodes = {(a, width): value for a, width, value in
                 share.gather([tuple(node) for node in self.nodes], shape, dtype)}
        self.nodes = []

        def value(first: int, width: int) -> torch.Tensor | None:
            if (first, width) in nodes:
                return nodes.pop((first, width))
            if width == 1 or first >= SLICES:
                return None
            left, right = value(first, width // 2), value(first + width // 2, width // 2)
            if left is None or right is None:
                return right if left is None else left
            return left.add_(right)

        return value(0, SLICES)
