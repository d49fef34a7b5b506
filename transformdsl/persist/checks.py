"""Checking what a save's files say before anything is built from them.

Metadata is JSON checked field by field; configurations are refused when they could make a
library fetch or run code; a step's options and record are checked against the transform's
declared options.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .. import registry
from ..errors import LoadError
from ..options import coerce
from ..version import __version__
from . import plain_tensors
from .format import FORMAT, FORMAT_VERSION, MAX_META_BYTES, MAX_SCHEDULER_NUMBER, MAX_TENSOR_FILES, META_FILE, clipped
from .savedir import SaveDir, Vanished


def read_metadata(folder: SaveDir) -> dict:
    """The checked metadata of an opened save."""
    path = folder.path / META_FILE
    if not folder.exists(META_FILE):
        if folder.replaced():
            raise Vanished(f"{folder.root.path}: replaced by another save while loading")
        raise LoadError(f"{folder.path}: not a transformdsl save ({META_FILE} is missing)")
    meta = read_json(folder, META_FILE, "metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise LoadError(f"{path}: not transformdsl metadata (format is {_short(meta, 'format')})")
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise LoadError(f"{path}: format_version is missing or not an integer")
    if version > FORMAT_VERSION:
        raise LoadError(f"{path}: saved with format version {version}; this transformdsl ({__version__}) "
                        f"reads versions up to {FORMAT_VERSION}: upgrade transformdsl")
    if version < 1:
        raise LoadError(f"{path}: unknown format version {version}")
    kind = meta.get("kind")
    if kind not in ("module", "pipeline"):
        raise LoadError(f"{path}: unknown kind {kind!r} (expected 'module' or 'pipeline')")
    _expect(path, meta.get("versions", {}), dict, "'versions'")
    save_id = meta.get("save_id")
    if save_id is not None:
        _expect(path, save_id, str, "'save_id'")
    manifest = meta.get("manifest")
    if manifest is not None and not (isinstance(manifest, list) and all(isinstance(m, str) for m in manifest)):
        raise LoadError(f"{path}: 'manifest' must list file names")
    if kind == "module":
        check_module_meta(path, meta)
    else:
        _check_pipeline_meta(path, meta)
    return meta


#: How deep a JSON file of a save or a library directory may nest (theirs nest a few levels; a value
#: 900 deep parses, then breaks every recursive reader after it: ours, the libraries', ``copy``).
MAX_JSON_DEPTH = 64


def read_json(folder: SaveDir, name: str, what: str) -> Any:
    """A JSON file's content, read through the open folder; a file over
    :data:`MAX_META_BYTES`, or not a regular file, is refused before reading, and one nested
    deeper than :data:`MAX_JSON_DEPTH` after."""
    path = folder.path / name
    data = folder.read_bytes(name, MAX_META_BYTES, what)
    try:
        value = json.loads(data.decode("utf-8"))
        too_deep = json_depth(value) > MAX_JSON_DEPTH
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoadError(f"{path}: {what} is not valid JSON: {exc}") from None
    except RecursionError:  # `[[[[...` thousands deep: past the reader's own limit, so past ours
        too_deep = True
    if too_deep:
        raise LoadError(f"{path}: {what} nests deeper than {MAX_JSON_DEPTH} levels; refusing")
    return value


def json_depth(value: Any) -> int:
    """How deep ``value`` (parsed JSON) nests: 0 for a number or string, 1 for a flat list or
    object (iterative: any depth the parser allowed)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _short(meta: Any, key: str) -> str:
    value = meta.get(key) if isinstance(meta, dict) else None
    return repr(value)[:60]


def _expect(path: Path, value: Any, types: type | tuple, what: str) -> Any:
    if not isinstance(value, types) or isinstance(value, bool) and types is not bool:
        raise LoadError(f"{path}: {what} is malformed (got {type(value).__name__})")
    return value


