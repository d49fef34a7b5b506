"""``save(model, dir, format="gguf")``: a llama.cpp checkpoint, ``dir/model.gguf``, written with the
``gguf`` package (no network, no conversion script).

What it holds (spec.md "Interchange", GGUF):

- the architecture's metadata llama.cpp and transformers' GGUF loader read (:mod:`.gguf_layout`),
  the tokenizer (:mod:`.gguf_vocab`: one passed as ``tokenizer=``, the one of the GGUF file the model
  was read from, or the one saved beside the model; byte-level BPE as llama.cpp's converter writes it,
  else ``tokenizer.ggml.model = "no_vocab"``: llama.cpp then runs on token ids), and the scripts that
  made the model (``transformdsl.scripts``);
- float weights as they are: F32, F16 or BF16 (1-D tensors, norms and biases, in F32 as llama.cpp's
  converter writes them: exact);
- ``quantize q8_0`` / ``q4_0`` / ``q4_1`` / ``q5_0`` layers as GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 blocks, byte for byte
  the layer's own values and scales (lossless: the model verified here is the model llama.cpp runs), and the
  Q4_K / Q5_K / Q6_K layers (``quantize q4_k`` / ``q5_k`` / ``q6_k``, or a GGUF file's read by ``load``) as those
  super-blocks.

Any other applied statement is refused before anything is written, naming the mode that fits
(``quantize int8 weight_only=true`` → ``quantize q8_0``, ``quantize int4`` → ``quantize q4_0``);
statements that store nothing (``compile``, ``attention``) are dropped with a note, as llama.cpp
runs its own kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import TransformError
from ..history import AppliedStep, History, history_of
from ..transforms.quantize.gguf_blocks import LAYERS, BlockEmbedding, BlockQuantizedLinear
from . import gguf_layout, gguf_vocab
from .gguf_read import GGUF_FILE, WRITTEN_KEY, is_our_save  # noqa: F401  (importable from here)

#: Steps that store nothing a GGUF reader would use: dropped (with a note).
_NOTHING_STORED = ("compile", "compile regional")
#: The quantize modes GGUF holds exactly.
_BLOCK_MODES = ("quantize q8_0", "quantize q4_0", "quantize q4_1", "quantize q5_0", "quantize q5_1", "quantize q4_k",
                "quantize q5_k", "quantize q6_k")


def refuse(step: AppliedStep, why: str) -> TransformError:
    return TransformError(f"format='gguf' cannot carry line {step.line}: '{step.statement}': {why}")


def check_steps(history: History) -> list[str]:
    """The notes for the applied steps; a :class:`TransformError` for one GGUF cannot carry."""
    notes = []
    for step in history.steps:
        key = step.key
        if key in _BLOCK_MODES:
            continue
        if key in _NOTHING_STORED or key.startswith("attention "):
            notes.append(f"line {step.line}: '{step.statement}' stores nothing; llama.cpp runs its own kernels")
            continue
        if key == "quantize int8" and step.options.get("weight_only"):
            raise refuse(step, "its per-row int8 scales are no GGUF block type; 'quantize q8_0' is int8 with a "
                               "float16 scale per 32 inputs, GGUF's Q8_0, written exactly")
        if key == "quantize int4":
            raise refuse(step, "its asymmetric bfloat16 (scale, zero) groups are no GGUF block type; "
                               "'quantize q4_0' (4-bit, a float16 scale per 32 inputs, GGUF's Q4_0) or 'quantize "
                               "q4_k' (llama.cpp's Q4_K) is written exactly")
        if key.startswith("quantize ") or key.startswith("fp8 "):
            raise refuse(step, "its grid is no GGUF block type, and re-quantizing would change the model; use "
                               "'quantize q8_0' (8-bit) or 'quantize q4_0' (4-bit), which GGUF holds exactly")
        raise refuse(step, "a GGUF file holds an architecture's plain weights (llama.cpp's graph), not this "
                           "statement's structure; drop it for a GGUF save, or save with format='transformdsl'")
    return notes


def architecture_of(model: nn.Module) -> gguf_layout.Architecture:
    config = getattr(model, "config", None)
    arch = gguf_layout.ARCHITECTURES.get(getattr(config, "model_type", None))
    if arch is None or type(model).__name__ != arch.hf_class:
        known = ", ".join(a.hf_class for a in gguf_layout.ARCHITECTURES.values())
        raise TransformError(f"format='gguf' writes causal language models of the families llama.cpp and "
                             f"transformers' GGUF loader share ({known}); this is {type(model).__name__}")
    for field in arch.no_bias:
        if getattr(config, field, False):
            raise TransformError(f"format='gguf': config.{field}=true; llama.cpp's {arch.gguf} graph has no "
                                 "such bias tensors")
    dim = gguf_layout.head_dim(config)
    stock = {"metadata": dim, "width": config.hidden_size // config.num_attention_heads}.get(
        arch.stock_head_dim, arch.stock_head_dim)
    if dim != stock:
        raise TransformError(f"format='gguf': head_dim {dim}; transformers' GGUF loader builds a {arch.gguf} "
                             f"model with head_dim {stock} (it reads no head width for {arch.gguf}), so no stock "
                             "reader would check this file")
    windows = [t for t in getattr(config, "layer_types", None) or () if t != "full_attention"]
    if windows:
        raise TransformError(f"format='gguf': {len(windows)} layer(s) of type {windows[0]!r}; llama.cpp's "
                             f"{arch.gguf} graph attends over the whole context (use_sliding_window=false)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise TransformError(f"format='gguf': hidden_act={config.hidden_act!r}; llama.cpp's {arch.gguf} uses silu")
    if gguf_layout.rope_type(config) != "default":
        raise TransformError(f"format='gguf': rope type {gguf_layout.rope_type(config)!r} is not written yet "
                             "(only the default rotary embedding)")
    return arch


def _float_entry(tensor: torch.Tensor):
    """(bytes as uint8 (rows, row bytes), GGUF type) for a float tensor; 1-D ones in F32."""
    import gguf

    types = {torch.float32: gguf.GGMLQuantizationType.F32, torch.float16: gguf.GGMLQuantizationType.F16,
             torch.bfloat16: gguf.GGMLQuantizationType.BF16}
    tensor = tensor.detach().cpu()
    if tensor.dim() == 1:
        tensor = tensor.to(torch.float32)
    if tensor.dtype not in types:
        raise TransformError(f"format='gguf': a {tensor.dtype} tensor; GGUF float types are F32, F16, BF16")
    data = tensor.contiguous().view(torch.uint8)
    return data.reshape(tensor.shape[0], -1).numpy() if tensor.dim() > 1 else data.numpy(), types[tensor.dtype]


def gguf_tensors(model: nn.Module, arch: gguf_layout.Architecture) -> list[tuple[str, np.ndarray, object]]:
    """``(GGUF name, bytes, GGUF type)`` for each tensor, in the model's state_dict order."""
    import gguf

    config = model.config
    names = gguf_layout.tensor_names(arch, config.num_hidden_layers)
    quantized = {path: module for path, module in model.named_modules() if isinstance(module, BlockQuantizedLinear)}
    kinds = {kind: gguf.GGMLQuantizationType[kind.upper()] for kind in LAYERS}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # a head tied to a BlockEmbedding holds the embedding's blocks: written as token_embd (llama.cpp ties them)
    block_embedding = next((f"{path}.weight" for path, module in model.named_modules()
                            if isinstance(module, BlockEmbedding)), None)
    out = []
    for key, tensor in model.state_dict(keep_vars=False).items():
        path, _, leaf = key.rpartition(".")
        if path in quantized and leaf not in ("weight", "bias"):  # a block layer's other tensors: in its bytes
            continue
        if tied and key == "lm_head.weight" and not (block_embedding and path in quantized):
            continue
        name = names.get_name(block_embedding if tied and key == "lm_head.weight" else key,
                              try_suffixes=(".weight", ".bias"))
        if name is None:
            raise TransformError(f"format='gguf': {arch.gguf} has no GGUF tensor for {key!r}")
        if path in quantized and leaf == "weight":
            layer = quantized[path]
            data, kind = layer.gguf_bytes(), kinds[layer.kind]
        else:
            data, kind = _float_entry(tensor)
        if arch.permuted_qk and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            data = np.ascontiguousarray(gguf_layout.permute_rows(data, heads))
        out.append((name, data, kind))
    return out


