"""``save(model, dir, format="transformers" | "diffusers")``: a directory the stock library loads.

What each transform becomes (spec.md "Interchange" has the matrix):

- ``quantize int8|nf4|fp4``: the library's own bitsandbytes serialization.  Our layers are
  bitsandbytes' ``Linear8bitLt``/``Linear4bit`` and their state_dict keys are the ones the library
  writes; ``config.json`` gets the library's ``BitsAndBytesConfig`` with the script's options
  and a skip list checked against the library's rules (:mod:`.rules`).
- ``fp8 storage|native`` (transformers only, e4m3 ``Linear`` layers): transformers' ``fp8``
  ``quantization_config`` (``FineGrainedFP8Config``), weights in float8_e4m3fn and our scales as
  ``weight_scale_inv`` (per output row: ``weight_block_size = [1, in_features]``; per tensor: no
  blocks).  transformers runs them with its fp8 kernels on a GPU and dequantizes them on a CPU.
- ``fuse qkv``: written back unfused (the fused weight split in q, k, v order: exact), also
  under int8 (rows and their scales split) and fp8; refused under 4-bit quantization, whose
  blocks straddle the projections.
- ``fuse bias_act_dropout|...``: the keys never changed; the stock model runs the unfused forward.
- ``compile``: nothing to store (compiled code is not portable); a note says so.
- ``quantize hqq``: refused (transformers 5.24 raises NotImplementedError for HQQ checkpoints
  and diffusers has no HQQ loader).

The script and our metadata are written too, with the key mapping in ``tensors.layout``
(:mod:`.layout`), so :func:`transformdsl.load` restores the transformed model exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import plain_tensors
from ..errors import TransformError
from ..executor import History, history_of
from . import CONFIG_FILE, rules

#: Weight files each library reads (single file, and the sharded index).
WEIGHTS = {"transformers": ("model.safetensors", "model.safetensors.index.json", "model"),
           "diffusers": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
                         "diffusion_pytorch_model")}
#: Tensors the library does not read (non-persistent buffers): in a file of ours.
EXTRA = "transformdsl.extra.safetensors"
BNB = ("quantize int8", "quantize nf4", "quantize fp4")
FP8 = ("fp8 storage", "fp8 native")


@dataclass
class Exported:
    """A module in a library's layout: what goes in its files, and how to get ours back."""

    library: str
    tensors: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]
    config: dict
    layout: list[dict] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Tensors held as plain module attributes (``plain_tensors.py``): in ``extra``, not buffers.
    attributes: dict = field(default_factory=dict)


def library_of(module: nn.Module) -> str | None:
    library = type(module).__module__.split(".", 1)[0]
    return library if library in WEIGHTS and getattr(module, "config", None) is not None else None


