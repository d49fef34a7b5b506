"""``load("file.gguf")``: a llama.cpp checkpoint as a transformers model, its quantized blocks kept.

The file is read with the bounded reader (:mod:`.gguf_read`); its architecture (``llama``, ``qwen2``, ``qwen3``:
:mod:`.gguf_layout`) and metadata give the transformers configuration, built on the meta device once
the tensor table agrees with it (so a file's counts never size a model its tensors do not fill).  Then:

- a linear layer stored as Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K becomes our ``quantize q8_0`` / ``q4_0``
  / ``q4_1`` / ``q5_0`` / ``q5_1`` / ``q4_k`` / ``q5_k`` / ``q6_k`` layer holding those
  very bytes (no dequantize-requantize: ``bytes in memory`` ≈ the file's), recorded as that statement
  so that a further script applies and :func:`transformdsl.save` writes and reloads it exactly;
- with tied embeddings (no ``output.weight``), a ``token_embd`` of one of those types becomes the head's layer
  (its bytes, recorded as the head's statement) and the embedding a ``BlockEmbedding`` reading its rows, as
  llama.cpp uses the one tensor for both;
- any other quantized tensor (Q5_1, Q5_K..., an untied quantized embedding) is dequantized with the ``gguf``
  package's reference code into float32;
- float tensors (F32, F16, BF16) are read as float32 (exact); the model is float32.

llama.cpp's rotary row order of ``attn_q``/``attn_k`` is undone (a row permutation: exact on blocks).
The file's ``tokenizer.*`` fields are kept on the model (``gguf_vocab.KEPT_ATTRIBUTE``, with their value
types), so that a GGUF save of it writes them again as they were.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import LoadError
from ..history import AppliedStep, History, set_history
from ..transforms.quantize.gguf_blocks import LAYERS, BlockEmbedding, from_block_bytes
from . import gguf_layout
from .gguf_read import GGUFFile, TensorInfo
from .gguf_vocab import KEPT_ATTRIBUTE

#: GGML type numbers kept as our layers (``gguf.GGMLQuantizationType``: Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7,
#: Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14).
KEPT = {8: "q8_0", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 12: "q4_k", 13: "q5_k", 14: "q6_k"}
#: Float types read as they are (F32, F16, BF16).
FLOATS = {0: np.float32, 1: np.float16}
BF16 = 30
#: Tensors one transformer block holds at least (norms, q, k, v, o, gate, up, down).
_PER_BLOCK = 9


def _config(gf: GGUFFile):
    """(architecture, transformers config) from the file's metadata, checked against its tensors."""
    meta = gf.metadata
    name = meta.get("general.architecture")
    by_gguf = {a.gguf: a for a in gguf_layout.ARCHITECTURES.values()}
    if name not in by_gguf:
        raise LoadError(f"{gf.path}: GGUF architecture {str(name)[:40]!r}; transformdsl reads "
                        f"{', '.join(sorted(by_gguf))}")
    arch = by_gguf[name]
    if "mistral" in str(meta.get("general.name", "")).lower():
        raise LoadError(f"{gf.path}: a Mistral GGUF (llama architecture named 'mistral'): not read yet")
    values = {}
    for key, field in gguf_layout.CONFIG_KEYS.items():
        value = meta.get(f"{name}.{key}")
        if field == "vocab_size" and value is None and "token_embd.weight" in gf.tensors:
            value = gf.tensors["token_embd.weight"].shape[0]
        if field == "rms_norm_eps":
            ok = isinstance(value, float) and 0 < value < 1
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 31
        if not ok:
            raise LoadError(f"{gf.path}: metadata {name}.{key} is {str(value)[:40]!r}; expected a positive "
                            f"{'float' if field == 'rms_norm_eps' else 'integer'}")
        values[field] = value
    blocks = values["num_hidden_layers"]
    if blocks * _PER_BLOCK > len(gf.tensors):
        raise LoadError(f"{gf.path}: {blocks} blocks stated, {len(gf.tensors)} tensors in the file")
    if values["num_attention_heads"] % values["num_key_value_heads"]:
        raise LoadError(f"{gf.path}: {values['num_attention_heads']} attention heads are not groups of "
                        f"{values['num_key_value_heads']} key/value heads")
    embed = gf.tensors.get("token_embd.weight")
    if embed is None or embed.shape != (values["vocab_size"], values["hidden_size"]):
        raise LoadError(f"{gf.path}: token_embd.weight is {None if embed is None else list(embed.shape)}; the "
                        f"metadata says vocabulary {values['vocab_size']} x width {values['hidden_size']}")
    dim = meta.get(f"{name}.rope.dimension_count",
                   meta.get(f"{name}.attention.key_length", values["hidden_size"] // values["num_attention_heads"]))
    if not (isinstance(dim, int) and 0 < dim <= 1 << 14 and dim % 2 == 0):  # the tensors' shapes check it
        raise LoadError(f"{gf.path}: rotary dimension {str(dim)[:40]!r}")
    theta = meta.get(f"{name}.rope.freq_base", 10000.0)
    if not isinstance(theta, (int, float)) or not 0 < theta < 1e12:
        raise LoadError(f"{gf.path}: {name}.rope.freq_base {str(theta)[:40]!r}")
    if meta.get(f"{name}.rope.scaling.type", "none") not in ("none", None):
        raise LoadError(f"{gf.path}: rotary scaling {str(meta[f'{name}.rope.scaling.type'])[:40]!r} is not read yet")
    import transformers

    config_class = getattr(transformers, arch.hf_class.replace("ForCausalLM", "Config"))
    ids = {k: meta.get(f"tokenizer.ggml.{g}_token_id") for k, g in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                                                                     ("pad_token_id", "padding"))}
    ids = {k: v for k, v in ids.items() if isinstance(v, int) and 0 <= v < values["vocab_size"]}
    config = config_class(**values, head_dim=dim, rope_theta=float(theta),
                          tie_word_embeddings="output.weight" not in gf.tensors, **ids)
    return arch, config


def _skeleton(arch: gguf_layout.Architecture, config, path: Path) -> nn.Module:
    import transformers
    from accelerate import init_empty_weights

    try:
        with torch.device("cpu"), init_empty_weights(include_buffers=False):
            return getattr(transformers, arch.hf_class)(config).eval()
    except Exception as exc:
        raise LoadError(f"{path}: cannot build {arch.hf_class} from the metadata: {type(exc).__name__}: {exc}") \
            from None


def _float(gf: GGUFFile, info: TensorInfo) -> np.ndarray:
    """A tensor in float32, torch's shape (dequantized with gguf's reference code if quantized)."""
    raw = gf.data(info)
    if info.type in FLOATS:
        return raw.view(FLOATS[info.type]).astype(np.float32).reshape(info.shape)
    if info.type == BF16:
        wide = raw.view(np.uint16).astype(np.uint32) << 16
        return wide.view(np.float32).reshape(info.shape)
    from gguf import GGMLQuantizationType, dequantize

    try:
        return dequantize(raw, GGMLQuantizationType(info.type)).astype(np.float32).reshape(info.shape)
    except NotImplementedError:
        raise LoadError(f"{gf.path}: tensor {info.name!r}: the gguf package cannot dequantize "
                        f"{GGMLQuantizationType(info.type).name}") from None


def load_gguf(path: str | Path, keep: bool = True) -> nn.Module:
    """The model in a ``.gguf`` file (see the module docstring); a :class:`LoadError` for anything
    wrong with the file, before the model is built.  ``keep=False`` dequantizes every tensor to float32
    (the float model a file stands for, as stock transformers reads it: what a script that quantizes
    on its own terms, or a benchmark's float reference, starts from)."""
    path = Path(path)
    with GGUFFile(path) as gf:
        arch, config = _config(gf)
        model = _skeleton(arch, config, path)
        names = gguf_layout.tensor_names(arch, config.num_hidden_layers)
        state = model.state_dict(keep_vars=True)
        tied = bool(config.tie_word_embeddings)
        head_path = next(path for path, module in model.named_modules() if module is model.get_output_embeddings())
        wanted: dict[str, str] = {}
        for key in state:
            if tied and key == "lm_head.weight":
                continue
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise LoadError(f"{path}: no GGUF name for {arch.hf_class}'s {key!r}")
            wanted[name] = key
        missing = sorted(set(wanted) - set(gf.tensors))
        extra = sorted(set(gf.tensors) - set(wanted))
        if missing or extra:
            raise LoadError(f"{path}: the tensors do not make a {arch.hf_class}: "
                            + "; ".join(part for part in (
                                f"missing {', '.join(missing[:5])}" if missing else "",
                                f"not part of it: {', '.join(extra[:5])}" if extra else "") if part))
        tensors: dict[str, torch.Tensor] = {}
        layers: dict[str, list[dict]] = {kind: [] for kind in KEPT.values()}
        modules = dict(model.named_modules())
        for name, key in wanted.items():
            info = gf.tensors[name]
            expected = tuple(state[key].shape)
            if info.shape != expected:
                raise LoadError(f"{path}: tensor {name!r} is {list(info.shape)}; {key} is {list(expected)}")
            heads = None
            if arch.permuted_qk and (".attn_q." in name or ".attn_k." in name):
                heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            module_path, _, leaf = key.rpartition(".")
            module = modules.get(module_path)
            if keep and info.type in KEPT and leaf == "weight" and type(module) is nn.Linear:
                kind = KEPT[info.type]
                raw = gf.data(info)
                if heads:
                    raw = gguf_layout.unpermute_rows(raw, heads)
                layers[kind].append({"path": module_path, "stored": from_block_bytes(raw, kind, *info.shape)})
                continue
            if (keep and tied and info.type in KEPT and leaf == "weight" and type(module) is nn.Embedding
                    and module is model.get_input_embeddings()):
                # the tied head takes the file's token_embd blocks, and the embedding reads their rows (as llama.cpp)
                kind = KEPT[info.type]
                layers[kind].append({"path": head_path, "tied": module_path, "padding_idx": module.padding_idx,
                                     "stored": from_block_bytes(gf.data(info), kind, *info.shape)})
                continue
            data = _float(gf, info)
            if heads:
                data = gguf_layout.unpermute_rows(data, heads)
            tensors[key] = torch.from_numpy(np.ascontiguousarray(data))
        kept = {key: (value, *gf.value_types[key]) for key, value in gf.metadata.items() if key.startswith("tokenizer.")}
    model = _assemble(model, tensors, layers, path)
    if kept:  # written again as they are by a GGUF save (gguf_vocab)
        setattr(model, KEPT_ATTRIBUTE, kept)
    return model


def _place(model: nn.Module, path: str, module: nn.Module) -> None:
    """``module`` in place of the skeleton's module at ``path``."""
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, module)


