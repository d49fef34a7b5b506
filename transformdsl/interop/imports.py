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

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import LoadError
from ..persist.checks import check_config, check_module_meta, read_json, sanitized
from ..persist.format import FORMAT, FORMAT_VERSION
from ..persist.read import TensorFiles, load_module, lookup_model_class, module_budget, module_limit
from ..persist.safetensors_io import is_padding
from ..persist.savedir import SaveDir
from . import CONFIG_FILE

#: The weight files a library directory may hold (single file or index), per library.
_WEIGHTS = {"transformers": ("model.safetensors", "model.safetensors.index.json"),
            "diffusers": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")}
_QUANT_STATE = "weight.quant_state.bitsandbytes__"
_MAX_STATE_BYTES = 65536


class _Located(type(Path())):
    """A weights file's path (in messages) that also knows where to read it: ``source``, the
    descriptor path of the file opened through the save's folder (:mod:`transformdsl.persist.savedir`)."""

    source: str = ""


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
    headers: dict[str, Path] = {}
    try:
        for file_name, _, source in files.opened:
            path = _Located(directory / file_name)
            path.source = source
            try:
                with safe_open(source, framework="pt") as f:
                    headers.update({key: path for key in f.keys() if not is_padding(key)})
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
    skeleton = _skeleton(cls, description["library"], description["config"], config_path,
                         module_budget(len(headers)))
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


def _steps(path: Path, quant: Any, headers: dict[str, Path]) -> tuple[list[dict], str]:
    """The ``quantize`` steps a bitsandbytes ``quantization_config`` stands for."""
    if quant is None:
        return [], ""
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "bitsandbytes":
        raise LoadError(f"{path}: quantization method {str(method)[:40]!r} is not one transformdsl rebuilds "
                        "(bitsandbytes 8-bit and 4-bit are); load it with its library")
    if quant.get("load_in_8bit"):
        mode = "int8"
        threshold = quant.get("llm_int8_threshold", 6.0)
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or threshold < 0:
            raise LoadError(f"{path}: llm_int8_threshold is malformed")
        options: dict[str, Any] = {"threshold": float(threshold)}
        layers = [_int8_layer(k[: -len(".SCB")], headers) for k in sorted(headers) if k.endswith(".SCB")]
    elif quant.get("load_in_4bit"):
        mode = quant.get("bnb_4bit_quant_type", "fp4")
        if mode not in ("nf4", "fp4"):
            raise LoadError(f"{path}: bnb_4bit_quant_type {str(mode)[:20]!r} is not nf4 or fp4")
        compute = quant.get("bnb_4bit_compute_dtype") or "float32"
        if compute not in ("float32", "float16", "bfloat16"):
            raise LoadError(f"{path}: bnb_4bit_compute_dtype {str(compute)[:20]!r} is not a float dtype")
        if quant.get("bnb_4bit_quant_storage", "uint8") != "uint8":
            raise LoadError(f"{path}: bnb_4bit_quant_storage other than uint8 is not supported")
        layers, blocksizes, nested = [], set(), set()
        for key in sorted(headers):
            if key.endswith(_QUANT_STATE + mode):
                layer, state = _four_bit_layer(key[: -len("." + _QUANT_STATE + mode)], key, headers)
                layers.append(layer)
                blocksizes.add(state["blocksize"])
                nested.add("nested_blocksize" in state)
        if len(blocksizes) > 1 or len(nested) > 1:
            raise LoadError(f"{path}: 4-bit layers with different block sizes or double quantization")
        options = {"compute": compute, "double_quant": bool(nested and nested.pop()),
                   "blocksize": blocksizes.pop() if blocksizes else 64}
    else:
        raise LoadError(f"{path}: a bitsandbytes quantization_config with neither load_in_8bit nor load_in_4bit")
    if not layers:
        raise LoadError(f"{path}: the quantization_config says bitsandbytes {mode}, but no tensor of the weight "
                        "files is quantized that way")
    words = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
    statement = f"quantize {mode} {words}"
    script = (f"# imported: {len(layers)} layer(s) already quantized with bitsandbytes {mode} (read from "
              f"config.json, not re-run)\n{statement}")
    step = {"key": f"quantize {mode}", "line": 2, "statement": statement, "options": options, "common": {},
            "record": {"layers": layers, "imported": True}, "script_index": 0}
    return [step], script


def _shape(headers: dict[str, Path], key: str) -> tuple[str, list[int]]:
    from safetensors import safe_open

    with safe_open(headers[key].source or str(headers[key]), framework="pt") as f:
        piece = f.get_slice(key)
        return piece.get_dtype(), list(piece.get_shape())


_FLOAT = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _bias(path: str, headers: dict[str, Path]) -> str | None:
    key = f"{path}.bias"
    if key not in headers:
        return None
    dtype, _ = _shape(headers, key)
    if dtype not in _FLOAT:
        raise LoadError(f"{headers[key]}: bias '{key}' is {dtype}, not a float tensor")
    return _FLOAT[dtype]


def _int8_layer(path: str, headers: dict[str, Path]) -> dict:
    if f"{path}.weight" not in headers:
        raise LoadError(f"{headers[path + '.SCB']}: '{path}.SCB' without '{path}.weight'")
    dtype, shape = _shape(headers, f"{path}.weight")
    if dtype != "I8" or len(shape) != 2:
        raise LoadError(f"{headers[path + '.weight']}: '{path}.weight' is {dtype}{shape}, not a 2-D int8 weight")
    return {"path": path, "in": shape[1], "out": shape[0], "dtype": "float16", "bias": _bias(path, headers),
            "source": "Linear"}


def _four_bit_layer(path: str, key: str, headers: dict[str, Path]) -> tuple[dict, dict]:
    from safetensors import safe_open

    dtype, shape = _shape(headers, key)
    if dtype != "U8" or len(shape) != 1 or shape[0] > _MAX_STATE_BYTES:
        raise LoadError(f"{headers[key]}: '{key}' is not a bitsandbytes quant state")
    with safe_open(headers[key].source or str(headers[key]), framework="pt") as f:
        raw = f.get_tensor(key)
    try:
        state = json.loads(bytes(raw.tolist()).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise LoadError(f"{headers[key]}: '{key}' does not hold JSON") from None
    shape_ok = (isinstance(state, dict) and isinstance(state.get("shape"), list) and len(state["shape"]) == 2
                and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in state["shape"]))
    if not shape_ok or state.get("dtype") not in _FLOAT.values() or not isinstance(state.get("blocksize"), int):
        raise LoadError(f"{headers[key]}: '{key}' is not a 2-D bitsandbytes quant state")
    out_features, in_features = state["shape"]
    layer = {"path": path, "in": in_features, "out": out_features, "dtype": state["dtype"],
             "bias": _bias(path, headers), "source": "Linear"}
    if "nested_offset" in state:
        offset = state["nested_offset"]
        if not isinstance(offset, (int, float)) or isinstance(offset, bool):
            raise LoadError(f"{headers[key]}: '{key}' has a malformed nested_offset")
        layer["offset"] = float(offset)
    return layer, state


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

