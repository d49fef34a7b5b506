"""Pipelines: saved in the layout diffusers uses (``model_index.json`` and one folder per
component); transformed components use the transformdsl format, the others their library's own.

A pipeline is assembled on load by calling its class with an explicit mapping of its declared
components; diffusers' own loading (custom pipelines, remote code) is never entered.
"""

from __future__ import annotations

import contextlib
import math
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import LoadError, TransformError
from ..history import history_of
from . import guard
from .checks import check_config, read_json, read_metadata
from .format import FORMAT, META_FILE, clipped
from .read import TensorFiles, load_module, module_budget, module_limit
from .savedir import SaveDir
from .write import save_module, write_pipeline_metadata


def save_pipeline(pipe: Any, directory: Path, max_shard_size: int, save_id: str, format: str = FORMAT) -> None:
    if format in ("transformers", "compressed-tensors"):
        raise TransformError(f"format={format!r} saves a transformers model; a pipeline is saved with "
                             "format='diffusers' (its transformers components in their own layout)")
    pipe.save_config(str(directory))
    components = {}
    for name, component in pipe.components.items():
        if component is None:
            continue
        target = directory / name
        target.mkdir()
        if isinstance(component, nn.Module) and history_of(component) is not None:
            if format == FORMAT:
                save_module(component, target, max_shard_size, save_id)
            else:
                from ..interop.export import library_of, save_library_module

                save_library_module(component, target, library_of(component) or format, max_shard_size, save_id)
            components[name] = "transformdsl"
        elif hasattr(component, "save_pretrained"):
            kwargs = {"safe_serialization": True} if isinstance(component, nn.Module) else {}
            component.save_pretrained(str(target), **kwargs)
            components[name] = "library"
        else:
            raise TransformError(f"cannot save pipeline component '{name}' ({type(component).__name__})")
    write_pipeline_metadata(directory, type(pipe).__name__, components, save_id)



def load_pipeline(folder: SaveDir, meta: dict, device: torch.device, mmap: bool,
                  library_kwargs: Callable[[str], dict[str, Any]] | None = None) -> Any:
    """A saved pipeline, assembled by calling its class with an explicit mapping of the
    components its signature declares: no name from a file becomes a keyword argument,
    and diffusers' own loading (custom pipelines, remote code) is never entered.
    ``library_kwargs(component)``: more keyword arguments for a library component's model
    (``dtype``: see :func:`load_library_component`)."""
    import diffusers

    path = folder.path / META_FILE
    name = meta["pipeline_class"]  # read_metadata checked the types
    try:
        cls = getattr(diffusers, name) if name.isidentifier() else None
    except Exception:  # diffusers' lazy module raises for pipelines whose backend is missing
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise LoadError(f"{path}: {clipped(name)} is not a diffusers pipeline class")
    guard.offline_constants()
    expected, optional = cls._get_signature_keys(cls)
    components_meta: dict[str, str] = meta["components"]
    index_path = folder.path / "model_index.json"
    if not folder.exists("model_index.json"):
        raise LoadError(f"{index_path}: cannot read the pipeline index: missing")
    index = read_json(folder, "model_index.json", "pipeline index")
    _check_pipeline_index(index_path, index, name, components_meta, set(expected), set(optional))
    loaded: dict[str, Any] = {}
    for comp in sorted(expected):
        how = components_meta.get(comp)
        if how is None:
            loaded[comp] = None  # an absent optional component ([null, null] in the index)
            continue
        sub = folder.subdir(comp)
        if how == "transformdsl":
            loaded[comp] = load_module(sub, _component_meta(sub, comp, index.get(comp)), None, device, mmap)
        else:
            library, class_name = index[comp]
            extra = library_kwargs(comp) if library_kwargs is not None else None
            loaded[comp] = load_library_component(library, class_name, sub, index_path, extra)
    arguments = {key: index[key] for key in sorted(optional) if key in index
                 and (index[key] is None or isinstance(index[key], (bool, int, float, str)))}
    try:
        pipe = cls(**loaded, **arguments)
    except Exception as exc:
        raise LoadError(f"{folder.path}: cannot assemble the {name}: {type(exc).__name__}: {exc}") from None
    for component in loaded.values():
        if isinstance(component, nn.Module):
            component.eval()
    return pipe


