"""Saving and loading transformed models (format documented in spec.md "Save format").

A saved module is a directory holding:

- ``transformdsl.json``: metadata (format version, scripts, the applied steps and their
  records, the base model's class and configuration, library versions, tensor layout);
- ``script.tfm``: the script(s) as written;
- ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` plus
  ``model.safetensors.index.json`` above ``max_shard_size``.

A pipeline is saved in the layout diffusers uses (``model_index.json`` and one folder per
component); transformed components use the format above, the others their library's own.

Loading never unpickles or evaluates anything: metadata is JSON checked field by field,
classes are looked up by name among diffusers' and transformers' model classes only,
tensors come from safetensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import __version__, guard, plain_tensors, registry
from .errors import LoadError, TransformError
from .executor import AppliedStep, History, history_of, set_history
from .options import coerce
from .planner import is_pipeline
from .safetensors_io import is_padding, save_aligned
from .savedir import SaveDir, Vanished

FORMAT = "transformdsl"
#: The newest format this version reads.  A save writes the lowest version that can read it:
#: 2 only when it stores tensors held as plain module attributes (``tensors.attributes``).
FORMAT_VERSION = 2
META_FILE = "transformdsl.json"
SCRIPT_FILE = "script.tfm"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: Metadata files larger than this are refused before parsing.
MAX_META_BYTES = 64 * 1024 * 1024
DEFAULT_SHARD_BYTES = 5 * 1024**3


# =========================================================================== save


def save(model: Any, directory: str | os.PathLike, *, max_shard_size: int = DEFAULT_SHARD_BYTES,
         format: str = FORMAT) -> Path:
    """Save ``model`` (transformed or not; a module or a pipeline) to ``directory``.

    ``format="transformers"`` or ``"diffusers"`` writes what the library's stock
    ``from_pretrained`` loads without transformdsl (see :mod:`transformdsl.interop`); a
    statement the format cannot carry is a :class:`TransformError` before anything is written.

    The write is atomic: everything is written to a temporary sibling directory, flushed,
    then swapped into place, so an interrupted save leaves any previous save intact and
    no temporary files behind.  ``directory`` must be new, empty, or a previous save (it
    is replaced as a whole).  A failure to write (disk full, permissions) is a
    :class:`TransformError` naming the directory and the cause.
    """
    from .interop import check_format

    check_format(format)
    directory = Path(directory)
    final = directory.resolve()
    _check_target(final)
    save_id = uuid.uuid4().hex
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(final)
        # The writer's identity is in the name itself, so a kill at any moment (even before
        # the marker below is written, or while a finished swap is being removed) leaves a
        # directory that the next save recognises as ours and removes.
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}.{_boot_tag()}.", dir=final.parent))
    except OSError as exc:
        raise _save_error(final, exc) from exc
    try:
        # mkdtemp makes 0700 folders; a save is shared like any folder the user makes.
        os.chmod(tmp, 0o777 & ~_umask())
        (tmp / _TMP_MARKER).write_text(f"{os.getpid()} {_boot_id()}\n")
        if is_pipeline(model):
            _save_pipeline(model, tmp, max_shard_size, save_id, format)
        elif isinstance(model, nn.Module) and format != FORMAT:
            from .interop.export import save_library_module

            save_library_module(model, tmp, format, max_shard_size)
        elif isinstance(model, nn.Module):
            save_module(model, tmp, max_shard_size, save_id)
        else:
            raise TransformError(f"save() takes an nn.Module or a diffusers pipeline, not {type(model).__name__}")
        _write_manifest(tmp)
        _fsync_tree(tmp)
        (tmp / _TMP_MARKER).unlink()
        _swap_into_place(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(final, exc) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _check_target(final: Path) -> None:
    """Refuse a target that is not empty or a complete previous save: saving replaces
    (deletes) what is there, so a directory holding anything a save did not write, or
    missing a file its save listed, is left alone."""
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise TransformError(f"cannot save to {final}: it exists and is not a directory")
    if not final.is_dir() or not any(final.iterdir()):
        return
    problem = _not_a_complete_save(final)
    if problem:
        raise TransformError(f"cannot save to {final}: {problem}, and saving replaces the whole directory "
                             "(deleting what is there); choose a new or empty directory, or remove it yourself")


def _not_a_complete_save(final: Path) -> str | None:
    """Why ``final`` is not exactly a save's files (``None`` if it is)."""
    try:
        with SaveDir.open(final) as folder:
            meta = read_metadata(folder)
            present = {rel for rel, info in folder.walk() if not stat.S_ISDIR(info.st_mode)}
            links = {rel for rel, info in folder.walk() if stat.S_ISLNK(info.st_mode)}
    except (LoadError, OSError) as exc:
        return f"it is a non-empty directory that holds no transformdsl save ({exc})"
    listed = meta.get("manifest")
    if listed is None:
        return "it holds a transformdsl save without a file list (saved by an older version)"
    listed = set(listed) | {META_FILE}
    extra, missing = sorted(present - listed), sorted(listed - present)
    if links:
        return f"it holds symbolic links ({', '.join(sorted(links)[:3])})"
    if extra:
        return f"it holds files the save there did not write ({', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''})"
    if missing:
        return f"the save there is incomplete (missing {', '.join(missing[:3])})"
    return None