def check_module_meta(path: Path, meta: dict) -> None:
    model = _expect(path, meta.get("model"), dict, "'model'")
    _expect(path, model.get("class"), str, "'model.class'")
    library = model.get("library")
    if library not in (None, "diffusers", "transformers"):
        raise LoadError(f"{path}: unknown model library {clipped(library)} (diffusers or transformers)")
    config = model.get("config")
    if config is not None:
        _expect(path, config, dict, "'model.config'")
        check_config(path, config, strip=True)
    scripts = _expect(path, meta.get("scripts"), list, "'scripts'")
    if not all(isinstance(text, str) for text in scripts):
        raise LoadError(f"{path}: 'scripts' must list script texts")
    steps = _expect(path, meta.get("steps"), list, "'steps'")
    for i, step in enumerate(steps):
        _expect(path, step, dict, f"step {i}")
        key = _expect(path, step.get("key"), str, f"step {i} key")
        if registry.get(key) is None:
            raise LoadError(f"{path}: step {i} uses transform {clipped(key)}, which this transformdsl "
                            f"({__version__}) does not know")
        for field in ("options", "common", "record"):
            _expect(path, step.get(field), dict, f"step {i} {field}")
        # Informational fields, kept in the loaded model's history (and saved again).
        _expect(path, step.get("line"), int, f"step {i} line")
        _expect(path, step.get("statement"), str, f"step {i} statement")
        version = _expect(path, step.get("record_version", 1), int, f"step {i} record_version")
        if version < 1:
            raise LoadError(f"{path}: step {i} record_version {version} is not a version (1 or more)")
        index = _expect(path, step.get("script_index"), int, f"step {i} script_index")
        if not 0 <= index < max(len(scripts), 1):
            raise LoadError(f"{path}: step {i} script_index {index} does not name one of the {len(scripts)} scripts")
    tensors = _expect(path, meta.get("tensors"), dict, "'tensors'")
    files = _expect(path, tensors.get("files"), list, "'tensors.files'")
    if not files or not all(isinstance(f, str) for f in files):
        raise LoadError(f"{path}: 'tensors.files' must list the safetensors files")
    if len(set(files)) != len(files) or len(files) > MAX_TENSOR_FILES:
        raise LoadError(f"{path}: 'tensors.files' lists {len(files)} names ({len(set(files))} different); "
                        f"each file once, at most {MAX_TENSOR_FILES}")
    nonpersistent = _expect(path, tensors.get("nonpersistent", []), list, "'tensors.nonpersistent'")
    if not all(isinstance(name, str) for name in nonpersistent):
        raise LoadError(f"{path}: 'tensors.nonpersistent' must list buffer names")
    aliases = _expect(path, tensors.get("aliases", {}), dict, "'tensors.aliases'")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise LoadError(f"{path}: 'tensors.aliases' must map names to names")
    plain_tensors.check_layout(tensors.get("attributes", {}), path)
    if "layout" in tensors:  # a save in a library's layout (format="transformers"/"diffusers")
        from ..interop import layout

        layout.check(path, tensors["layout"])


def _check_pipeline_meta(path: Path, meta: dict) -> None:
    _expect(path, meta.get("pipeline_class"), str, "'pipeline_class'")
    components = _expect(path, meta.get("components"), dict, "'components'")
    for name, how in components.items():
        if not name.isidentifier():
            raise LoadError(f"{path}: invalid component name {clipped(name)}")
        if how not in ("transformdsl", "library"):
            raise LoadError(f"{path}: component '{name}' has unknown storage {clipped(how)}")


#: Configuration keys that point a library at code to import (custom classes, pipelines).
_CODE_KEYS = frozenset({"auto_map", "custom_pipeline", "trust_remote_code", "custom_code"})


