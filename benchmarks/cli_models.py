"""A plain torch model for ``bench_cli.py``: ``--model benchmarks.cli_models:mlp`` (no model library)."""

from __future__ import annotations

from torch import nn


def mlp() -> nn.Module:
    """Two Linear layers around a LayerNorm (what ``quantize int8`` plans against)."""
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 64)).eval()