def _write_manifest(directory: Path) -> None:
    """List every file of the save in its metadata (``manifest``): what a later save may
    replace is exactly that (:func:`_not_a_complete_save`)."""
    path = directory / META_FILE
    if not path.is_file():
        return
    meta = json.loads(path.read_text())
    meta["manifest"] = sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                              if not p.is_dir() and p != path and p.relative_to(directory) != Path(_TMP_MARKER))
    _write_json(path, meta)


#: Present in a temporary save directory while it is written: ``PID BOOT_ID``.
_TMP_MARKER = ".transformdsl-incomplete"


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask sets it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _boot_tag() -> str:
    """The first field of the boot id: enough to tell this boot's process ids from an earlier one's."""
    return _boot_id().split("-", 1)[0]


#: ``PID.BOOTTAG.random`` after ``.NAME.tmp-``: a temporary directory named by the save that made it.
_TMP_NAME = re.compile(r"(\d{1,10})\.([0-9a-z]{1,16})\.")


def _remove_stale_temporaries(final: Path) -> None:
    """Remove ``.NAME.tmp-*`` / ``.NAME.old-*`` siblings left by saves that were killed.

    Only directories carrying our marker (or old copies named by a dead process id) whose
    writing process is gone (not running on this boot) are removed: a save still in
    progress elsewhere is left alone.
    """
    for sibling in final.parent.glob(f".{glob.escape(final.name)}.*-*"):
        kind = sibling.name[len(final.name) + 2:].split("-", 1)[0]
        if kind not in ("tmp", "old") or sibling.is_symlink() or not sibling.is_dir():
            continue
        try:
            named = _TMP_NAME.match(sibling.name[len(final.name) + 6:]) if kind == "tmp" else None
            if named:
                pid_text, boot = named.group(1), _boot_id() if named.group(2) == _boot_tag() else "other boot"
            elif kind == "tmp":
                pid_text, boot = (sibling / _TMP_MARKER).read_text().split()
            else:
                pid_text, boot = sibling.name.rsplit("-", 1)[1], _boot_id()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not ours (no marker), or finished and being swapped in: leave it
        if boot == _boot_id() and _process_alive(pid):
            continue
        shutil.rmtree(sibling, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _save_error(final: Path, exc: OSError) -> TransformError:
    return TransformError(f"cannot save to {final}: {exc.strerror or exc}"
                          f"{f' ({exc.filename})' if exc.filename else ''}; nothing was written there and a "
                          "previous save there, if any, is intact")


def save_module(module: nn.Module, directory: Path, max_shard_size: int = DEFAULT_SHARD_BYTES,
                save_id: str | None = None) -> None:
    """Write one module in the transformdsl format into an existing empty ``directory``.

    ``save_id`` (a fresh one by default) is written into the metadata and every tensor
    file, so that a reader can tell files of two saves apart.
    """
    save_id = save_id or uuid.uuid4().hex
    history = history_of(module) or History([], [])
    tensors, layout = _collect_tensors(module)
    shards = _shard(tensors, max_shard_size)
    if len(shards) == 1:
        save_aligned(shards[0], directory / WEIGHTS, metadata={"format": "pt", "save_id": save_id})
        files = [WEIGHTS]
    else:
        files = []
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_aligned(shard, directory / name, metadata={"format": "pt", "save_id": save_id})
            files.append(name)
            weight_map.update({key: name for key in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_json(directory / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    meta = {
        "format": FORMAT,
        "format_version": 2 if plain_tensors.saved_names(layout.get("attributes", {})) else 1,
        "kind": "module",
        "model": _model_description(module),
        "scripts": history.scripts,
        "steps": [s.to_json() for s in history.steps],
        "tensors": {"files": files, **layout},
        "versions": _versions(),
        "save_id": save_id,
    }
    (directory / SCRIPT_FILE).write_text("\n".join(history.scripts) + ("\n" if history.scripts else ""))
    _write_json(directory / META_FILE, meta)


def _collect_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """state_dict plus non-persistent buffers, with shared tensors stored once."""
    state = module.state_dict()
    nonpersistent = []
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if name not in state and buffer is not None:
            state[name] = buffer
            nonpersistent.append(name)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TransformError(f"cannot save '{key}': state_dict value is a {type(tensor).__name__}, not a tensor")
        if tensor.device.type == "meta":
            raise TransformError(f"cannot save '{key}': it is on the meta device (no data)")
        tensor = tensor.detach()
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()), tensor.dtype) if tensor.numel() else None
        if identity is not None and identity in seen:
            aliases[key] = seen[identity]
            continue
        if identity is not None:
            seen[identity] = key
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensors[key] = tensor.contiguous()
    layout = {"nonpersistent": sorted(nonpersistent), "aliases": aliases}
    # Tensors held as plain attributes (not parameters or buffers): see plain_tensors.py.
    attribute_tensors, attributes = plain_tensors.collect(module)
    if attributes:
        clash = sorted(set(attribute_tensors) & (set(tensors) | set(aliases)))
        if clash:
            raise TransformError(f"cannot save attribute tensor '{clash[0]}': its name is also a state_dict key")
        tensors.update({key: t.cpu().contiguous() for key, t in attribute_tensors.items()})
        layout["attributes"] = attributes
    # safetensors refuses tensors sharing memory; distinct views of one storage are copied.
    tensors = _unshare(tensors)
    return tensors, layout


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    by_storage: dict[int, list[str]] = {}
    for key, tensor in tensors.items():
        if tensor.numel():
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(key)
    for keys in by_storage.values():
        for key in keys[1:]:
            tensors[key] = tensors[key].clone()
    return tensors


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def _model_description(module: nn.Module) -> dict:
    """Library, class and configuration: enough for load() to rebuild the architecture."""
    cls = type(module)
    library = cls.__module__.split(".", 1)[0]
    config = getattr(module, "config", None)
    if library == "diffusers" and config is not None:
        return {"library": "diffusers", "class": cls.__name__,
                "config": json.loads(json.dumps(dict(config), default=_json_default))}
    if library == "transformers" and config is not None and hasattr(config, "to_json_string"):
        return {"library": "transformers", "class": cls.__name__, "config": json.loads(config.to_json_string())}
    return {"library": None, "class": cls.__name__, "config": None}


def _json_default(value):
    if isinstance(value, (tuple, set)):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def _versions() -> dict:
    from importlib import metadata

    out = {"transformdsl": __version__}
    for name in ("torch", "safetensors", "diffusers", "transformers", "bitsandbytes", "hqq"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _save_pipeline(pipe: Any, directory: Path, max_shard_size: int, save_id: str, format: str = FORMAT) -> None:
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
                from .interop.export import library_of, save_library_module

                save_library_module(component, target, library_of(component) or format, max_shard_size)
            components[name] = "transformdsl"
        elif hasattr(component, "save_pretrained"):
            kwargs = {"safe_serialization": True} if isinstance(component, nn.Module) else {}
            component.save_pretrained(str(target), **kwargs)
            components[name] = "library"
        else:
            raise TransformError(f"cannot save pipeline component '{name}' ({type(component).__name__})")
    _write_json(directory / META_FILE, {
        "format": FORMAT, "format_version": 1, "kind": "pipeline",  # its components say what they need
        "pipeline_class": type(pipe).__name__, "components": components, "versions": _versions(),
        "save_id": save_id,
    })


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=False, default=_json_default))


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2


def _swap_into_place(new: Path, final: Path) -> None:
    """Make ``new`` appear at ``final`` in one step; the previous ``final`` is removed after."""
    if not final.exists():
        os.rename(new, final)
        _fsync_directory(final.parent)
        return
    if not final.is_dir() or final.is_symlink():
        raise TransformError(f"cannot save to {final}: it exists and is not a directory")
    if _renameat2_exchange(new, final):
        # `new` now holds the previous save: mark it, so that a kill during its removal
        # leaves something the next save cleans up.
        with contextlib.suppress(OSError):
            (new / _TMP_MARKER).write_text(f"{os.getpid()} {_boot_id()}\n")
        shutil.rmtree(new, ignore_errors=True)
        _fsync_directory(final.parent)
        return
    # No atomic exchange on this platform: move the old copy aside first, so that at
    # every moment one complete save exists (at `final` or at `old`).
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    os.rename(final, old)
    try:
        os.rename(new, final)
    except BaseException:
        os.rename(old, final)  # put the previous save back where it was
        raise
    shutil.rmtree(old, ignore_errors=True)
    _fsync_directory(final.parent)


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable; best effort once the new save is in place (it is, either way)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _renameat2_exchange(a: Path, b: Path) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


# =========================================================================== load


def load(directory: str | os.PathLike, model: nn.Module | Callable[[], nn.Module] | None = None, *,
         device: str | torch.device = "cpu", mmap: bool = True) -> Any:
    """Load a model saved by :func:`save`; returns a new module (or pipeline).

    The architecture is rebuilt from the saved configuration (diffusers and transformers
    models), or from ``model``: a module used as a template (it is not modified: its
    structure is copied onto the meta device) or a factory called with no arguments.
    Each transform's structure is replayed without recomputation and the saved tensors
    are loaded as they are.  Any problem raises :class:`LoadError` saying what is wrong.

    The directory is opened once and every file is read through that descriptor (see
    :mod:`.savedir`), so a load sees one save, never a mix of two; if a concurrent
    :func:`save` replaces it while it is read, the load starts over on the new one.
    Library calls run with the hub offline and standard input closed (:mod:`.guard`);
    nothing from the directory is imported or executed.

    With ``mmap=True`` (the default) tensors on the CPU are memory-mapped from the saved
    files (copy on write): do not truncate or rewrite those files in place while the model
    is in use (:func:`save` never does; it writes a new directory and swaps it in).
    """
    directory = Path(directory)
    device = _check_device(device)
    for attempt in range(_LOAD_ATTEMPTS):
        try:
            with guard.loading(), SaveDir.open(directory) as folder:
                if not folder.exists(META_FILE) and folder.exists("config.json"):
                    from .interop.imports import load_library_directory

                    return load_library_directory(folder, model, device, mmap)
                meta = read_metadata(folder)
                if meta["kind"] == "pipeline":
                    if model is not None:
                        raise LoadError(f"{directory}: a saved pipeline is loaded from its files alone; drop model=")
                    return _load_pipeline(folder, meta, device, mmap)
                return load_module(folder, meta, model, device, mmap)
        except Vanished:
            if attempt == _LOAD_ATTEMPTS - 1:
                raise
        except OSError as exc:  # anything the checks above did not name
            raise LoadError(f"{directory}: cannot read the save: {exc.strerror or exc}") from None
    raise AssertionError("unreachable")  # pragma: no cover


#: A load restarts when a concurrent save replaces the directory under it; this often.
_LOAD_ATTEMPTS = 5


def _check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device that exists on this machine, else a LoadError naming it."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise LoadError(f"load(device={device!r}): not a device: {exc}") from None
    kind, index = parsed.type, parsed.index
    if kind == "cpu":
        if index not in (None, 0):
            raise LoadError(f"load(device={device!r}): this machine has one CPU device, 'cpu'")
        return parsed
    if kind == "meta":
        raise LoadError(f"load(device={device!r}): the meta device holds no data; load to 'cpu' or an accelerator")
    backend = getattr(torch, kind, None)
    available = getattr(backend, "is_available", None)
    count = getattr(backend, "device_count", None)
    if not (callable(available) and available()):
        raise LoadError(f"load(device={device!r}): no {kind} device on this machine; use device='cpu'")
    if index is not None and callable(count) and index >= count():
        raise LoadError(f"load(device={device!r}): this machine has {count()} {kind} device(s) "
                        f"({kind}:0 to {kind}:{count() - 1})")
    return parsed


def read_metadata(folder: SaveDir) -> dict:
    """The checked metadata of an opened save."""
    path = folder.path / META_FILE
    if not folder.exists(META_FILE):
        if folder.replaced():
            raise Vanished(f"{folder.root.path}: replaced by another save while loading")
        raise LoadError(f"{folder.path}: not a transformdsl save ({META_FILE} is missing)")
    meta = _read_json(folder, META_FILE, "metadata")
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
        _check_module_meta(path, meta)
    else:
        _check_pipeline_meta(path, meta)
    return meta


def _read_json(folder: SaveDir, name: str, what: str) -> Any:
    """A JSON file's content, read through the open folder; a file over
    :data:`MAX_META_BYTES`, or not a regular file, is refused before reading."""
    path = folder.path / name
    data = folder.read_bytes(name, MAX_META_BYTES, what)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoadError(f"{path}: {what} is not valid JSON: {exc}") from None
    except RecursionError:  # `[[[[...` thousands deep
        raise LoadError(f"{path}: {what} is not valid JSON: nested too deeply") from None


def _short(meta: Any, key: str) -> str:
    value = meta.get(key) if isinstance(meta, dict) else None
    return repr(value)[:60]


def _expect(path: Path, value: Any, types: type | tuple, what: str) -> Any:
    if not isinstance(value, types) or isinstance(value, bool) and types is not bool:
        raise LoadError(f"{path}: {what} is malformed (got {type(value).__name__})")
    return value


def _check_module_meta(path: Path, meta: dict) -> None:
    model = _expect(path, meta.get("model"), dict, "'model'")
    _expect(path, model.get("class"), str, "'model.class'")
    library = model.get("library")
    if library not in (None, "diffusers", "transformers"):
        raise LoadError(f"{path}: unknown model library {_clip(library)} (diffusers or transformers)")
    config = model.get("config")
    if config is not None:
        _expect(path, config, dict, "'model.config'")
        _check_config(path, config, strip=True)
    scripts = _expect(path, meta.get("scripts"), list, "'scripts'")
    if not all(isinstance(text, str) for text in scripts):
        raise LoadError(f"{path}: 'scripts' must list script texts")
    steps = _expect(path, meta.get("steps"), list, "'steps'")
    for i, step in enumerate(steps):
        _expect(path, step, dict, f"step {i}")
        key = _expect(path, step.get("key"), str, f"step {i} key")
        if registry.get(key) is None:
            raise LoadError(f"{path}: step {i} uses transform {_clip(key)}, which this transformdsl "
                            f"({__version__}) does not know")
        for field in ("options", "common", "record"):
            _expect(path, step.get(field), dict, f"step {i} {field}")
        # Informational fields, kept in the loaded model's history (and saved again).
        _expect(path, step.get("line"), int, f"step {i} line")
        _expect(path, step.get("statement"), str, f"step {i} statement")
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
        from .interop import layout

        layout.check(path, tensors["layout"])


def _check_pipeline_meta(path: Path, meta: dict) -> None:
    _expect(path, meta.get("pipeline_class"), str, "'pipeline_class'")
    components = _expect(path, meta.get("components"), dict, "'components'")
    for name, how in components.items():
        if not name.isidentifier():
            raise LoadError(f"{path}: invalid component name {_clip(name)}")
        if how not in ("transformdsl", "library"):
            raise LoadError(f"{path}: component '{name}' has unknown storage {_clip(how)}")


#: Configuration keys that point a library at code to import (custom classes, pipelines).
_CODE_KEYS = frozenset({"auto_map", "custom_pipeline", "trust_remote_code", "custom_code"})


def _check_config(path: Path, config: Any, scheduler: bool = False, strip: bool = False) -> None:
    """Refuse configuration values that could make a library fetch or run code, or reach the hub.

    At every depth: ``auto_map`` / ``custom_pipeline`` / ``trust_remote_code`` (custom
    code shipped with a save: transformers asks whether to run it, even for a nested
    sub-configuration), a hub attention kernel (``attn_implementation: "org/repo"``) and
    a hub repository as ``backbone`` (looked up online).  A scheduler's numbers are
    bounded (``num_train_timesteps: 3e9`` allocates gigabytes).  Saved configurations
    carry none of these, so their presence means tampering.  With ``strip`` (a model
    configuration that :func:`_sanitized` cleans before use) code keys and pretrained
    backbones are left to it.
    """
    stack: list[Any] = [config]
    while stack:  # iterative: the JSON may be nested as deep as the parser allowed
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(key, str):
                if key in _CODE_KEYS and not strip and value not in (None, False, {}, [], ""):
                    raise LoadError(f"{path}: the configuration names code to run ({key}: {_clip(value)}); "
                                    "refusing to load code shipped with a saved file")
                if "implementation" in key:
                    values = value.values() if isinstance(value, dict) else [value]
                    if any(isinstance(v, str) and ("/" in v or ":" in v) for v in values):
                        raise LoadError(f"{path}: the configuration asks for the code kernel {_clip(value)} "
                                        f"({key}); refusing to load code named by a saved file")
                if key.endswith("backbone") and isinstance(value, str) and ("/" in value or ":" in value):
                    raise LoadError(f"{path}: the configuration names the hub repository {_clip(value)} ({key}); "
                                    "a save must hold its whole model (loading never reaches the network)")
                if key == "use_pretrained_backbone" and value is True and not strip:
                    raise LoadError(f"{path}: the configuration asks for pretrained backbone weights "
                                    "(use_pretrained_backbone: true), which would be downloaded; a save holds its "
                                    "weights")
            if scheduler and isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    value != value or abs(value) > MAX_SCHEDULER_NUMBER):
                raise LoadError(f"{path}: scheduler setting {key} = {_clip(value)} is out of range "
                                f"(at most {MAX_SCHEDULER_NUMBER:g})")
            if scheduler and isinstance(value, list) and len(value) > MAX_SCHEDULER_NUMBER:
                raise LoadError(f"{path}: scheduler setting {key} lists {len(value)} values")
            if isinstance(value, (dict, list)):
                stack.append(value)