def _file_type(entries) -> int:
    import gguf

    counts: dict = {}
    for _, data, kind in entries:
        counts[kind] = counts.get(kind, 0) + data.size
    kind = max(counts, key=counts.get)
    types = {gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
             gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
             gguf.GGMLQuantizationType.BF16: gguf.LlamaFileType.MOSTLY_BF16,
             gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
             gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
             gguf.GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
             gguf.GGMLQuantizationType.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
             gguf.GGMLQuantizationType.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
             gguf.GGMLQuantizationType.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_S,
             gguf.GGMLQuantizationType.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_S,
             gguf.GGMLQuantizationType.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K}
    return int(types[kind])


def write_metadata(writer, model: nn.Module, arch: gguf_layout.Architecture, scripts: list[str],
                   tokenizer: dict | None = None) -> None:
    """The file's metadata; ``tokenizer``: the ``tokenizer.*`` fields (:func:`.gguf_vocab.tokenizer_fields`),
    ``no_vocab`` when None."""
    config = model.config
    name = str(getattr(config, "_name_or_path", "") or arch.model_type)
    if "mistral" in name.lower():  # transformers' loader would read a llama file named so as Mistral
        name = arch.model_type
    writer.add_name(name[:200])
    prefix = arch.gguf
    for key, field in gguf_layout.CONFIG_KEYS.items():
        value = getattr(config, field)
        if isinstance(value, float):
            writer.add_float32(f"{prefix}.{key}", value)
        else:
            writer.add_uint32(f"{prefix}.{key}", int(value))
    dim = gguf_layout.head_dim(config)
    writer.add_uint32(f"{prefix}.rope.dimension_count", dim)
    writer.add_uint32(f"{prefix}.attention.key_length", dim)
    writer.add_uint32(f"{prefix}.attention.value_length", dim)
    writer.add_float32(f"{prefix}.rope.freq_base", gguf_layout.rope_theta(config))
    if tokenizer is None:
        writer.add_tokenizer_model("no_vocab")
        tokenizer = {}
    else:
        gguf_vocab.write_fields(writer, tokenizer)
    for field, key, add in (("bos_token_id", "bos", writer.add_bos_token_id),
                            ("eos_token_id", "eos", writer.add_eos_token_id),
                            ("pad_token_id", "padding", writer.add_pad_token_id)):
        value = getattr(config, field, None)
        if f"tokenizer.ggml.{key}_token_id" in tokenizer:  # the tokenizer's own
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            add(value)
    writer.add_string(WRITTEN_KEY, "model.gguf")  # a later save may replace this directory
    if scripts:
        writer.add_string("transformdsl.scripts", "\n".join(scripts))


def save_gguf(model: nn.Module, directory: Path, tokenizer: Any = None) -> list[str]:
    """Write ``model`` as ``directory/model.gguf`` (``directory`` exists and is empty); returns the
    notes.  ``tokenizer``: a transformers tokenizer to write (else the model's own, :mod:`.gguf_vocab`).
    Everything is checked before the file is opened."""
    import gguf

    arch = architecture_of(model)
    history = history_of(model) or History([], [])
    notes = check_steps(history)
    entries = gguf_tensors(model, arch)
    fields, vocab_notes = gguf_vocab.tokenizer_fields(model, tokenizer)
    notes += vocab_notes
    writer = gguf.GGUFWriter(str(directory / GGUF_FILE), arch.gguf)
    try:
        write_metadata(writer, model, arch, history.scripts, fields)
        writer.add_file_type(_file_type(entries))
        for name, data, kind in entries:
            writer.add_tensor(name, data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return notes
