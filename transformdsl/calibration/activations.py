"""Where the samples' activations wait between two blocks: in memory, or past a budget in a file.

Calibrating block by block keeps, for every sample, the inputs of the block being fitted (and, while
it runs, the next block's).  At 128 samples of 512 tokens a 5120-wide model's hidden states are
1.3 GB in float32 per set, more than a block of a 13B model in bf16: past the budget they leave
memory.  :meth:`ActivationStore.keep` writes the samples' large tensors into a private temporary
file (created unlinked: it has no name, and the system frees it once the last tensor mapping it is
gone, however the process ends) and hands back tensors memory-mapped from it, so the kernel pages
them in while a block reads them and may drop them again: memory then holds about one block and the
sample being run, not every sample's activations.  The values are the same bytes, so the fitted
layers are bit for bit those fitted in memory.

The budget (``calibrate ... activations=``): ``auto`` (the default) keeps a set in memory up to
:data:`AUTO_SHARE` of the machine's memory (at least :data:`AUTO_FLOOR`), ``memory`` always,
``disk`` never.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy
import torch

#: ``activations=`` values.
CHOICES = ("auto", "memory", "disk")
#: ``auto``: the share of the machine's memory a set of activations may take before it is spilled.
AUTO_SHARE = 1 / 8
#: ``auto``: never spill less than this.
AUTO_FLOOR = 256 << 20
#: Tensors smaller than this stay in memory (masks, positions: not worth a mapping each).
SMALL = 64 << 10
#: Offsets in the file are multiples of this (any dtype's alignment, and a cache line).
ALIGN = 64


def machine_memory() -> int:
    """Bytes of physical memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def budget_of(policy: str) -> float:
    """Bytes a set of activations may hold in memory under ``policy`` (``inf``: never spilled)."""
    if policy == "memory":
        return float("inf")
    if policy == "disk":
        return 0.0
    return max(AUTO_FLOOR, machine_memory() * AUTO_SHARE)


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _replace(value: Any, mapped: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return mapped.get(id(value), value)
    if isinstance(value, tuple):
        return tuple(_replace(v, mapped) for v in value)
    if isinstance(value, list):
        return [_replace(v, mapped) for v in value]
    if isinstance(value, dict):
        return {k: _replace(v, mapped) for k, v in value.items()}
    return value


class ActivationStore:
    """Keeps sets of samples' activations within ``policy``'s budget (module docstring)."""

    def __init__(self, policy: str = "auto"):
        if policy not in CHOICES:
            raise ValueError(f"activations={policy!r}: one of {', '.join(CHOICES)}")
        self.policy = policy
        self.budget = budget_of(policy)
        #: Bytes written to temporary files over the whole pass, and the largest set seen.
        self.spilled = 0
        self.largest = 0

    def keep(self, samples: list, of: int | None = None) -> list:
        """``samples`` (each ``(args, kwargs)``), their large CPU tensors in a temporary file when the
        set's bytes exceed the budget; tensors shared by several samples are written once.  ``of``:
        ``samples`` are the first of a set of ``of`` samples made one at a time (each spilled as it
        is made, so the set is never whole in memory), the set's bytes estimated from them."""
        unique: dict[int, torch.Tensor] = {}
        for sample in samples:
            for tensor in _tensors(sample):
                unique.setdefault(id(tensor), tensor)
        total = sum(t.numel() * t.element_size() for t in unique.values())
        if of is not None and samples:
            total = total * of // len(samples)
        self.largest = max(self.largest, total)
        if total <= self.budget:
            return samples
        large = [t for t in unique.values() if t.device.type == "cpu" and t.numel() * t.element_size() >= SMALL
                 and not t.requires_grad]
        if not large:
            return samples
        offsets, end = [], 0
        for tensor in large:
            offsets.append(end)
            end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        with tempfile.TemporaryFile(prefix="transformdsl-activations-") as handle:
            for tensor, offset in zip(large, offsets):
                handle.seek(offset)
                handle.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            handle.truncate(end)
            handle.flush()
            # the mapping keeps the (unlinked) file alive after the handle is closed
            mapped_file = numpy.memmap(handle, dtype=numpy.uint8, mode="r+", shape=(end,))
        mapped = {}
        for tensor, offset in zip(large, offsets):
            size = tensor.numel() * tensor.element_size()
            raw = torch.from_numpy(mapped_file[offset:offset + size])
            mapped[id(tensor)] = raw.view(tensor.dtype).reshape(tensor.shape)
        self.spilled += end
        return [_replace(sample, mapped) for sample in samples]

    def note(self) -> str | None:
        """What the pass did with the activations, for the run's notes (None: all stayed in memory)."""
        if not self.spilled:
            return None
        mib = 1 << 20
        why = "activations=disk" if self.policy == "disk" else \
            f"past the budget of {self.budget / mib:,.0f} MiB (activations={self.policy})"
        return (f"the samples' activations ({self.largest / mib:,.0f} MiB a set at most) waited between blocks in "
                f"an unlinked temporary file, {why}: {self.spilled / mib:,.0f} MiB written in all")