def _sanitized(config: dict) -> dict:
    """A copy of a saved model configuration without what could reach code or the network:
    ``auto_map``-like keys are dropped and ``use_pretrained_backbone`` is false (the
    weights come from the save), at every depth.  What :func:`_check_config` refuses
    (hub kernels and repositories) is refused before this."""
    def clean(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (False if k == "use_pretrained_backbone" else clean(v))
                    for k, v in node.items() if k not in _CODE_KEYS}
        if isinstance(node, list):
            return [clean(v) for v in node]
        return node

    return clean(config)


#: Largest number (and longest list) a scheduler configuration may hold: real ones
#: count training steps in thousands.
MAX_SCHEDULER_NUMBER = 1e6
#: Files a module's metadata may list.
MAX_TENSOR_FILES = 10_000


def _clip(value: Any, limit: int = 80) -> str:
    """``repr(value)``, shortened: hostile files may hold megabytes in one field."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _rebuild_options(cls, values: dict, path: Path, key: str, common: bool = False):
    from .options import CommonOptions

    target = CommonOptions if common else cls.Options
    fields = {f.name: f for f in dataclasses.fields(target)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise LoadError(f"{path}: step '{key}' has unknown options {unknown}")
    try:
        return target(**{k: coerce(fields[k], v) for k, v in values.items()})
    except (ValueError, TypeError) as exc:
        raise LoadError(f"{path}: step '{key}' has invalid options: {exc}") from None


def _check_record(cls, raw: dict, options: Any, path: Path) -> None:
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
        checked = _rebuild_options(cls, nested, path, raw["key"])
        if dataclasses.asdict(checked) != values:
            raise LoadError(f"{path}: step '{raw['key']}' record options {_clip(nested)} disagree with its "
                            f"options {_clip(values)}")
    for name, value in values.items():
        if name in record and record[name] != value:
            raise LoadError(f"{path}: step '{raw['key']}' record field {name} = {_clip(record[name])} disagrees "
                            f"with the option's checked value {value!r}")


@contextlib.contextmanager
def _step_errors(meta_path: Path, raw: dict, what: str, where: str = ""):
    """Turn a transform's failure while loading into a LoadError naming the step."""
    try:
        yield
    except LoadError:
        raise
    except Exception as exc:
        place = f" {where}" if where else ""
        raise LoadError(f"{meta_path}: {what} '{raw['key']}' (line {raw.get('line')}){place}: "
                        f"{type(exc).__name__}: {exc}") from None