def _component_meta(sub, comp: str, entry: Any) -> dict:
    """A transformdsl component's metadata, checked against the pipeline: a saved module (a pipeline's
    metadata there gave ``KeyError: 'tensors'``) of the class ``model_index.json`` names for it (an
    entry naming another class was ignored, so the index said one thing and the load did another)."""
    meta = read_metadata(sub)
    where = sub.path / META_FILE
    if meta["kind"] != "module":
        raise LoadError(f"{where}: component '{comp}' is saved as a {meta['kind']}; a pipeline's components are "
                        "saved modules")
    saved = meta["model"]["class"]
    if saved.isidentifier() and isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str) \
            and entry[1] != saved:  # (a class name that is none is refused with the module's own checks)
        raise LoadError(f"{where}: component '{comp}' is a saved {clipped(saved)}, and model_index.json names "
                        f"{clipped(entry[1])} for it")
    return meta


def _check_pipeline_index(index_path: Path, index: Any, name: str, components: dict[str, str],
                          expected: set[str], optional: set[str]) -> None:
    """``model_index.json`` and the metadata's components against the pipeline class: every
    component is one the class declares, every declared one is saved or explicitly absent."""
    if not isinstance(index, dict):
        raise LoadError(f"{index_path}: cannot read the pipeline index: not a JSON object")
    if index.get("_class_name") != name:
        # A [file, class] pair here is custom pipeline code diffusers would run.
        raise LoadError(f"{index_path}: model_index.json names {clipped(index.get('_class_name'))}, "
                        f"the metadata '{name}'")
    declared = ", ".join(sorted(expected))
    for comp in components:
        if comp not in expected:
            raise LoadError(f"{index_path.parent / META_FILE}: {clipped(comp)} is not a component of {name} "
                            f"(its components: {declared}); refusing to pass it on")
    for key, entry in index.items():
        if key.startswith("_"):
            continue  # diffusers' own keys
        if key not in expected and key not in optional:
            raise LoadError(f"{index_path}: {clipped(key)} is neither a component nor an argument of {name}")
        if key in expected and key not in components and entry not in ([None, None], [None], None):
            raise LoadError(f"{index_path}: component '{key}' of model_index.json is not in the metadata's "
                            "components; refusing to let diffusers load it")
    for comp in expected:
        if comp not in components and comp in index and index[comp] not in ([None, None], [None], None):
            raise LoadError(f"{index_path}: component '{comp}' is missing from the save")
    for comp, how in components.items():
        entry = index.get(comp)
        if how == "library" and not (isinstance(entry, list) and len(entry) == 2
                                     and all(isinstance(e, str) for e in entry)):
            raise LoadError(f"{index_path}: component '{comp}' has no [library, class] entry")


def _component_bases() -> tuple[type, ...]:
    """What a pipeline component stored by its library may be: models, schedulers,
    tokenizers and processors.  Not pipelines (which load further components and custom
    code) and not Auto classes (which pick a class from the files)."""
    import diffusers
    import transformers

    names = ("PreTrainedModel", "PreTrainedTokenizerBase", "FeatureExtractionMixin", "ImageProcessingMixin",
             "ProcessorMixin")
    return (diffusers.ModelMixin, diffusers.SchedulerMixin,
            *(getattr(transformers, n) for n in names if isinstance(getattr(transformers, n, None), type)))


