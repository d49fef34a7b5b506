"""A linear layer whose weight is cast per call, cast and multiplied a block of rows at a time.

Weight-only int8 and ``fp8 storage`` keep a compressed weight and cast it to the compute dtype
at every call.  Cast whole, a large weight's float copy is a fresh mapping of memory each time
(glibc serves allocations over 32 MiB with ``mmap`` and gives them back when freed), faulted in
page by page, then read back by the matmul: at width 3072 with few tokens that costs more than
the matmul.  Block by block, a buffer that stays in cache is cast into and multiplied at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Float copies of a weight from this size on go block by block (in eager mode, on the CPU).
BLOCKED_BYTES = 32 << 20
#: Bytes of weight cast at a time.
BLOCK_BYTES = 4 << 20
#: Above this many rows of input the matmul outweighs the cast: one copy, one matmul.
BLOCKED_MAX_ROWS = 1024


def by_blocks(x: torch.Tensor, out_features: int, dtype: torch.dtype, threshold: int | None = None,
              bias: torch.Tensor | None = None) -> bool:
    """Whether a call with input ``x`` on a weight of ``out_features`` rows cast to ``dtype`` goes
    block by block (``threshold``: bytes of the cast weight from which it does, default
    :data:`BLOCKED_BYTES`).  Not where autograd records the call (``out=`` products are not
    differentiable): the whole cast then, as before."""
    if not isinstance(x, torch.Tensor):  # a torch.fx proxy: the traced graph keeps the plain cast
        return False
    in_features = x.shape[-1]
    rows = x.numel() // max(in_features, 1)
    limit = BLOCKED_BYTES if threshold is None else threshold
    recorded = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    return (x.device.type == "cpu" and not torch.compiler.is_compiling() and not recorded
            and rows <= BLOCKED_MAX_ROWS and out_features * in_features * dtype.itemsize >= limit)


def linear_by_blocks(x: torch.Tensor, out_features: int, dtype: torch.dtype,
                     cast: Callable[[int, int, torch.Tensor | None], torch.Tensor],
                     bias: torch.Tensor | None = None, buffered: bool = True) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in ``dtype``, row-major, ``W`` given block by block: ``cast(start, end,
    buffer)`` returns rows ``start:end`` of ``W`` in ``dtype`` (into ``buffer``, or with
    ``buffered=False`` a block of its own: ``buffer`` is None)."""
    in_features = x.shape[-1]
    rows = x.numel() // max(in_features, 1)
    step = max(16, BLOCK_BYTES // (in_features * dtype.itemsize))
    inputs = x.reshape(rows, in_features).to(dtype).t()
    out = torch.empty(out_features, rows, dtype=dtype, device=x.device)  # transposed: a block is rows of it
    buffer = torch.empty(min(step, out_features), in_features, dtype=dtype, device=x.device) if buffered else None
    for start in range(0, out_features, step):
        end = min(start + step, out_features)
        block = cast(start, end, None if buffer is None else buffer[:end - start])
        if bias is None:
            torch.mm(block, inputs, out=out[start:end])
        else:
            torch.addmm(bias[start:end, None], block, inputs, out=out[start:end])
    return out.t().contiguous().reshape(*x.shape[:-1], out_features)  # row-major, as F.linear's