def check_config(path: Path, config: Any, scheduler: bool = False, strip: bool = False) -> None:
    """Refuse configuration values that could make a library fetch or run code, or reach the hub.

    At every depth: ``auto_map`` / ``custom_pipeline`` / ``trust_remote_code`` (custom
    code shipped with a save: transformers asks whether to run it, even for a nested
    sub-configuration), a hub attention kernel (``attn_implementation: "org/repo"``) and
    a hub repository as ``backbone`` (looked up online).  A scheduler's numbers are
    bounded (``num_train_timesteps: 3e9`` allocates gigabytes).  Saved configurations
    carry none of these, so their presence means tampering.  With ``strip`` (a model
    configuration that :func:`sanitized` cleans before use) code keys and pretrained
    backbones are left to it.
    """
    stack: list[Any] = [config]
    while stack:  # iterative: the JSON may be nested as deep as the parser allowed
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(key, str):
                if key in _CODE_KEYS and not strip and value not in (None, False, {}, [], ""):
                    raise LoadError(f"{path}: the configuration names code to run ({key}: {clipped(value)}); "
                                    "refusing to load code shipped with a saved file")
                if "implementation" in key:
                    values = value.values() if isinstance(value, dict) else [value]
                    if any(isinstance(v, str) and ("/" in v or ":" in v) for v in values):
                        raise LoadError(f"{path}: the configuration asks for the code kernel {clipped(value)} "
                                        f"({key}); refusing to load code named by a saved file")
                if key.endswith("backbone") and isinstance(value, str) and ("/" in value or ":" in value):
                    raise LoadError(f"{path}: the configuration names the hub repository {clipped(value)} ({key}); "
                                    "a save must hold its whole model (loading never reaches the network)")
                if (key == "backbone" and isinstance(value, str) and value
                        and not (isinstance(node, dict) and node.get("use_timm_backbone") is True)):
                    # transformers looks a named (not timm) backbone up on the hub, with or without a '/'
                    raise LoadError(f"{path}: the configuration names its backbone {clipped(value)} ({key}), which "
                                    "transformers looks up on the hub; a save must describe its whole model "
                                    "(backbone_config), loading never reaches the network")
                if key == "use_pretrained_backbone" and value is True and not strip:
                    raise LoadError(f"{path}: the configuration asks for pretrained backbone weights "
                                    "(use_pretrained_backbone: true), which would be downloaded; a save holds its "
                                    "weights")
            if scheduler and isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    value != value or abs(value) > MAX_SCHEDULER_NUMBER):
                raise LoadError(f"{path}: scheduler setting {key} = {clipped(value)} is out of range "
                                f"(at most {MAX_SCHEDULER_NUMBER:g})")
            if scheduler and isinstance(value, list) and len(value) > MAX_SCHEDULER_NUMBER:
                raise LoadError(f"{path}: scheduler setting {key} lists {len(value)} values")
            if isinstance(value, (dict, list)):
                stack.append(value)


def sanitized(config: dict) -> dict:
    """A copy of a saved model configuration without what could reach code or the network:
    ``auto_map``-like keys are dropped and ``use_pretrained_backbone`` is false (the
    weights come from the save), at every depth.  What :func:`check_config` refuses
    (hub kernels and repositories) is refused before this."""
    def clean(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (False if k == "use_pretrained_backbone" else clean(v))
                    for k, v in node.items() if k not in _CODE_KEYS}
        if isinstance(node, list):
            return [clean(v) for v in node]
        return node

    return clean(config)



def rebuild_options(cls, values: dict, path: Path, key: str, common: bool = False):
    from ..options import CommonOptions

    target = CommonOptions if common else cls.Options
    fields = {f.name: f for f in dataclasses.fields(target)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise LoadError(f"{path}: step '{key}' has unknown options {unknown}")
    coerced = {}
    for name, value in values.items():
        try:
            coerced[name] = coerce(fields[name], value)
        except (ValueError, TypeError) as exc:
            raise LoadError(f"{path}: step '{key}' has an invalid option {name}: {exc}") from None
    try:
        return target(**coerced)
    except (ValueError, TypeError) as exc:
        raise LoadError(f"{path}: step '{key}' has invalid options: {exc}") from None


def check_record(cls, raw: dict, options: Any, path: Path) -> None:
    """A step's record against its (checked) options: a field named like an option, at the
    top of the record or in its ``options``, must hold the option's value; so a tampered
    record cannot bring in a value the script could not (``compute: "load"``,
    ``backend: "tvm"``, ``strict: "no"``, ``threshold: NaN``)."""
    record = raw["record"]
    values = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else {}
    nested = record.get("options")
    if nested is not None:
        if not isinstance(nested, dict):
            raise LoadError(f"{path}: step '{raw['key']}' record options are malformed")
        checked = rebuild_options(cls, nested, path, raw["key"])
        if dataclasses.asdict(checked) != values:
            raise LoadError(f"{path}: step '{raw['key']}' record options {clipped(nested)} disagree with its "
                            f"options {clipped(values)}")
    for name, value in values.items():
        if name in record and record[name] != value:
            raise LoadError(f"{path}: step '{raw['key']}' record field {name} = {clipped(record[name])} disagrees "
                            f"with the option's checked value {value!r}")
