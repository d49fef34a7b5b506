"""The CLI's ``--model SPEC``: a built-in name, ``package.module:factory``, or a local directory; never a hub.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .builtin import BUILTIN, unknown_builtin

# --------------------------------------------------------------------------- --model SPEC

_FACTORY_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith((".", "~"))


def resolve_model(spec: str, *, dtype: torch.dtype | None = None) -> Any:
    """The model named by ``spec`` (the CLI's ``--model SPEC``), in eval mode.  Never reaches a hub.

    ``spec`` is, in this order of precedence:

    * a built-in name (:data:`BUILTIN`), built with seed 0 (write ``./unet`` for a directory of that name);
    * ``package.module:factory`` -- the module is imported (the current directory is searched too, as
      ``python -m`` would) and ``factory`` (a dotted attribute path) is called with no arguments; it must
      return an ``nn.Module`` or a diffusers pipeline;
    * a directory written by ``save_pretrained``: ``model_index.json`` -> a diffusers pipeline;
      ``config.json`` with ``_class_name`` -> that diffusers model class; ``config.json`` with
      ``architectures`` -> that transformers class.  Loaded with ``local_files_only=True`` and
      ``use_safetensors=True``, and with the guards of :func:`transformdsl.load`: never custom code
      (``trust_remote_code=False``, no prompt: standard input is empty), never the hub (a named
      ``backbone`` is refused), no symbolic link, only model and pipeline classes, the configuration's
      shapes checked against the weights' headers first; such a problem raises ``LoadError``.

    ``dtype`` (default: None) is the floating dtype the model is read in: None keeps a directory's
    checkpoint dtype (the one holding most of its safetensors' elements, as :func:`load` does; diffusers'
    ``from_pretrained`` alone would read float32) and builds the built-ins in float32; a dtype reads a
    directory in it and casts a built-in or a factory's model to it.

    Anything else raises ``ValueError`` saying what was expected (with the built-in names and a
    close match for a mistyped name).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--model needs a built-in name, a directory or package.module:factory, not {spec!r}")
    from ..dtypes import cast

    if spec in BUILTIN:
        return BUILTIN[spec]() if dtype is None else cast(BUILTIN[spec](), dtype)
    path = Path(spec).expanduser()
    if not path.exists() and _FACTORY_SPEC.match(spec):
        return _from_factory(spec) if dtype is None else cast(_from_factory(spec), dtype)
    if path.exists():
        if not path.is_dir() and path.suffix.lower() == ".gguf":
            from ..persist.api import load  # a llama.cpp checkpoint: its Q8_0/Q4_0 blocks as our layers

            return load(path) if dtype is None else cast(load(path), dtype)
        if not path.is_dir():
            raise ValueError(f"--model {spec}: {path} is a file; expected a directory saved with save_pretrained "
                             "(or a .gguf file)")
        return _from_directory(path, dtype)
    if _looks_like_path(spec):
        raise ValueError(f"--model {spec}: no such directory: {path}")
    raise ValueError(unknown_builtin(spec))


def _eval(model: Any) -> Any:
    if isinstance(model, nn.Module):
        return model.eval()
    for component in model.components.values():
        if isinstance(component, nn.Module):
            component.eval()
    return model


def _import(module_name: str, spec: str):
    """Import ``module_name``; retry with the current directory on ``sys.path`` (for the installed CLI)."""
    try:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            cwd = os.getcwd()
            if error.name != module_name.split(".")[0] or cwd in sys.path or "" in sys.path:
                raise
            sys.path.insert(0, cwd)
            try:
                return importlib.import_module(module_name)
            finally:
                with contextlib.suppress(ValueError):
                    sys.path.remove(cwd)
    except ImportError as error:
        raise ValueError(f"--model {spec}: cannot import module '{module_name}': {error}") from error


def _from_factory(spec: str) -> Any:
    module_name, attribute_path = spec.split(":", 1)
    target: Any = _import(module_name, spec)
    for part in attribute_path.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"--model {spec}: '{module_name}' has no attribute '{attribute_path}'{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model {spec}: '{attribute_path}' is a {type(target).__name__}, not a callable factory")
    model = target()
    if not (isinstance(model, nn.Module) or isinstance(getattr(model, "components", None), dict)):
        raise ValueError(
            f"--model {spec}: the factory returned a {type(model).__name__}; "
            "expected a torch.nn.Module or a diffusers pipeline"
        )
    return _eval(model)