def export(module: nn.Module, fmt: str) -> Exported:
    """``module`` (transformed or not) in format ``fmt``'s layout; a :class:`TransformError` saying
    which statement the format cannot carry, and what to do, when it cannot.

    ``fmt`` is a library (``"transformers"``, ``"diffusers"``), or ``"compressed-tensors"``: a
    transformers model whose fp8 layers are written in compressed-tensors' ``float-quantized``
    format (per output channel), which transformers loads when the compressed-tensors package is
    installed (and vLLM serves)."""
    from ..persist import _collect_tensors

    library = "transformers" if fmt == "compressed-tensors" else fmt
    own = library_of(module)
    if own != library:
        what = f"a {own} model" if own else f"{type(module).__name__}, not a diffusers or transformers model"
        fix = f"use format={own!r}" if own else "save with format='transformdsl'"
        raise TransformError(f"format={library!r}: this is {what}; {fix}")
    history = history_of(module) or History([], [])
    tensors, layout = _collect_tensors(module)
    extra = {name: tensors.pop(name) for name in layout["nonpersistent"]}
    # Plain tensor attributes go beside the non-persistent buffers (stock loaders recompute them).
    extra.update({name: tensors.pop(name) for name in plain_tensors.saved_names(layout.get("attributes", {}))})
    aliases = dict(layout["aliases"])
    if library == "diffusers":  # diffusers ties nothing on load: store tied tensors under each name
        for key, target in aliases.items():
            tensors[key] = tensors[target].clone()
        aliases = {}
    out = Exported(library, tensors, extra, _config(module, library), aliases=aliases,
                   attributes=layout.get("attributes", {}))
    quantized: set[str] = set()
    bnb: dict[tuple, object] = {}
    fp8: list[tuple[str, dict]] = []
    fusions: list[tuple[str, dict]] = []
    for step in history.steps:
        where = f"line {step.line}: '{step.statement}'"
        if step.key in BNB and step.options.get("weight_only"):
            raise TransformError(f"format={library!r} cannot carry {where}: bitsandbytes (the library's int8 "
                                 "format) has no weight-only int8, and its LLM.int8 would compute something else; "
                                 "drop weight_only=true, or save with format='transformdsl'")
        if step.key in BNB and fmt == "compressed-tensors":
            raise TransformError(f"format='compressed-tensors' carries fp8 layers, not {where}; use "
                                 "format='transformers' for bitsandbytes")
        if step.key in BNB:
            bnb[(step.key, tuple(sorted(step.options.items())))] = step
            quantized.update(layer["path"] for layer in step.record["layers"])
            # transformers' loader converts `type(module) is nn.Linear` and Conv1D only (diffusers':
            # any nn.Linear): a quantized subclass (Falcon's FalconLinear) would load as float.
            other = sorted({layer.get("source") for layer in step.record["layers"]} - {"Linear", "Conv1D", None})
            if other and library == "transformers":
                paths = [layer["path"] for layer in step.record["layers"] if layer.get("source") in other]
                raise TransformError(f"format='transformers' cannot carry {where}: transformers' bitsandbytes loader "
                                     f"quantizes nn.Linear and Conv1D layers only, not {', '.join(other)} "
                                     f"({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}); exclude them "
                                     f"('except {other[0]}'), or save with format='transformdsl'")
        elif step.key in FP8:
            if library != "transformers":
                raise TransformError(f"format='diffusers' cannot carry {where}: diffusers has no loader for "
                                     "pre-quantized fp8 weights (its fp8 is run-time layerwise casting, "
                                     "enable_layerwise_casting); drop the statement, quantize with int8/nf4/fp4, "
                                     "or save with format='transformdsl'")
            fp8.append((where, step.record))
            quantized.update(step.record["layers"])
        elif step.key == "quantize hqq":
            raise TransformError(f"format={fmt!r} cannot carry {where}: transformers 5.24 cannot load HQQ "
                                 "checkpoints (its HQQ quantizer raises NotImplementedError) and diffusers has no "
                                 "HQQ loader; quantize with int8/nf4/fp4 for a stock-loadable save, or save with "
                                 "format='transformdsl'")
        elif step.key == "fuse qkv":
            fusions.append((where, step.record))
            out.notes.append(f"{where}: written unfused (q, k, v as the library names them; exact); "
                             "transformdsl.load fuses them again")
        elif step.key.startswith("compile"):
            out.notes.append(f"{where}: not stored ({library} keeps no compiled code); call torch.compile after "
                             "from_pretrained; transformdsl.load compiles again")
        elif step.key.startswith("cache "):
            out.notes.append(f"{where}: not stored ({library} keeps no step cache in a checkpoint); call "
                             "model.enable_cache(...) after from_pretrained; transformdsl.load enables it again")
        elif step.key.startswith("attention "):
            out.notes.append(f"{where}: not stored; after from_pretrained call set_attention_backend (diffusers) or "
                             "pass attn_implementation= (transformers); transformdsl.load sets it again")
        elif step.key.startswith("fuse "):
            out.notes.append(f"{where}: same keys as the original; {library} runs the unfused forward "
                             "(same outputs); transformdsl.load fuses again")
        else:
            raise TransformError(f"format={library!r} cannot carry {where}: {library} has no representation of "
                                 f"'{step.key}'; save with format='transformdsl'")
    if len(bnb) > 1 or (bnb and fp8):
        kinds = sorted({k for k, _ in bnb} | ({"fp8"} if fp8 else set()))
        raise TransformError(f"format={library!r}: a {library} checkpoint has one quantization_config, and the "
                             f"script quantizes with {' and '.join(kinds)} (or with different options); use one "
                             "quantize statement's mode and options, or save with format='transformdsl'")
    # The layers as the library names them: fused projections written back as their sources.
    layers = set(rules.convertible(module, conv1d=library == "transformers" and not fp8))
    for where, record in fusions:
        renames = _unfuse(out, record, where)
        for fused, sources in renames.items():
            for paths in (quantized, layers):
                if fused in paths:
                    paths.discard(fused)
                    paths.update(sources)
    if bnb:
        (key, _), step = next(iter(bnb.items()))
        skip = rules.skip_list(layers, library, quantized, _keep(module))
        out.config["quantization_config"] = _bnb_config(library, key, step.options, skip)
        out.notes.append(f"{key}: {len(quantized)} layer(s) as bitsandbytes {key.split()[1]} "
                         f"(quantization_config, {len(skip)} skip entries)")
    elif fp8 and fmt == "compressed-tensors":
        out.config["quantization_config"] = _compressed_tensors(out, layers, fp8, quantized)
        out.notes.append(f"fp8: {len(quantized)} layer(s) in compressed-tensors' float-quantized format (per "
                         "channel); transformers loads it with the compressed-tensors package installed")
    elif fp8:
        out.config["quantization_config"] = _fp8(out, layers, fp8, quantized, _keep(module))
        out.notes.append(f"fp8: {len(quantized)} layer(s) as transformers' fp8 format (float8_e4m3fn weights, "
                         "weight_scale_inv); transformers dequantizes them on a CPU")
    return out


