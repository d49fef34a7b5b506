"""A library checkpoint quantized with bitsandbytes, read as if ``quantize int8|nf4|fp4`` had run.

``transformdsl.load`` (and ``--model DIR``) on a diffusers/transformers directory whose ``config.json``
carries a bitsandbytes ``quantization_config`` asks this family for the steps it stands for
(``Transform.import_checkpoint``): their records list the layers found quantized in the safetensors
headers (``SCB`` for int8, the ``weight.quant_state.bitsandbytes__<type>`` tensor for 4-bit, whose JSON
gives the block size, dtype and shape), so the layers are rebuilt from the saved tensors, never
quantized again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import LoadError
from ...interop.hook_types import Headers

_QUANT_STATE = "weight.quant_state.bitsandbytes__"
_MAX_STATE_BYTES = 65536


def bitsandbytes_steps(path: Path, quant: dict, headers: Headers) -> tuple[list[dict], str]:
    """The ``quantize`` steps (and the script) a bitsandbytes ``quantization_config`` stands for."""
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
        keys = [key for key in sorted(headers) if key.endswith(_QUANT_STATE + mode)]
        states = _read_states(keys, headers)
        for key in keys:
            layer, state = _four_bit_layer(key[: -len("." + _QUANT_STATE + mode)], key, headers, states[key])
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


def _shape(headers: Headers, key: str) -> tuple[str, list[int]]:
    return headers.info[key]


def _read_states(keys: list[str], headers: Headers) -> dict[str, Any]:
    """The 4-bit quant-state tensors ``keys`` (checked small first), each file opened once."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key in keys:
        dtype, shape = _shape(headers, key)
        if dtype != "U8" or len(shape) != 1 or shape[0] > _MAX_STATE_BYTES:
            raise LoadError(f"{headers[key]}: '{key}' is not a bitsandbytes quant state")
        by_file.setdefault(headers[key], []).append(key)
    states = {}
    for path, names in by_file.items():
        with safe_open(path.source or str(path), framework="pt") as f:
            for key in names:
                states[key] = f.get_tensor(key)
    return states


_FLOAT = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _bias(path: str, headers: Headers) -> str | None:
    key = f"{path}.bias"
    if key not in headers:
        return None
    dtype, _ = _shape(headers, key)
    if dtype not in _FLOAT:
        raise LoadError(f"{headers[key]}: bias '{key}' is {dtype}, not a float tensor")
    return _FLOAT[dtype]


def _int8_layer(path: str, headers: Headers) -> dict:
    if f"{path}.weight" not in headers:
        raise LoadError(f"{headers[path + '.SCB']}: '{path}.SCB' without '{path}.weight'")
    dtype, shape = _shape(headers, f"{path}.weight")
    if dtype != "I8" or len(shape) != 2:
        raise LoadError(f"{headers[path + '.weight']}: '{path}.weight' is {dtype}{shape}, not a 2-D int8 weight")
    return {"path": path, "in": shape[1], "out": shape[0], "dtype": "float16", "bias": _bias(path, headers),
            "source": "Linear"}


def _four_bit_layer(path: str, key: str, headers: Headers, raw: Any) -> tuple[dict, dict]:
    try:
        state = json.loads(bytes(raw.tolist()).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise LoadError(f"{headers[key]}: '{key}' does not hold JSON") from None
    except RecursionError:  # `[[[[...` thousands deep
        raise LoadError(f"{headers[key]}: '{key}' is not a bitsandbytes quant state: nested too deeply") from None
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