def _from_directory(path: Path, dtype: torch.dtype | None = None) -> Any:
    load_kwargs = {"local_files_only": True, "use_safetensors": True}
    if (path / "model_index.json").is_file():
        from diffusers import DiffusionPipeline

        return _eval(_load(DiffusionPipeline, path, {**load_kwargs, "dtype": _pipeline_dtypes(path, dtype)}))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"--model {path}: not a model directory: no model_index.json (diffusers pipeline) "
            "or config.json (diffusers or transformers model)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--model {path}: cannot read {config_file}: {error}") from error
    except RecursionError:  # `[[[[...` thousands deep
        raise ValueError(f"--model {path}: cannot read {config_file}: nested too deeply") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model {path}: {config_file} is not a JSON object")
    if (path / "transformdsl.json").is_file() or isinstance(config.get("quantization_config"), dict):
        from ..persist.api import load  # our save in a library's layout, or a quantized checkpoint: our layers

        if dtype is not None:
            raise ValueError(_SAVED_DTYPES.format(path=path))
        return load(path)
    if "_class_name" in config:
        import diffusers

        cls = getattr(diffusers, str(config["_class_name"]), None)
        library = "diffusers"
    elif config.get("architectures"):
        import transformers

        cls = getattr(transformers, str(config["architectures"][0]), None)
        library = "transformers"
    else:
        raise ValueError(
            f"--model {path}: {config_file} names neither a diffusers class ('_class_name') "
            "nor a transformers architecture ('architectures')"
        )
    if cls is None:
        name = config.get("_class_name") or config["architectures"][0]
        raise ValueError(f"--model {path}: {library} has no class '{name}' (named in {config_file})")
    # diffusers reads float32 unless told; transformers reads the checkpoint's dtype ("auto") unless told
    wanted = _checkpoint_dtype(path, dtype) if library == "diffusers" else dtype
    if wanted is not None:
        load_kwargs["dtype"] = wanted
    return _eval(_load(cls, path, load_kwargs))


#: ``--dtype`` with a model that is read as it was saved.
_SAVED_DTYPES = ("--model {path}: a quantized or transformed save is read in the dtypes it was saved in; "
                 "drop --dtype")


def _checkpoint_dtype(path: Path, dtype: torch.dtype | None) -> torch.dtype | None:
    """``dtype``, else the one of the checkpoint's weights (None: the library's default)."""
    if dtype is not None:
        return dtype
    from ..dtypes import checkpoint_dtype

    name = checkpoint_dtype(path)
    return getattr(torch, name) if name else None


#: Components of a pipeline whose checkpoint dtype is looked up (a pipeline has a handful).
_MAX_COMPONENTS = 64
#: A pipeline index longer than this is not read for dtypes (real ones are under 1 KiB).
_MAX_INDEX_BYTES = 1 << 20


def _pipeline_dtypes(path: Path, dtype: torch.dtype | None) -> dict[str, torch.dtype] | torch.dtype | None:
    """``torch_dtype=`` of a pipeline: ``dtype``, else each component folder's checkpoint dtype."""
    if dtype is not None:
        return dtype
    try:
        with open(path / "model_index.json", "rb") as f:
            index = json.loads(f.read(_MAX_INDEX_BYTES))
    except (OSError, ValueError, RecursionError):
        return None  # the pipeline loader says what is wrong with it
    if not isinstance(index, dict):
        return None
    names = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)]
    found = {}
    for name in names[:_MAX_COMPONENTS]:
        child = path / name
        if "/" not in name and name not in (".", "..") and child.is_dir() and not child.is_symlink():
            found_dtype = _checkpoint_dtype(child, None)
            if found_dtype is not None:
                found[name] = found_dtype
    # diffusers reads a component missing from the dict in ``default`` (float32 if none is given)
    return {**found, "default": torch.float32} if found else None


def _load(cls: Any, path: Path, load_kwargs: dict[str, Any]) -> Any:
    """``cls.from_pretrained(path)`` with :func:`transformdsl.load`'s guards: no custom code, no prompt, no
    hub, no link out of the directory, only model and pipeline classes, shapes checked against the
    headers first (:mod:`transformdsl.interop.directories`); a problem is a ``LoadError``."""
    from ..interop.directories import load_directory

    return load_directory(cls, path, load_kwargs)