def _config(module: nn.Module, library: str) -> dict:
    if library == "diffusers":
        config = json.loads(module.to_json_string())
    else:
        config = json.loads(module.config.to_json_string())
        config["architectures"] = [type(module).__name__]
    config.pop("quantization_config", None)
    return config


def _keep(module: nn.Module) -> list[str]:
    keep: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        value = getattr(module, attr, None)
        if isinstance(value, (list, tuple, set)):
            keep.extend(value)
    return keep


def _bnb_config(library: str, key: str, options: dict, skip: list[str]) -> dict:
    mode = key.split()[1]
    if library == "diffusers":
        from diffusers import BitsAndBytesConfig
    else:
        from transformers import BitsAndBytesConfig
    if mode == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=float(options.get("threshold", 0.0)),
                                    llm_int8_skip_modules=skip)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mode,
                                    bnb_4bit_compute_dtype=getattr(torch, options.get("compute", "float32")),
                                    bnb_4bit_use_double_quant=bool(options.get("double_quant", False)),
                                    bnb_4bit_quant_storage="uint8", llm_int8_skip_modules=skip)
    data = config.to_dict()
    data["llm_int8_skip_modules"] = skip  # [] must stay [] (None would let the loader add its defaults)
    return data


def _fp8(out: Exported, layers: set[str], steps: list[tuple[str, dict]], quantized: set[str],
         keep: list[str]) -> dict:
    """transformers' fp8 config; renames our scales to ``weight_scale_inv``."""
    from transformers import FineGrainedFP8Config

    per_row: set[bool] = set()
    widest = 1
    for where, record in steps:
        if record.get("dtype", "e4m3") != "e4m3":
            raise TransformError(f"format='transformers' cannot carry {where}: transformers' fp8 format is "
                                 "float8_e4m3fn; use dtype=e4m3")
        for path, spec in record["layers"].items():
            if spec.get("kind", "linear") != "linear":
                raise TransformError(f"format='transformers' cannot carry {where} on '{path}' ({spec['kind']}): "
                                     "transformers stores only Linear layers in fp8; exclude it (e.g. "
                                     f"'except {path.rpartition('.')[2]}'), or save with format='transformdsl'")
    for path in sorted(quantized):
        scale_key, new_key = f"{path}.weight_scale", f"{path}.weight_scale_inv"
        scale = out.tensors.pop(scale_key)
        out_features, in_features = out.tensors[f"{path}.weight"].shape
        per_row.add(scale.numel() != 1 or out_features == 1)
        widest = max(widest, int(in_features))
        out.tensors[new_key] = scale.reshape(-1, 1).contiguous() if scale.numel() != 1 else scale.reshape(())
        out.layout.append({"key": scale_key, "from": [new_key], "op": "rename", "shape": list(scale.shape)})
    if len(per_row) > 1:
        raise TransformError("format='transformers': fp8 layers with per-tensor and per-row scales in one model "
                             "(fp8 native scaling=tensor stores layers it cannot run natively per row); "
                             "use scaling=row, or save with format='transformdsl'")
    skip = rules.skip_list(layers, "transformers", quantized, keep)
    block = [1, widest] if per_row == {True} else None
    config = FineGrainedFP8Config(activation_scheme="dynamic", weight_block_size=block, modules_to_not_convert=skip)
    data = config.to_dict()
    data["modules_to_not_convert"] = skip
    data["weight_block_size"] = block
    return data


def _compressed_tensors(out: Exported, layers: set[str], steps: list[tuple[str, dict]],
                        quantized: set[str]) -> dict:
    """compressed-tensors' config for our per-row e4m3 layers: their tensors are already its layout
    (``weight`` float8_e4m3fn, ``weight_scale`` float32 (out, 1)); unquantized Linears are ignored
    by exact name (its rule: a name equals an entry, or matches an ``re:`` entry)."""
    for where, record in steps:
        if record.get("dtype", "e4m3") != "e4m3" or record.get("scaling", "row") != "row":
            raise TransformError(f"format='compressed-tensors' cannot carry {where}: it stores e4m3 weights with "
                                 "one scale per output channel; use dtype=e4m3 (fp8 storage) or scaling=row "
                                 "(fp8 native)")
        for path, spec in record["layers"].items():
            if spec.get("kind", "linear") != "linear":
                raise TransformError(f"format='compressed-tensors' cannot carry {where} on '{path}' "
                                     f"({spec['kind']}): only Linear layers; exclude it, or save with "
                                     "format='transformdsl'")
    for path in quantized:
        scale = out.tensors[f"{path}.weight_scale"]
        if tuple(scale.shape) != (out.tensors[f"{path}.weight"].shape[0], 1):
            raise TransformError(f"format='compressed-tensors': '{path}' has a per-tensor scale; use scaling=row")
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": sorted(layers - quantized)}