def load_library_component(library: str, name: str, folder: SaveDir, index_path: Path,
                            extra: dict[str, Any] | None = None) -> Any:
    """An untransformed pipeline component, loaded by its library from the opened folder.

    Before the library sees the folder: no entry is a symbolic link or anything but a
    regular file or folder; no JSON file in it names code, a hub repository or a kernel
    (:func:`check_config`), or a weights file outside the folder (shard indexes).  The
    library gets the folder as ``/proc/self/fd/N`` (the folder checked, not its name),
    ``local_files_only``, ``use_safetensors`` and ``trust_remote_code=False``; ``extra`` adds
    keyword arguments for a model (``dtype``), never replacing those.  A library is diffusers,
    transformers or one of diffusers' own pipeline packages (``["stable_diffusion",
    "StableDiffusionSafetyChecker"]`` in Stable Diffusion's index).
    """
    if not (isinstance(library, str) and library.isidentifier() and isinstance(name, str)
            and name.isidentifier()):
        raise LoadError(f"{index_path}: component class {clipped(library)[1:-1]}.{clipped(name)[1:-1]} is not allowed "
                        "(only diffusers and transformers classes are loaded)")
    import diffusers
    import transformers

    guard.offline_constants()
    module = _library_module(library)
    if module is None:
        raise LoadError(f"{index_path}: component class {clipped(library)[1:-1]}.{clipped(name)[1:-1]} is not allowed "
                        "(only diffusers and transformers classes are loaded)")
    try:
        cls = getattr(module, name)
    except Exception:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, _component_bases())):
        raise LoadError(f"{index_path}: {library}.{name} is not a loadable component class "
                        "(a diffusers or transformers model, scheduler, tokenizer or processor)")
    entries = folder.walk()
    files = {rel for rel, info in entries if stat.S_ISREG(info.st_mode)}
    for rel, info in entries:
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            kind = ("a symbolic link (a model's files must be inside its folder; copy a hub cache snapshot, "
                    "whose files link to its blobs, with cp -rL first)" if stat.S_ISLNK(info.st_mode)
                    else "not a regular file")
            raise LoadError(f"{folder.path / rel}: is {kind}; refusing to read it")
    scheduler = issubclass(cls, diffusers.SchedulerMixin)
    for rel in sorted(files):
        if not rel.endswith(".json"):
            continue
        holder, file_name = folder.descend(rel)
        content = read_json(holder, file_name, "component file")
        check_config(folder.path / rel, content, scheduler=scheduler)
        if rel.endswith(".index.json"):
            _check_shard_index(folder.path / rel, content, files)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if not issubclass(cls, (diffusers.ModelMixin, diffusers.SchedulerMixin)):  # a transformers class
        kwargs["trust_remote_code"] = False
    limit = contextlib.nullcontext()
    if issubclass(cls, nn.Module):
        kwargs = {**(extra or {}), **kwargs, "use_safetensors": True}
        names = sorted(r for r in files if "/" not in r and r.endswith(".safetensors"))
        if not names:
            raise LoadError(f"{folder.path}: cannot load {library}.{name}: no safetensors weights in the folder "
                            "(only .safetensors files are read)")
        weights = TensorFiles(folder, names)
        try:
            shapes = weights.shapes()
        finally:
            weights.close()
        budget = module_budget(sum(1 for _, shape in shapes.values() if math.prod(shape) > 0))
        if issubclass(cls, (diffusers.ModelMixin, transformers.PreTrainedModel)) and "config.json" in files:
            from ..interop.preflight import check_shapes

            check_shapes(cls, "diffusers" if issubclass(cls, diffusers.ModelMixin) else "transformers",
                         read_json(folder, "config.json", "configuration"), shapes, folder.path / "config.json",
                         budget)
        limit = module_limit(budget, folder.path)
    try:
        with limit:
            return cls.from_pretrained(folder.fd_path(), **kwargs)
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(f"{folder.path}: cannot load {library}.{name}: {type(exc).__name__}: {exc}") from None


def _library_module(library: str) -> Any:
    """diffusers, transformers, or a package of diffusers' pipelines by its name (None otherwise)."""
    import diffusers
    import transformers

    if library in ("diffusers", "transformers"):
        return diffusers if library == "diffusers" else transformers
    try:  # diffusers' lazy module knows its own packages by name: nothing else is imported
        module = getattr(diffusers.pipelines, library, None)
    except Exception:
        return None
    return module if getattr(module, "__name__", None) == f"diffusers.pipelines.{library}" else None


def _check_shard_index(path: Path, index: Any, files: set[str]) -> None:
    """A library's shard index may name only weights files of its own folder."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise LoadError(f"{path}: a shard index without a weight_map")
    for target in set(weight_map.values()):
        if not isinstance(target, str) or target not in files or "/" in target:
            raise LoadError(f"{path}: the shard index names {clipped(target)}, which is not a file of this folder; "
                            "refusing to read weights from elsewhere")


# =========================================================================== inspect
