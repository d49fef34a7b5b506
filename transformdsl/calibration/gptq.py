"""GPTQ (Frantar et al., 2022): round a weight column by column, each column's rounding error
spread over the columns not yet rounded, weighted by the inverse Hessian of the layer's inputs.

The algorithm of the reference implementation and of llm-compressor's ``quantize_weight``: the
grid's scales are fixed from the weight before any update (``static groups``: the saved format
has no per-column group index), a dead input channel (never non-zero) is zeroed, the Hessian
``H = 2/n Σ xᵀx`` is dampened by ``damp × mean(diag H)`` and inverted through Cholesky, and the
columns are processed ``block_size`` at a time with the error of a block applied to the rest at
once (the "lazy batch" update).  ``act_order`` processes columns by decreasing ``diag(H)``.  The
Hessian's part (dead channels, order, inverse factor) is computed once per input tensor and shared by
the layers that read it (:func:`factor`: q, k and v).

A Hessian that is not positive definite after dampening is dampened ten times more, up to
:data:`MAX_RETRIES` times (said in the result), never a crash; past that the layer is rounded to
nearest and the result says so.

>>> import torch
>>> from transformdsl.transforms.quantize.int8_weight_only import RowGrid
>>> w = torch.randn(8, 16); x = torch.randn(64, 16) @ torch.randn(16, 16)  # correlated inputs
>>> out = gptq(w, hessian(x), RowGrid(w))
>>> bool(((x @ out.weight.T - x @ w.T).norm() <= (x @ RowGrid(w).fake(w).T - x @ w.T).norm()))
True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from .shares import Share, TreeSum

#: How many times a Hessian that Cholesky refuses is dampened ten times more.
MAX_RETRIES = 4


class Grid(Protocol):
    """A weight's quantization grid with its scales fixed (``int4.GroupGrid``, ``RowGrid``)."""

    def fake_column(self, column: torch.Tensor, index: int) -> torch.Tensor: ...

    def fake(self, weight: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Result:
    #: The weight on the grid (float32, out x in): what the layer is built from.
    weight: torch.Tensor
    #: The dampening fraction that made the Hessian invertible (``damp`` unless retried).
    damp: float
    #: Whether Cholesky failed at every dampening and the layer was rounded to nearest.
    rounded: bool = False


class HessianAccumulator:
    """``2/n Σ xᵀx`` over the rows ``x`` of a layer's inputs (float32, in x in), summed in the canonical
    order of :mod:`~transformdsl.calibration.shares` (slice by slice, the slices as a tree), so that
    processes holding different samples sum to the same bytes one process does."""

    def __init__(self, columns: int, device: torch.device):
        self.columns = columns
        self.device = device
        self.sums = TreeSum()
        #: Input rows added in this process.
        self.rows = 0

    def add(self, x: torch.Tensor, part: int = 0) -> None:
        """Add the rows of ``x`` (an input of a sample of slice ``part``)."""
        x = x.reshape(-1, x.shape[-1]).float()
        if not x.shape[0]:
            return
        current = self.sums.current(part)
        if current is None:
            self.sums.start(part, x.T @ x)
        else:
            current.addmm_(x.T, x)
        self.rows += x.shape[0]

    def total(self, share: Share | None = None) -> tuple[torch.Tensor | None, int]:
        """``(Hessian, rows)`` over every process of ``share`` (collective when it has a group; None
        when no process added a row); the sums are handed over, so call it once."""
        share = share or Share.whole(1)
        rows = share.count_sum(self.rows)
        matrix = self.sums.total(share, (self.columns, self.columns), torch.float32)
        if matrix is None or not rows:
            return None, rows
        return matrix.mul_(2.0 / rows), rows


def hessian(x: torch.Tensor) -> torch.Tensor:
    """The Hessian of one batch of inputs (for tests and examples)."""
    accumulator = HessianAccumulator(x.shape[-1], x.device)
    accumulator.add(x)
    matrix, _ = accumulator.total()
    return matrix if matrix is not None else torch.zeros(x.shape[-1], x.shape[-1], device=x.device)


def _inverse_cholesky(h: torch.Tensor, damp: float) -> tuple[torch.Tensor | None, float]:
    diagonal = torch.arange(h.shape[0], device=h.device)
    mean = float(h.diagonal().mean()) or 1.0
    # Each intermediate is dropped as soon as the next exists: a 13824-wide layer's Hessian is 764 MB,
    # so holding them all would cost a few GB at the peak of a 13B model's convert.
    for attempt in range(MAX_RETRIES + 1):
        fraction = damp * (10 ** attempt) if damp > 0 else (0.01 * 10 ** (attempt - 1) if attempt else 0.0)
        damped = h.clone()
        damped[diagonal, diagonal] += fraction * mean
        factor, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            del factor
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            del inverse
            if int(info) == 0 and torch.isfinite(upper).all():
                return upper, fraction
    return None, damp


@dataclass
class Factor:
    """What GPTQ derives from a Hessian alone, shared by the layers that read one input (q, k and v)."""

    #: Input channels never non-zero (their weights are zeroed).
    dead: torch.Tensor
    #: The column order (``act_order``: by decreasing ``diag(H)``), or None for the weight's own.
    order: torch.Tensor | None
    #: The upper Cholesky factor of the dampened Hessian's inverse, or None where Cholesky failed.
    upper: torch.Tensor | None
    #: The dampening fraction used.
    damp: float


def factor(h: torch.Tensor, *, damp: float = 0.01, act_order: bool = False) -> Factor:
    """The Hessian's part of GPTQ (``h`` is not changed)."""
    h = h.detach().float().clone()
    dead = h.diagonal() == 0
    if dead.any():
        h[dead, dead] = 1.0
    order = torch.argsort(h.diagonal(), descending=True) if act_order else None
    if order is not None:
        h = h[order][:, order]
    upper, used = _inverse_cholesky(h, damp)
    return Factor(dead, order, upper, used)


def gptq(weight: torch.Tensor, h: torch.Tensor | None, grid: Grid, *, damp: float = 0.01, block_size: int = 128,
         act_order: bool = False, prepared: Factor | None = None) -> Result:
    """``weight`` (out x in) rounded onto ``grid`` by GPTQ with Hessian ``h`` (in x in), or with the
    ``prepared`` :func:`factor` of it (then ``h``, ``damp`` and ``act_order`` are not read); neither
    ``weight`` nor ``h`` is changed."""
    if prepared is None:
        prepared = factor(h, damp=damp, act_order=act_order)
    if prepared.upper is None:
        return Result(grid.fake(weight.detach().float()), prepared.damp, rounded=True)
    w = weight.detach().float().clone()
    if prepared.dead.any():
        w[:, prepared.dead] = 0.0
    order = prepared.order
    if order is not None:
        w = w[:, order]
    index = order.tolist() if order is not None else list(range(w.shape[1]))
    w = _rounded_columns(w, prepared.upper, grid, index, block_size)
    if order is not None:
        w = w[:, torch.argsort(order)]
    return Result(w.contiguous(), prepared.damp)


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread while rounding column by column: each step is a few small vector ops, which
    more threads only synchronise (measured 25x slower with two threads on a loaded 2-core machine:
    0.2 s against 5 s of CPU for a 1536 x 576 layer); the process's setting is put back after."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


#: Columns rounded one by one between two small matrix updates inside a block (a second level of GPTQ's
#: lazy batch): the rank-1 updates then touch at most this many columns.
SUB_BLOCK = 16


def _rounded_columns(w: torch.Tensor, upper: torch.Tensor, grid: Grid, index: list[int],
                     block_size: int) -> torch.Tensor:
    """GPTQ's loop over ``w``'s columns, ``block_size`` at a time; returns the rounded weight (out x in).

    The weight is held transposed, so a column is a contiguous row and every update a contiguous range;
    inside a block, columns are rounded ``SUB_BLOCK`` at a time with rank-1 updates, the rest of the block
    updated once per sub-block by a small matrix product (one thread), and the columns after the block by
    one matrix product with every thread.  3.5x faster than rank-1 updates over the whole block on a
    5120 x 5120 layer (5.7 s against 1.6 s, one thread); the same arithmetic, summed in another order.
    """
    wt = w.T.contiguous()
    del w
    columns = wt.shape[0]
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block = wt[start:end]
        errors = torch.empty_like(block)
        inverse = upper[start:end, start:end]
        width = end - start
        with single_thread():
            for first in range(0, width, SUB_BLOCK):
                last = min(first + SUB_BLOCK, width)
                for i in range(first, last):
                    column = block[i]
                    rounded = grid.fake_column(column, index[start + i])
                    error = (column - rounded) / inverse[i, i]
                    block[i] = rounded
                    if i + 1 < last:  # a rank-1 update in place: no temporary of the sub-block's size
                        block[i + 1:last].addr_(inverse[i, i + 1:last], error, alpha=-1.0)
                    errors[i] = error
                if last < width:
                    block[last:].addmm_(inverse[first:last, last:].T, errors[first:last], alpha=-1.0)
        if end < columns:
            wt[end:].addmm_(upper[start:end, end:].T, errors, alpha=-1.0)
    return wt.T