def load_module(folder: SaveDir, meta: dict, model: Any, device: torch.device, mmap: bool = True) -> nn.Module:
    """Rebuild one saved module from an opened save folder and its checked metadata."""
    meta_path = folder.path / META_FILE
    # Every tensor file is opened (and checked on its descriptor) first; headers next: a
    # corrupt file is reported before anything is built, and the number of saved tensors
    # bounds the size of the model the metadata may describe.
    files = _TensorFiles(folder, meta["tensors"]["files"])
    try:
        saved = sum(files.count_tensors())
        aliases = meta["tensors"].get("aliases", {})
        if len(aliases) > _module_budget(saved):
            raise LoadError(f"{meta_path}: {len(aliases)} tensor aliases for {saved} saved tensors; refusing")
        skeleton = _skeleton(meta, model, meta_path, max_modules=_module_budget(saved))
        steps = []
        for raw in meta["steps"]:
            cls = registry.get(raw["key"])
            options = _rebuild_options(cls, raw["options"], meta_path, raw["key"])
            _rebuild_options(cls, raw["common"], meta_path, raw["key"], common=True)
            _check_record(cls, raw, options, meta_path)
            with _step_errors(meta_path, raw, "cannot replay", "on this architecture"):
                cls.rebuild(skeleton, raw["record"], options)
            steps.append((cls, raw, options))
        tensors = files.read(device, mmap and device.type == "cpu")
    finally:
        files.close()
    attributes = meta["tensors"].get("attributes", {})
    attribute_tensors = plain_tensors.take(tensors, attributes, folder.path)
    if meta["tensors"].get("layout"):
        from .interop import layout

        tensors = layout.to_own(tensors, meta["tensors"]["layout"], folder.path)
    _assign(skeleton, tensors, meta, folder.path)
    plain_tensors.restore(skeleton, attributes, attribute_tensors, folder.path)
    for cls, raw, options in steps:
        with _step_errors(meta_path, raw, "cannot finish"):
            cls.finalize(skeleton, raw["record"], options)
    left = [n for n, t in list(skeleton.named_parameters()) + list(skeleton.named_buffers()) if t.is_meta]
    if left:
        raise LoadError(f"{folder.path}: the saved tensors do not cover {len(left)} tensor(s) of the model: "
                        + ", ".join(left[:5]))
    skeleton.eval()
    set_history(skeleton, History(list(meta["scripts"]),
                                  [AppliedStep(**{k: raw.get(k) for k in AppliedStep.__dataclass_fields__})
                                   for raw in meta["steps"]]))
    return skeleton


