"""How a transformers language model's checkpoint and a GGUF file (llama.cpp's) name the same things.

One :class:`Architecture` per model family GGUF export and import cover: the GGUF architecture name,
the transformers class, which ``config`` fields become which GGUF metadata keys, and whether the
query/key projections are stored with llama.cpp's rotary row order (``convert_hf_to_gguf.py``
permutes Llama's and Mistral's; transformers' GGUF loader undoes it).  Tensor names come from the
``gguf`` package's own table (``gguf.get_tensor_name_map``), the one llama.cpp's converter and
transformers' loader use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Architecture:
    """One model family as GGUF writes it."""

    #: ``general.architecture`` (and the prefix of its metadata keys).
    gguf: str
    #: transformers' ``config.model_type``.
    model_type: str
    #: transformers' class for a causal LM of this family.
    hf_class: str
    #: Whether ``attn_q``/``attn_k`` rows are in llama.cpp's rotary order (see :func:`permute_rows`).
    permuted_qk: bool
    #: Config fields that must be false (llama.cpp's graph for the family has no such tensors).
    no_bias: tuple[str, ...] = ()
    #: The head width transformers' GGUF loader builds the family with: ``"metadata"`` (it reads
    #: ``rope.dimension_count``), ``"width"`` (``hidden_size // num_attention_heads``: it reads no head
    #: width) or a number (its config class's default: it reads none).  An export whose ``head_dim`` differs
    #: is refused, as no stock reader would check it.
    stock_head_dim: str | int = "metadata"


#: ``config.model_type`` → its GGUF layout.  Not Mistral yet: llama.cpp writes it as ``llama`` named
#: "mistral", and transformers 5.24's loader then asks gguf 0.19 for a "mistral" tensor table it lacks
#: (NotImplementedError), so no stock reader would check our file.  Qwen3 is Qwen2 without the q/k/v
#: biases and with a per-head RMSNorm of queries and keys (``attn_q_norm``/``attn_k_norm``); neither
#: Qwen permutes q/k rows (llama.cpp's converter leaves them, transformers' loader has no processor
#: for them), and transformers 5.24 reads a qwen3 file with ``Qwen3Config``'s default ``head_dim`` 128.
ARCHITECTURES = {
    "llama": Architecture("llama", "llama", "LlamaForCausalLM", True, ("attention_bias", "mlp_bias")),
    "qwen2": Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", False, stock_head_dim="width"),
    "qwen3": Architecture("qwen3", "qwen3", "Qwen3ForCausalLM", False, ("attention_bias",), stock_head_dim=128),
}

#: GGUF metadata key (after ``<arch>.``) ← config field, for every architecture above.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}


def head_dim(config) -> int:
    value = getattr(config, "head_dim", None)
    return int(value) if value else config.hidden_size // config.num_attention_heads


def rope_theta(config) -> float:
    """The rotary base (transformers 5 keeps it in ``rope_parameters``, older ones in ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None) or {}
    value = params.get("rope_theta") if isinstance(params, dict) else None
    return float(value if value is not None else getattr(config, "rope_theta", 10000.0))


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default"))) if isinstance(params, dict) else "default"


def tensor_names(arch: Architecture, blocks: int):
    """The ``gguf`` package's name table for ``arch`` (``.get_name(hf_key, try_suffixes=...)``)."""
    import gguf

    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    return gguf.get_tensor_name_map(archs[arch.gguf], blocks)


def permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """A q/k projection's rows (weight rows, block bytes or a bias) from transformers' order to
    llama.cpp's: within each head, the two rotary halves interleaved (``convert_hf_to_gguf``'s
    ``permute``).  A row permutation: exact on quantized blocks too."""
    shape = rows.shape
    half = shape[0] // heads // 2
    return rows.reshape(heads, 2, half, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`permute_rows` (transformers' ``_reverse_permute_weights``)."""
    shape = rows.shape
    half = shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
