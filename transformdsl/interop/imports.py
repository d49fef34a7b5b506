"""``transformdsl.load`` on a diffusers/transformers model directory (no transformdsl metadata).

The directory is read as :func:`transformdsl.load` reads its own saves, with the metadata
derived from the library's files instead of ``transformdsl.json``:

- the class and configuration from ``config.json`` (diffusers: ``_class_name``; transformers:
  ``architectures[0]``), looked up among the library's model classes only, never custom code;
- a bitsandbytes ``quantization_config`` becomes ``quantize int8|nf4|fp4`` steps whose records
  list the layers found quantized in the safetensors headers (``SCB`` for int8, the
  ``weight.quant_state.bitsandbytes__<type>`` tensor for 4-bit, whose JSON gives the block size,
  dtype and shape), so our layers are rebuilt from the saved tensors, never quantized again;
- other quantization methods are refused naming the method.

The model then behaves as if transformdsl had quantized it: ``explain`` shows those layers as
already quantized, and a further script (``compile``, ``fp8 native`` on the rest...) applies
and saves as usual.  Nothing is fetched from the Hub and no code named by a file is run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import registry
from ..errors import LoadError
from ..persist.checks import check_config, check_module_meta, read_json, sanitized
from ..persist.format import FORMAT, FORMAT_VERSION
from ..persist.read import TensorFiles, load_module, lookup_model_class, module_budget, module_limit
from ..persist.safetensors_io import is_padding
from ..persist.savedir import SaveDir
from . import CONFIG_FILE
from .hook_types import Headers, Located

#: The weight files a library directory may hold (single file or index), per library.
_WEIGHTS = {"transformers": ("model.safetensors", "model.safetensors.index.json"),
            "diffusers": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")}


def library_metadata(folder: SaveDir) -> tuple[dict, dict[str, Path]]:
    """The metadata :func:`transformdsl.load` would read, derived from a library directory's
    ``config.json`` and safetensors headers (no tensor data is read but 4-bit quant states);
    and the saved tensor names → their files.  ``folder`` is the directory opened once:
    every file is read through it (see :mod:`transformdsl.persist.savedir`)."""
    from safetensors import safe_open

    directory = folder.path
    config_path = directory / CONFIG_FILE
    if folder.exists("model_index.json"):
        raise LoadError(f"{directory}: a diffusers pipeline saved by diffusers; load it with diffusers and pass "
                        "its components to transformdsl, or load one component folder")
    config = read_json(folder, CONFIG_FILE, "configuration")
    if not isinstance(config, dict):
        raise LoadError(f"{config_path}: the configuration is not a JSON object")
    check_config(config_path, config, strip=True)
    config = sanitized(config)
    library, name = _library_class(config_path, config)
    names = _weight_files(folder, library)
    files = TensorFiles(folder, names)
    headers = Headers()
    headers.info = {}
    try:
        for file_name, _, source in files.opened:
            path = Located(directory / file_name)
            path.source = source
            try:
                with safe_open(source, framework="pt") as f:
                    for key in f.keys():
                        if not is_padding(key):
                            piece = f.get_slice(key)
                            headers[key] = path
                            headers.info[key] = (piece.get_dtype(), list(piece.get_shape()))
            except Exception as exc:
                raise LoadError(f"{path}: corrupt or truncated safetensors file: {exc}") from None
        steps, script = _steps(config_path, config.get("quantization_config"), headers)
    finally:
        files.close()
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "module",
        "model": {"library": library, "class": name, "config": plain},
        "scripts": [script] if steps else [], "steps": steps,
        "tensors": {"files": names, "nonpersistent": [], "aliases": {}},
        "interop": {"imported": library},
        "versions": {},
    }
    check_module_meta(config_path, meta)
    return meta, headers


def load_library_directory(folder: SaveDir, model: Any, device, mmap: bool) -> nn.Module:
    if model is not None:
        raise LoadError(f"{folder.path}: a {CONFIG_FILE} directory is rebuilt from its configuration; drop model=")
    meta, skeleton = library_skeleton(folder)
    return load_module(folder, meta, lambda: skeleton, device, mmap)


def library_skeleton(folder: SaveDir) -> tuple[dict, nn.Module]:
    """The metadata :func:`library_metadata` derives, its tied keys added as aliases, and the
    architecture built from the configuration (parameters on the meta device)."""
    meta, headers = library_metadata(folder)
    config_path = folder.path / CONFIG_FILE
    description = meta["model"]
    cls = lookup_model_class(description["library"], description["class"], config_path)
    # zero-size tensors hold nothing: 400,000 of them must not let a configuration build 100,000 layers
    budget = module_budget(sum(1 for _, shape in headers.info.values() if math.prod(shape) > 0))
    from .preflight import check_shapes

    check_shapes(cls, description["library"], description["config"], headers.info, config_path, budget)
    skeleton = _skeleton(cls, description["library"], description["config"], config_path, budget)
    meta["tensors"]["aliases"] = _tied(skeleton, headers)
    return meta, skeleton


def _library_class(path: Path, config: dict) -> tuple[str, str]:
    if isinstance(config.get("_class_name"), str) and "_diffusers_version" in config:
        return "diffusers", config["_class_name"]
    archs = config.get("architectures")
    if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str):
        return "transformers", archs[0]
    raise LoadError(f"{path}: neither a diffusers model configuration (_class_name) nor a transformers one "
                    "with a single 'architectures' entry; pass the model to transformdsl.transform instead")


def _weight_files(folder: SaveDir, library: str) -> list[str]:
    """Names of the weights files (plain names in the folder: the index cannot lead elsewhere)."""
    directory = folder.path
    single, index = _WEIGHTS[library]
    if folder.exists(single):
        return [single]
    if folder.exists(index):
        data = read_json(folder, index, "weight index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise LoadError(f"{directory / index}: no weight_map of file names")
        return sorted(set(weight_map.values()))
    raise LoadError(f"{directory}: no {single} (or {index}); only safetensors weights are loaded")


def _steps(path: Path, quant: Any, headers: Headers) -> tuple[list[dict], str]:
    """The steps a ``quantization_config`` stands for, from the transform whose declaration names its
    ``quant_method`` (``Transform.quant_methods``; bitsandbytes: ``transforms/quantize/imports.py``)."""
    if quant is None:
        return [], ""
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    keys = [key for key in registry.keys() if method in registry.declaration(key).quant_methods]
    if not isinstance(method, str) or not keys:
        known = sorted({m for key in registry.keys() for m in registry.declaration(key).quant_methods})
        raise LoadError(f"{path}: quantization method {str(method)[:40]!r} is not one transformdsl rebuilds "
                        f"(it rebuilds {', '.join(known)}); load it with its library")
    return registry.get(keys[0]).import_checkpoint(path, quant, headers)


def _skeleton(cls: type, library: str, config: dict, path: Path, max_modules: int) -> nn.Module:
    """The architecture with parameters on the meta device and buffers computed (rotary tables...)
    as the library's constructor computes them: the files hold no non-persistent buffer."""
    from accelerate import init_empty_weights

    try:
        with torch.device("cpu"), init_empty_weights(include_buffers=False), module_limit(max_modules, path):
            if library == "diffusers":
                return cls.from_config(config)
            model = cls(cls.config_class.from_dict(config))
        model.tie_weights()  # as from_pretrained does (outside init_empty_weights, where it does not tie)
        return model
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(f"{path}: cannot build {cls.__name__} from the configuration: "
                        f"{type(exc).__name__}: {exc}") from None


def _tied(skeleton: nn.Module, headers: dict[str, Path]) -> dict[str, str]:
    """Keys the files omit because the library ties them to another (``lm_head.weight``)."""
    state = skeleton.state_dict(keep_vars=True)
    by_id: dict[int, str] = {}
    for key, tensor in state.items():
        if key in headers:
            by_id.setdefault(id(tensor), key)
    aliases = {}
    for key, tensor in state.items():
        if key not in headers and id(tensor) in by_id:
            aliases[key] = by_id[id(tensor)]
    return aliases

