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

from torch import nn

from .builtin import BUILTIN, unknown_builtin

# --------------------------------------------------------------------------- --model SPEC

_FACTORY_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith((".", "~"))


def resolve_model(spec: str) -> Any:
    """The model named by ``spec`` (the CLI's ``--model SPEC``), in eval mode.  Never reaches a hub.

    ``spec`` is, in this order of precedence:

    * a built-in name (:data:`BUILTIN`), built with seed 0 (write ``./unet`` for a directory of that name);
    * ``package.module:factory`` -- the module is imported (the current directory is searched too, as
      ``python -m`` would) and ``factory`` (a dotted attribute path) is called with no arguments; it must
      return an ``nn.Module`` or a diffusers pipeline;
    * a directory written by ``save_pretrained``: ``model_index.json`` -> a diffusers pipeline;
      ``config.json`` with ``_class_name`` -> that diffusers model class; ``config.json`` with
      ``architectures`` -> that transformers class.  Loaded with ``local_files_only=True`` and
      ``use_safetensors=True``.

    Anything else raises ``ValueError`` saying what was expected (with the built-in names and a
    close match for a mistyped name).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--model needs a built-in name, a directory or package.module:factory, not {spec!r}")
    if spec in BUILTIN:
        return BUILTIN[spec]()
    path = Path(spec).expanduser()
    if not path.exists() and _FACTORY_SPEC.match(spec):
        return _from_factory(spec)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"--model {spec}: {path} is a file; expected a directory saved with save_pretrained")
        return _from_directory(path)
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


def _from_directory(path: Path) -> Any:
    load_kwargs = {"local_files_only": True, "use_safetensors": True}
    if (path / "model_index.json").is_file():
        from diffusers import DiffusionPipeline

        return _eval(_load(DiffusionPipeline, path, load_kwargs))
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
    if not isinstance(config, dict):
        raise ValueError(f"--model {path}: {config_file} is not a JSON object")
    if (path / "transformdsl.json").is_file() or isinstance(config.get("quantization_config"), dict):
        from ..persist.api import load  # our save in a library's layout, or a quantized checkpoint: our layers

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
    return _eval(_load(cls, path, load_kwargs))


def _load(cls: Any, path: Path, load_kwargs: dict[str, Any]) -> Any:
    try:
        return cls.from_pretrained(str(path), **load_kwargs)
    except OSError as error:
        raise ValueError(f"--model {path}: cannot load it as {cls.__name__}: {error}") from error