def _assemble(model: nn.Module, tensors: dict, layers: dict, path: Path) -> nn.Module:
    """Put the block layers in place, load the float tensors, record the block layers as steps."""
    steps, statements = [], []
    heads_kept = False
    for kind, entries in layers.items():
        if not entries:
            continue
        records = []
        for entry in entries:
            bias_key = f"{entry['path']}.bias"
            bias = tensors.pop(bias_key, None)
            layer = LAYERS[kind](*entry["stored"], bias, torch.float32)
            _place(model, entry["path"], layer)
            records.append({"path": entry["path"], "in": layer.in_features, "out": layer.out_features,
                            "dtype": "float32", "bias": None if bias is None else "float32", "source": "Linear"})
            if "tied" in entry:
                _place(model, entry["tied"], BlockEmbedding(layer, entry["padding_idx"]))
                records[-1]["tied"] = [{"path": entry["tied"], "padding_idx": entry["padding_idx"]}]
                heads_kept = True
        byte_count = sum(t.numel() * t.element_size() for e in entries for t in e["stored"])
        statement = f"quantize {kind}"
        steps.append(AppliedStep(key=f"quantize {kind}", line=len(statements) + 2, statement=statement, options={},
                                 common={}, record={"layers": records, "imported": True, "bytes_before": 0,
                                                    "bytes_after": byte_count}, script_index=0))
        statements.append(statement)
    try:
        model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as exc:
        raise LoadError(f"{path}: {exc}") from None
    if getattr(model.config, "tie_word_embeddings", False) and not heads_kept:
        model.tie_weights()
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise LoadError(f"{path}: no data for {', '.join(left[:5])}")
    if steps:
        script = (f"# imported from {path.name}: {sum(len(s.record['layers']) for s in steps)} layer(s) kept in "
                  "their GGUF blocks (read, not re-run)\n" + "\n".join(statements))
        set_history(model, History([script], steps))
    return model.eval()


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_path(path: str | Path) -> Path | None:
    """The GGUF file ``load(path)`` and ``inspect(path)`` read: ``path`` itself, or the ``model.gguf`` of a
    ``format="gguf"`` save's directory (one with transformdsl's or a library's metadata is not one)."""
    from ..persist.format import META_FILE
    from .gguf_export import GGUF_FILE

    path = Path(path)
    if path.is_file():
        return path if is_gguf(path) else None
    inner = path / GGUF_FILE
    if inner.is_file() and not (path / META_FILE).exists() and not (path / "config.json").exists():
        return inner
    return None
