"""``inspect``: what a save holds, from its headers only."""

from __future__ import annotations

import os
from typing import Any

from ..errors import LoadError
from .checks import read_metadata
from .format import META_FILE
from .read import TensorFiles
from .safetensors_io import is_padding
from .savedir import SaveDir


def _interop_summary(value: Any) -> dict | None:
    from ..interop import summary

    return summary(value)


def _with_needs(interop: dict | None, steps: list[dict]) -> dict | None:
    """The summary, with what the stock loader needs (``"stock_needs"``) where it needs more than the library."""
    from ..interop import stock_needs

    if interop and interop.get("format"):
        needs = stock_needs(interop["format"], [s.get("key") for s in steps])
        if needs:
            return {**interop, "stock_needs": needs}
    return interop


def inspect(directory: str | os.PathLike) -> dict:
    """What a saved model contains, from headers only (no tensor data is read).

    Text in the result (scripts, names) comes from the files as it is: escape it before
    printing it to a terminal (the ``inspect`` command does).
    """
    from ..interop.gguf_import import gguf_path

    gguf_file = gguf_path(directory)
    if gguf_file is not None:  # llama.cpp's format (a file, or a format="gguf" save's directory)
        from ..interop.gguf_read import contents

        return contents(gguf_file)
    try:
        with SaveDir.open(directory) as folder:
            return _inspect(folder)
    except OSError as exc:
        raise LoadError(f"{directory}: cannot read the save: {exc.strerror or exc}") from None


def _inspect(folder: SaveDir, component: bool = False) -> dict:
    from safetensors import safe_open

    if not folder.exists(META_FILE) and folder.exists("config.json"):
        from ..interop.imports import library_metadata

        meta = library_metadata(folder)[0]  # a diffusers/transformers checkpoint: what load() would read
    else:
        meta = read_metadata(folder)
    if meta["kind"] == "pipeline":
        if component:  # a pipeline's components are modules; nested pipelines could go thousands deep
            raise LoadError(f"{folder.path / META_FILE}: a pipeline component that is itself a pipeline; "
                            "components are saved modules")
        parts = {}
        for comp, how in meta["components"].items():
            parts[comp] = _inspect(folder.subdir(comp), component=True) if how == "transformdsl" else {"storage": how}
        return {"kind": "pipeline", "format_version": meta["format_version"],
                "pipeline_class": meta["pipeline_class"], "components": parts}
    by_dtype: dict[str, dict[str, int]] = {}
    files = TensorFiles(folder, meta["tensors"]["files"])
    for name, _, source in files.opened:
        path = folder.path / name
        try:
            with safe_open(source, "pt") as f:
                for key in f.keys():
                    if is_padding(key):
                        continue
                    piece = f.get_slice(key)
                    dtype = piece.get_dtype()
                    numel = 1
                    for d in piece.get_shape():
                        numel *= d
                    entry = by_dtype.setdefault(dtype, {"tensors": 0, "elements": 0, "bytes": 0})
                    entry["tensors"] += 1
                    entry["elements"] += numel
        except Exception as exc:
            files.close()
            raise LoadError(f"{path}: corrupt or truncated safetensors file: {exc}") from None
    files.close()
    sizes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
             "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
    for dtype, entry in by_dtype.items():
        entry["bytes"] = entry["elements"] * sizes.get(dtype, 0)
    return {
        "kind": "module",
        "format_version": meta["format_version"],
        "model": meta["model"]["class"],
        "library": meta["model"].get("library"),
        "scripts": meta["scripts"],
        "steps": [{"key": s["key"], "line": s.get("line"), "statement": s.get("statement")} for s in meta["steps"]],
        "files": meta["tensors"]["files"],
        "tensors": by_dtype,
        "versions": meta.get("versions", {}),
        **({"interop": _with_needs(_interop_summary(meta.get("interop")), meta["steps"])}
           if meta.get("interop") is not None else {}),
    }
