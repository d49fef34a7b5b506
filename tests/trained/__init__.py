"""A small language model trained here (``train.py``) and the held-out text it never saw.

``model/``: a 4-layer Llama (hidden 128, vocabulary = the 256 byte values) trained for minutes on the
Python Language Reference (``pydoc_data.topics``), saved in bfloat16; ``heldout.txt``: 16 KiB of
topics it was not trained on.  Its weights and activations have the structure trained models have and
random ones lack (outlier channels, confident predictions: ``train.py`` prints both), which is what
the numerical guard's bounds are calibrated on (tests/test_verification.py, benchmarks/bench_verify.py).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "model"
HELDOUT = HERE / "heldout.txt"


def load_model(dtype=None):
    """The trained model in float32 (or ``dtype``), eval mode."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(MODEL_DIR, dtype=dtype or torch.float32, attn_implementation="sdpa")
    return model.eval()


def encode(text: str) -> list[int]:
    """The tokenizer: UTF-8 bytes."""
    return list(text.encode())


def heldout_ids():
    """The held-out text as one row of token ids, ``(1, n)``."""
    import torch

    return torch.tensor([encode(HELDOUT.read_text())], dtype=torch.long)


def text_inputs(tokens: int, offset: int = 0, batch: int = 1) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``batch`` rows of ``tokens`` held-out tokens each, from ``offset`` on
    (consecutive windows): what ``transform(..., verify_inputs=...)`` takes."""
    ids = heldout_ids()[0]
    if offset + tokens * batch > len(ids):
        raise ValueError(f"{batch} x {tokens} tokens from {offset} do not fit the {len(ids)} held-out tokens")
    rows = ids[offset: offset + tokens * batch].view(batch, tokens)
    return (rows,), {"use_cache": False}
