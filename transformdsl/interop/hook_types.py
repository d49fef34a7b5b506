"""The types a transform's interchange hooks receive (``Transform.export``, ``Transform.import_checkpoint``).

:class:`Exported` is a module on its way into a library's layout (:mod:`.export` fills it, each applied
step's ``export`` carries itself into it); :class:`Headers` is a library checkpoint's tensor names, files
and shapes, read once (:mod:`.imports`).  This module imports nothing of transformdsl but the errors, so
that :mod:`transformdsl.extend`, the ground floor a plugin is written against, can name them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TransformError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from ..history import AppliedStep


@dataclass
class Exported:
    """A module in a library's layout: what goes in its files, and how to get ours back.

    Each applied step's transform carries itself into it (``Transform.export``): it renames or splits
    tensors (recording how in ``layout``), adds ``notes``, names fused layers by their sources
    (``renames``), or asks for the checkpoint's one ``quantization_config`` (``quantization``)."""

    library: str
    #: The ``format=`` asked for (``"compressed-tensors"`` is a transformers layout).
    fmt: str
    tensors: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]
    config: dict
    layout: list[dict] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Tensors held as plain module attributes (``plain_tensors.py``): in ``extra``, not buffers.
    attributes: dict = field(default_factory=dict)
    #: Fused layer path → the source layers it is written back as.
    renames: dict[str, list[str]] = field(default_factory=dict)
    #: What asks for the quantization_config (one group per checkpoint).
    quantization: list[QuantizationExport] = field(default_factory=list)

    @staticmethod
    def where(step: AppliedStep) -> str:
        """How messages name a step: ``line 2: 'quantize nf4'``."""
        return f"line {step.line}: '{step.statement}'"

    def refuse(self, step: AppliedStep, why: str, fix: str = "save with format='transformdsl'") -> TransformError:
        """The error for a step this format cannot carry."""
        return TransformError(f"format={self.fmt!r} cannot carry {self.where(step)}: {why}; {fix}")


@dataclass
class QuantizationExport:
    """A quantizing step's part of the checkpoint's ``quantization_config``: steps of one ``group``
    share a config; two groups cannot be written (a checkpoint has one)."""

    #: How the error names it (``"quantize int8"``, ``"fp8"``).
    kind: str
    #: Steps of equal groups combine.
    group: tuple
    #: The quantized layers, in our layout.
    paths: set[str]
    #: Whether the library's loader would convert GPT-2's Conv1D layers for this kind.
    conv1d: bool
    #: ``config(out, module, layers, quantized) -> dict``: the ``quantization_config`` (may rename tensors
    #: in ``out``); ``layers``: the layers the loader converts unless skipped, ``quantized``: those to convert.
    config: Callable[[Exported, nn.Module, set[str], set[str]], dict]
    #: What the transform keeps for ``config`` (e.g. several fp8 steps' records).
    steps: list = field(default_factory=list)


class Located(type(Path())):
    """A weights file's path (in messages) that also knows where to read it: ``source``, the
    descriptor path of the file opened through the save's folder (:mod:`transformdsl.persist.savedir`)."""

    source: str = ""


class Headers(dict):
    """Saved tensor name → its file (:class:`Located`); ``info``: name → (dtype, shape), from
    the headers, each parsed once (a header lists every tensor: parsing it per layer made an
    import of 3,000 layers take 77 s)."""

    info: dict[str, tuple[str, list[int]]]