def _skeleton(meta: dict, model: Any, meta_path: Path, max_modules: int) -> nn.Module:
    description = meta["model"]
    if isinstance(model, nn.Module):
        return meta_copy(model)
    if callable(model):
        with torch.device("meta"):
            built = model()
        if not isinstance(built, nn.Module):
            raise LoadError(f"model= factory returned {type(built).__name__}, not an nn.Module")
        return built
    if model is not None:
        raise LoadError(f"model= takes an nn.Module or a factory, not {type(model).__name__}")
    library, name, config = description.get("library"), description["class"], description.get("config")
    if isinstance(config, dict):
        config = _sanitized(config)
    if library is None or not isinstance(config, dict):
        raise LoadError(f"{meta_path}: the saved model ({name}) has no configuration to rebuild it from; "
                        "pass model= (a module of the same architecture, or a factory)")
    cls = _model_class(library, name, meta_path)
    try:
        with torch.device("meta"), _module_limit(max_modules, meta_path):
            if library == "diffusers":
                return cls.from_config(config)
            config_cls = cls.config_class
            return cls(config_cls.from_dict(config))
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(f"{meta_path}: cannot build {name} from the saved configuration: "
                        f"{type(exc).__name__}: {exc}") from None


def _module_budget(tensors: int) -> int:
    """How many submodules a model rebuilt from a saved configuration may have.

    Every module with weights holds at least one saved tensor, and weightless modules
    (activations, dropout, containers) are a few per weighted one in real architectures;
    a configuration asking for far more (``n_layer: 1000000`` next to the tensors of two
    layers) would take hours and gigabytes to build, even on the meta device.
    """
    return 4 * tensors + 256