def _unfuse(out: Exported, record: dict, where: str) -> dict[str, list[str]]:
    """Split each fused projection's tensors back into its sources (in place in ``out``);
    returns fused path → source paths."""
    renames: dict[str, list[str]] = {}
    for module in record["modules"]:
        base = module["path"]
        for group in module["groups"]:
            fused = f"{base}.{group['name']}" if base else group["name"]
            sources = [f"{base}.{s}" if base else s for s in group["sources"]]
            splits = [int(s) for s in group["splits"]]
            for key in [k for k in out.tensors if k.startswith(fused + ".")]:
                suffix = key[len(fused) + 1:]
                tensor = out.tensors.pop(key)
                names = [f"{s}.{suffix}" for s in sources]
                rows = tensor.shape[0] if tensor.dim() else None
                if suffix in ("weight", "bias", "SCB", "weight_scale") and rows == sum(splits):
                    parts = tensor.split(splits, dim=0)
                    op = "cat"
                elif suffix in ("weight_format", "weight_scale") and tensor.numel() == 1:
                    parts = [tensor.clone() for _ in sources]
                    op = "same"
                else:
                    raise TransformError(f"{where}: cannot write '{fused}' unfused: its tensor '{suffix}' does not "
                                         "split by output rows (bitsandbytes 4-bit blocks straddle the projections); "
                                         "drop 'fuse qkv' (diffusers' fuse_qkv_projections() can fuse after loading),"
                                         " or save with format='transformdsl'")
                entry = {"key": key, "from": names, "op": op}
                if suffix == "bias" and group.get("zero_bias"):
                    # The rows of a projection that has no bias (Whisper's k_proj) are not written.
                    zeros = [[i, int(parts[i].shape[0])] for i, s in enumerate(group["sources"])
                             if s in group["zero_bias"]]
                    for i, _ in zeros:
                        if torch.count_nonzero(parts[i]):
                            raise TransformError(f"{where}: '{sources[i]}' has no bias in the library's model, but "
                                                 f"its rows of '{key}' are no longer zero (trained?)")
                    keep = [i for i in range(len(parts)) if i not in {z[0] for z in zeros}]
                    names, parts = [names[i] for i in keep], [parts[i] for i in keep]
                    entry = {"key": key, "from": names, "op": op, "zeros": zeros}
                for name, part in zip(names, parts):
                    out.tensors[name] = part.contiguous()
                out.layout.append(entry)
            renames[fused] = sources
    return renames


def save_library_module(module: nn.Module, directory: Path, fmt: str, max_shard_size: int) -> list[str]:
    """Write ``module`` into the existing empty ``directory`` in format ``fmt``'s layout, with our
    metadata beside; returns the notes (how each statement was carried)."""
    from safetensors.torch import save_file

    from .. import persist

    exported = export(module, fmt)
    single, index, stem = WEIGHTS[exported.library]
    shards = persist._shard(exported.tensors, max_shard_size)
    if len(shards) == 1:
        save_file(shards[0], str(directory / single), metadata={"format": "pt"})
        files = [single]
    else:
        files, weight_map = [], {}
        for i, shard in enumerate(shards, 1):
            name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({key: name for key in shard})
        total = sum(t.numel() * t.element_size() for t in exported.tensors.values())
        persist._write_json(directory / index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    if exported.extra:
        save_file(exported.extra, str(directory / EXTRA), metadata={"format": "pt"})
        files.append(EXTRA)
    persist._write_json(directory / CONFIG_FILE, exported.config)
    history = history_of(module) or History([], [])
    meta = {
        "format": persist.FORMAT,
        "format_version": persist.FORMAT_VERSION,
        "kind": "module",
        "model": persist._model_description(module),
        "scripts": history.scripts,
        "steps": [s.to_json() for s in history.steps],
        "tensors": {"files": files, "aliases": exported.aliases, "layout": exported.layout,
                    "nonpersistent": sorted(set(exported.extra) - set(plain_tensors.saved_names(exported.attributes))),
                    **({"attributes": exported.attributes} if exported.attributes else {})},
        "interop": {"format": fmt, "notes": exported.notes},
        "versions": persist._versions(),
    }
    persist._write_json(directory / persist.META_FILE, meta)
    (directory / persist.SCRIPT_FILE).write_text("\n".join(history.scripts) + ("\n" if history.scripts else ""))
    return exported.notes