class _TooManyModules(LoadError):
    pass


@contextlib.contextmanager
def _module_limit(limit: int, where: Path):
    """Stop building a model (in this thread) once it registers more than ``limit`` submodules."""
    from torch.nn.modules.module import register_module_module_registration_hook

    thread = threading.get_ident()
    count = 0

    def hook(module, name, submodule):
        nonlocal count
        if threading.get_ident() == thread:
            count += 1
            if count > limit:
                raise _TooManyModules(f"{where}: the saved configuration describes far more modules than the saved "
                                      f"tensors can fill (over {limit}); refusing to build it")

    handle = register_module_module_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _model_class(library: str, name: str, meta_path: Path) -> type:
    """A model class by name, only among diffusers' or transformers' exported model classes."""
    if not name.isidentifier():
        raise LoadError(f"{meta_path}: invalid class name {_clip(name)}")
    if library == "diffusers":
        import diffusers

        base = diffusers.ModelMixin
        module = diffusers
    else:
        import transformers

        base = transformers.PreTrainedModel
        module = transformers
    try:
        cls = getattr(module, name)
    except Exception:  # lazy modules raise ImportError, RuntimeError... for unavailable backends
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise LoadError(f"{meta_path}: {name!r} is not a {library} model class")
    return cls


def meta_copy(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` whose parameters and buffers are on the meta device.

    No weight is copied; the original is not modified.
    """
    import copy

    memo: dict[int, Any] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if id(tensor) in memo:
            continue
        empty = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = empty
    copied = copy.deepcopy(module, memo)
    copied.__dict__.pop("_transformdsl_history", None)
    return copied


class _TensorFiles:
    """The safetensors files of one saved module, opened through the save's folder.

    Each is opened once, by name relative to the folder, not following links, and
    checked on its descriptor (a regular file); safetensors then reads it through
    ``/proc/self/fd/N`` (:meth:`SaveDir.fd_path`), so what is checked is what is read.
    """

    def __init__(self, folder: SaveDir, names: list[str]):
        self.folder = folder
        self.opened: list[tuple[str, int, str]] = []  # (name, descriptor, path to hand to safetensors)
        try:
            for name in names:
                fd = folder.open_file(name, what="tensor file")
                self.opened.append((name, fd, folder.fd_path(fd, name)))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for _, fd, _ in self.opened:
            os.close(fd)
        self.opened = []

    def count_tensors(self) -> list[int]:
        """Per file, how many non-empty tensors its header lists (safetensors checks the
        header's size, JSON, dtypes, shapes and offsets against the file before mapping
        anything)."""
        from safetensors import safe_open

        counts = []
        for name, _, source in self.opened:
            path = self.folder.path / name
            try:
                with safe_open(source, framework="pt") as f:
                    count = 0
                    for key in f.keys():
                        if not is_padding(key) and math.prod(f.get_slice(key).get_shape()) > 0:
                            count += 1
            except Exception as exc:
                raise LoadError(f"{path}: corrupt or truncated safetensors file: {exc}") from None
            counts.append(count)
        return counts

    def read(self, device: torch.device, mmap: bool) -> dict[str, torch.Tensor]:
        """Every saved tensor, by name.

        With ``mmap`` (the default) tensors are views of the memory-mapped files (copy on
        write): loading costs what mapping the files costs, and pages are read when first
        used.  Files are written with 64-byte aligned tensors (:mod:`.safetensors_io`), so
        mapped tensors compute exactly as freshly allocated ones.  Without ``mmap`` the
        bytes are copied into fresh memory.
        """
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for name, _, source in self.opened:
            path = self.folder.path / name
            try:
                part = load_file(source, device=str(device))
            except Exception as exc:  # SafetensorError, OSError, and torch's errors for odd dtypes
                raise LoadError(f"{path}: cannot read the tensors to {device}: {type(exc).__name__}: {exc}") from None
            for key, tensor in part.items():
                if is_padding(key):
                    continue
                if key in tensors:
                    raise LoadError(f"{path}: tensor '{key}' is stored twice")
                aligned = tensor.numel() == 0 or tensor.data_ptr() % 64 == 0
                # Misaligned data (a file not written by transformdsl) is copied: see above.
                tensors[key] = tensor if (mmap and aligned) else tensor.clone()
        return tensors


def _assign(skeleton: nn.Module, tensors: dict[str, torch.Tensor], meta: dict, directory: Path) -> None:
    layout = meta["tensors"]
    aliases: dict[str, str] = layout.get("aliases", {})
    nonpersistent = set(layout.get("nonpersistent", []))
    expected = dict(skeleton.state_dict(keep_vars=True))
    buffers = dict(skeleton.named_buffers(remove_duplicate=False))
    for name in nonpersistent:
        if name not in buffers:
            raise LoadError(f"{directory}: saved buffer '{name}' does not exist in this architecture")
        expected[name] = buffers[name]
    for key, target in aliases.items():
        if target not in tensors:
            raise LoadError(f"{directory}: alias '{key}' points to missing tensor '{target}'")
        if key in tensors:
            raise LoadError(f"{directory}: alias '{key}' would replace the stored tensor of that name")
        want, source = expected.get(key), expected.get(target)
        if isinstance(want, nn.Parameter) and isinstance(source, nn.Parameter) and want is not source:
            raise LoadError(f"{directory}: alias '{key}' -> '{target}' would tie two parameters that this "
                            "architecture keeps apart")
    for key, target in aliases.items():
        tensors[key] = tensors[target]
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:5])}")
        raise LoadError(f"{directory}: the saved tensors do not match the architecture "
                        f"({'; '.join(parts)}); was it saved from another model?")
    for key, want in expected.items():
        got = tensors[key]
        if want is None or not isinstance(want, torch.Tensor):
            continue
        # A model cast to another float precision (bfloat16, float16) is the same model;
        # any other dtype difference (int8, float8, packed data) is not.
        same_kind = got.dtype == want.dtype or (got.dtype in _PRECISIONS and want.dtype in _PRECISIONS)
        if tuple(got.shape) != tuple(want.shape) or not same_kind:
            raise LoadError(f"{directory}: tensor '{key}' is {_describe(got)} in the file but the model expects "
                            f"{_describe(want)}; was it saved from another model?")
    state = {k: v for k, v in tensors.items() if k not in nonpersistent}
    try:
        skeleton.load_state_dict(state, strict=True, assign=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise LoadError(f"{directory}: cannot load the saved tensors: {exc}") from None
    for name in nonpersistent:
        owner, attr = _owner(skeleton, name)
        owner._buffers[attr] = tensors[name]
    # Tied weights (saved once; the architecture ties them, checked above) are one
    # Parameter again, as they were.
    for key, target in aliases.items():
        (owner, attr), (source, source_attr) = _owner(skeleton, key), _owner(skeleton, target)
        if attr in owner._parameters and source_attr in source._parameters:
            owner._parameters[attr] = source._parameters[source_attr]


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


_PRECISIONS = (torch.float32, torch.float16, torch.bfloat16)


def _describe(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}{list(tensor.shape)}"


def _load_pipeline(folder: SaveDir, meta: dict, device: torch.device, mmap: bool) -> Any:
    """A saved pipeline, assembled by calling its class with an explicit mapping of the
    components its signature declares: no name from a file becomes a keyword argument,
    and diffusers' own loading (custom pipelines, remote code) is never entered."""
    import diffusers

    path = folder.path / META_FILE
    name = meta["pipeline_class"]  # read_metadata checked the types
    try:
        cls = getattr(diffusers, name) if name.isidentifier() else None
    except Exception:  # diffusers' lazy module raises for pipelines whose backend is missing
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise LoadError(f"{path}: {_clip(name)} is not a diffusers pipeline class")
    guard.offline_constants()
    expected, optional = cls._get_signature_keys(cls)
    components_meta: dict[str, str] = meta["components"]
    index_path = folder.path / "model_index.json"
    if not folder.exists("model_index.json"):
        raise LoadError(f"{index_path}: cannot read the pipeline index: missing")
    index = _read_json(folder, "model_index.json", "pipeline index")
    _check_pipeline_index(index_path, index, name, components_meta, set(expected), set(optional))
    loaded: dict[str, Any] = {}
    for comp in sorted(expected):
        how = components_meta.get(comp)
        if how is None:
            loaded[comp] = None  # an absent optional component ([null, null] in the index)
            continue
        sub = folder.subdir(comp)
        if how == "transformdsl":
            loaded[comp] = load_module(sub, read_metadata(sub), None, device, mmap)
        else:
            library, class_name = index[comp]
            loaded[comp] = _load_library_component(library, class_name, sub, index_path)
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


def _check_pipeline_index(index_path: Path, index: Any, name: str, components: dict[str, str],
                          expected: set[str], optional: set[str]) -> None:
    """``model_index.json`` and the metadata's components against the pipeline class: every
    component is one the class declares, every declared one is saved or explicitly absent."""
    if not isinstance(index, dict):
        raise LoadError(f"{index_path}: cannot read the pipeline index: not a JSON object")
    if index.get("_class_name") != name:
        # A [file, class] pair here is custom pipeline code diffusers would run.
        raise LoadError(f"{index_path}: model_index.json names {_clip(index.get('_class_name'))}, "
                        f"the metadata '{name}'")
    declared = ", ".join(sorted(expected))
    for comp in components:
        if comp not in expected:
            raise LoadError(f"{index_path.parent / META_FILE}: {_clip(comp)} is not a component of {name} "
                            f"(its components: {declared}); refusing to pass it on")
    for key, entry in index.items():
        if key.startswith("_"):
            continue  # diffusers' own keys
        if key not in expected and key not in optional:
            raise LoadError(f"{index_path}: {_clip(key)} is neither a component nor an argument of {name}")
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


def _load_library_component(library: str, name: str, folder: SaveDir, index_path: Path) -> Any:
    """An untransformed pipeline component, loaded by its library from the opened folder.

    Before the library sees the folder: no entry is a symbolic link or anything but a
    regular file or folder; no JSON file in it names code, a hub repository or a kernel
    (:func:`_check_config`), or a weights file outside the folder (shard indexes).  The
    library gets the folder as ``/proc/self/fd/N`` (the folder checked, not its name),
    ``local_files_only``, ``use_safetensors`` and ``trust_remote_code=False``.
    """
    if library not in ("diffusers", "transformers") or not name.isidentifier():
        raise LoadError(f"{index_path}: component class {_clip(library)[1:-1]}.{_clip(name)[1:-1]} is not allowed "
                        "(only diffusers and transformers classes are loaded)")
    import diffusers
    import transformers

    guard.offline_constants()
    module = diffusers if library == "diffusers" else transformers
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
            kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
            raise LoadError(f"{folder.path / rel}: is {kind}; refusing to read it")
    scheduler = issubclass(cls, diffusers.SchedulerMixin)
    for rel in sorted(files):
        if not rel.endswith(".json"):
            continue
        holder, name = folder.descend(rel)
        content = _read_json(holder, name, "component file")
        _check_config(folder.path / rel, content, scheduler=scheduler)
        if rel.endswith(".index.json"):
            _check_shard_index(folder.path / rel, content, files)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if library == "transformers":
        kwargs["trust_remote_code"] = False
    limit = contextlib.nullcontext()
    if issubclass(cls, nn.Module):
        kwargs["use_safetensors"] = True
        weights = _TensorFiles(folder, sorted(r for r in files if "/" not in r and r.endswith(".safetensors")))
        try:
            saved = sum(weights.count_tensors())
        finally:
            weights.close()
        limit = _module_limit(_module_budget(saved), folder.path)
    try:
        with limit:
            return cls.from_pretrained(folder.fd_path(), **kwargs)
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(f"{folder.path}: cannot load {library}.{name}: {type(exc).__name__}: {exc}") from None


def _check_shard_index(path: Path, index: Any, files: set[str]) -> None:
    """A library's shard index may name only weights files of its own folder."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise LoadError(f"{path}: a shard index without a weight_map")
    for target in set(weight_map.values()):
        if not isinstance(target, str) or target not in files or "/" in target:
            raise LoadError(f"{path}: the shard index names {_clip(target)}, which is not a file of this folder; "
                            "refusing to read weights from elsewhere")


# =========================================================================== inspect


def _interop_summary(value: Any) -> dict | None:
    from .interop import summary

    return summary(value)


def inspect(directory: str | os.PathLike) -> dict:
    """What a saved model contains, from headers only (no tensor data is read).

    Text in the result (scripts, names) comes from the files as it is: escape it before
    printing it to a terminal (the ``inspect`` command does).
    """
    try:
        with SaveDir.open(directory) as folder:
            return _inspect(folder)
    except OSError as exc:
        raise LoadError(f"{directory}: cannot read the save: {exc.strerror or exc}") from None


def _inspect(folder: SaveDir) -> dict:
    from safetensors import safe_open

    if not folder.exists(META_FILE) and folder.exists("config.json"):
        from .interop.imports import library_metadata

        meta = library_metadata(folder)[0]  # a diffusers/transformers checkpoint: what load() would read
    else:
        meta = read_metadata(folder)
    if meta["kind"] == "pipeline":
        parts = {}
        for comp, how in meta["components"].items():
            parts[comp] = _inspect(folder.subdir(comp)) if how == "transformdsl" else {"storage": how}
        return {"kind": "pipeline", "format_version": meta["format_version"],
                "pipeline_class": meta["pipeline_class"], "components": parts}
    by_dtype: dict[str, dict[str, int]] = {}
    files = _TensorFiles(folder, meta["tensors"]["files"])
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
        **({"interop": _interop_summary(meta.get("interop"))} if meta.get("interop") is not None else {}),
    }
