"""Loading a saved module: the one reader of saved tensors.

Loading never unpickles or evaluates anything: metadata is JSON checked field by field
(:mod:`.checks`), classes are looked up by name among diffusers' and transformers' model
classes only, tensors come from safetensors files opened through the save's folder.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import registry
from ..errors import LoadError
from ..history import AppliedStep, History, set_history
from . import plain_tensors
from .checks import check_record, rebuild_options, sanitized
from .format import META_FILE, clipped
from .safetensors_io import is_padding
from .savedir import SaveDir


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
    opened = open_module(folder, meta, model)
    try:
        tensors = opened.files.read(device, mmap and device.type == "cpu")
    finally:
        opened.close()
    skeleton = opened.skeleton
    attributes = meta["tensors"].get("attributes", {})
    attribute_tensors = plain_tensors.take(tensors, attributes, folder.path)
    if meta["tensors"].get("layout"):
        from ..interop import layout

        expected = {key: tuple(t.shape) for key, t in skeleton.state_dict(keep_vars=True).items()
                    if isinstance(t, torch.Tensor)}
        tensors = layout.to_own(tensors, meta["tensors"]["layout"], folder.path, expected)
    assign_tensors(skeleton, tensors, meta, folder.path)
    plain_tensors.restore(skeleton, attributes, attribute_tensors, folder.path)
    opened.finalize()
    left = [n for n, t in list(skeleton.named_parameters()) + list(skeleton.named_buffers()) if t.is_meta]
    if left:
        raise LoadError(f"{folder.path}: the saved tensors do not cover {len(left)} tensor(s) of the model: "
                        + ", ".join(left[:5]))
    skeleton.eval()
    set_history(skeleton, saved_history(meta))
    return skeleton


def saved_history(meta: dict) -> History:
    """The scripts and steps a save's (checked) metadata lists, as a loaded model carries them."""
    return History(list(meta["scripts"]), [AppliedStep(**{k: raw[k] for k in AppliedStep.__dataclass_fields__ if k in raw})
                                           for raw in meta["steps"]])


@dataclasses.dataclass
class OpenedModule:
    """A saved module before its tensors are read: the files opened and checked, the
    architecture built (on the meta device) and the saved steps' structure replayed on it."""

    folder: SaveDir
    meta: dict
    files: TensorFiles
    skeleton: nn.Module
    #: (transform class, raw step, checked options) per saved step, in order.
    steps: list[tuple[type, dict, Any]]

    def finalize(self) -> None:
        """Each saved step's :meth:`~transformdsl.extend.Transform.finalize`, once its tensors are in place."""
        meta_path = self.folder.path / META_FILE
        for cls, raw, options in self.steps:
            with _step_errors(meta_path, raw, "cannot finish"):
                cls.finalize(self.skeleton, raw["record"], options)

    def close(self) -> None:
        self.files.close()


def open_module(folder: SaveDir, meta: dict, model: Any) -> OpenedModule:
    """Open a saved module's tensor files and build its skeleton (no tensor data is read).

    Every tensor file is opened (and checked on its descriptor) first; headers next: a
    corrupt file is reported before anything is built, and the number of saved tensors
    bounds the size of the model the metadata may describe.  The caller closes the result.
    """
    meta_path = folder.path / META_FILE
    files = TensorFiles(folder, meta["tensors"]["files"])
    try:
        saved = sum(files.count_tensors())
        aliases = meta["tensors"].get("aliases", {})
        if len(aliases) > module_budget(saved):
            raise LoadError(f"{meta_path}: {len(aliases)} tensor aliases for {saved} saved tensors; refusing")
        skeleton = _skeleton(meta, model, meta_path, max_modules=module_budget(saved))
        steps = []
        for raw in meta["steps"]:
            cls = registry.get(raw["key"])
            if raw.get("record_version", 1) > cls.record_version:
                raise LoadError(f"{meta_path}: step '{raw['key']}' was saved with record version "
                                f"{raw['record_version']}, and this transformdsl reads '{raw['key']}' records up to "
                                f"version {cls.record_version}: load it with the transformdsl that saved it (or newer)")
            options = rebuild_options(cls, raw["options"], meta_path, raw["key"])
            rebuild_options(cls, raw["common"], meta_path, raw["key"], common=True)
            check_record(cls, raw, options, meta_path)
            # the layers a pass rebuilds are skeletons too (bitsandbytes' layers are nn.Linear:
            # their constructor would initialise a meta weight, through slow meta kernels)
            with _step_errors(meta_path, raw, "cannot replay", "on this architecture"), no_weight_init():
                cls.rebuild(skeleton, raw["record"], options)
            steps.append((cls, raw, options))
    except BaseException:
        files.close()
        raise
    return OpenedModule(folder, meta, files, skeleton, steps)


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
        config = sanitized(config)
    if library is None or not isinstance(config, dict):
        raise LoadError(f"{meta_path}: the saved model ({name}) has no configuration to rebuild it from; "
                        "pass model= (a module of the same architecture, or a factory)")
    cls = lookup_model_class(library, name, meta_path)
    try:
        with torch.device("meta"), module_limit(max_modules, meta_path), no_weight_init():
            if library == "diffusers":
                return cls.from_config(config)
            config_cls = cls.config_class
            return cls(config_cls.from_dict(config))
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(f"{meta_path}: cannot build {name} from the saved configuration: "
                        f"{type(exc).__name__}: {exc}") from None


def module_budget(tensors: int) -> int:
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
def module_limit(limit: int, where: Path):
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


#: ``torch.nn.init`` functions skipped while a skeleton is built: on the meta device they compute
#: nothing, but each still runs through the device mode's dispatch (half the build time of a
#: small model).  transformers' ``no_init_weights`` keeps the same list.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "xavier_uniform_", "xavier_normal_",
                   "kaiming_uniform_", "kaiming_normal_", "uniform", "normal", "xavier_uniform", "xavier_normal",
                   "kaiming_uniform", "kaiming_normal", "orthogonal_", "sparse_", "zeros_", "ones_", "eye_",
                   "dirac_")
_init_lock = threading.Lock()
_init_threads: dict[int, int] = {}  # thread -> depth (pipelines load their components inside a load)
_init_saved: dict[str, Callable] = {}


def _skipping(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def init(tensor, *args, **kwargs):
        if getattr(tensor, "is_meta", False) and threading.get_ident() in _init_threads:
            return tensor
        return original(tensor, *args, **kwargs)  # a real tensor, or another thread's model

    return init


@contextlib.contextmanager
def no_weight_init():
    """In this thread, ``torch.nn.init`` initialisers return a meta tensor untouched (a real tensor,
    or another thread's, gets the real function)."""
    thread = threading.get_ident()
    with _init_lock:
        if not _init_threads:
            for name in _INIT_FUNCTIONS:
                original = getattr(nn.init, name, None)
                if original is not None:
                    _init_saved[name] = original
                    setattr(nn.init, name, _skipping(name, original))
        _init_threads[thread] = _init_threads.get(thread, 0) + 1
    try:
        yield
    finally:
        with _init_lock:
            _init_threads[thread] -= 1
            if not _init_threads[thread]:
                del _init_threads[thread]
            if not _init_threads:
                for name, original in _init_saved.items():
                    setattr(nn.init, name, original)
                _init_saved.clear()


def lookup_model_class(library: str, name: str, meta_path: Path) -> type:
    """A model class by name, only among diffusers' or transformers' exported model classes."""
    if not name.isidentifier():
        raise LoadError(f"{meta_path}: invalid class name {clipped(name)}")
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


#: Bytes per element of safetensors' dtype names.
_ITEM_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}


class TensorFiles:
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

    def stamps(self) -> list[tuple[int, int, int]]:
        """Per file, ``(inode, size, modification time in ns)`` of the open descriptor: a file
        rewritten in place while it is read changes its stamp (a file replaced by a rename does not,
        and is not read: the descriptor still holds the old one)."""
        stamps = []
        for _, fd, _ in self.opened:
            info = os.fstat(fd)
            stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
        return stamps

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

    def shapes(self) -> dict[str, tuple[str, list[int]]]:
        """Saved tensor name → (safetensors dtype, shape), from the headers (each parsed once)."""
        from safetensors import safe_open

        shapes: dict[str, tuple[str, list[int]]] = {}
        for name, _, source in self.opened:
            try:
                with safe_open(source, framework="pt") as f:
                    for key in f.keys():
                        if not is_padding(key):
                            piece = f.get_slice(key)
                            shapes[key] = (piece.get_dtype(), list(piece.get_shape()))
            except Exception as exc:
                raise LoadError(f"{self.folder.path / name}: corrupt or truncated safetensors file: {exc}") from None
        return shapes

    def sizes(self) -> dict[str, tuple[int, int]]:
        """Saved tensor name → (its file's position in :attr:`opened`, bytes), from the headers."""
        from safetensors import safe_open

        sizes: dict[str, tuple[int, int]] = {}
        for i, (name, _, source) in enumerate(self.opened):
            try:
                with safe_open(source, framework="pt") as f:
                    for key in f.keys():
                        if is_padding(key):
                            continue
                        if key in sizes:
                            raise LoadError(f"{self.folder.path / name}: tensor '{key}' is stored twice")
                        piece = f.get_slice(key)
                        sizes[key] = (i, math.prod(piece.get_shape()) * _ITEM_BYTES.get(piece.get_dtype(), 1))
            except LoadError:
                raise
            except Exception as exc:
                raise LoadError(f"{self.folder.path / name}: corrupt or truncated safetensors file: {exc}") from None
        return sizes

    def read_some(self, names: list[str], sizes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        """The named tensors only (names the files lack are left out), to the CPU.

        Each is a copy-on-write map of its bytes, released with the tensor, like :meth:`read`'s
        (and copied when misaligned, as :meth:`read` does): reading a model part by part holds
        the part being read, not the files.
        """
        from safetensors import safe_open

        by_file: dict[int, list[str]] = {}
        for key in names:
            if key in sizes:
                by_file.setdefault(sizes[key][0], []).append(key)
        tensors: dict[str, torch.Tensor] = {}
        for i, keys in sorted(by_file.items()):
            name, _, source = self.opened[i]
            try:
                with safe_open(source, framework="pt") as f:
                    for key in keys:
                        tensor = f.get_tensor(key)
                        aligned = tensor.numel() == 0 or tensor.data_ptr() % 64 == 0
                        tensors[key] = tensor if aligned else tensor.clone()
            except Exception as exc:
                raise LoadError(f"{self.folder.path / name}: cannot read the tensors: {type(exc).__name__}: "
                                f"{exc}") from None
        return tensors

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


def assign_tensors(skeleton: nn.Module, tensors: dict[str, torch.Tensor], meta: dict, directory: Path,
            only: Callable[[str], bool] | None = None) -> None:
    """Put the saved ``tensors`` in the skeleton, checked against what it expects.

    With ``only``, just the tensors whose names it accepts (a part of the model: ``convert``
    reads a model unit by unit); the rest of the skeleton is left as it is.
    """
    layout = meta["tensors"]
    aliases: dict[str, str] = layout.get("aliases", {})
    nonpersistent = set(layout.get("nonpersistent", []))
    if only is not None:  # the other parts may be written and dropped already (convert): not looked at
        nonpersistent = {name for name in nonpersistent if only(name)}
    expected = dict(skeleton.state_dict(keep_vars=True))
    buffers = dict(skeleton.named_buffers(remove_duplicate=False))
    for name in nonpersistent:
        if name not in buffers:
            raise LoadError(f"{directory}: saved buffer '{name}' does not exist in this architecture")
        expected[name] = buffers[name]
    if only is not None:
        expected = {key: value for key, value in expected.items() if only(key)}
        aliases = {key: target for key, target in aliases.items() if only(key)}
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
            # a float precision is the file's to choose: the expectation is said in the file's own
            expects = _describe(want, got.dtype if same_kind else None)
            raise LoadError(f"{directory}: tensor '{key}' is {_describe(got)} in the file but the model expects "
                            f"{expects}; was it saved from another model?")
    state = {k: v for k, v in tensors.items() if k not in nonpersistent}
    try:
        _load_assigned(skeleton, state, strict=only is None)
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


def _plain(module: nn.Module) -> bool:
    """Whether ``module`` loads as ``nn.Module`` itself does: no loader, hook or extra state of its own."""
    cls = type(module)
    return (cls._load_from_state_dict is nn.Module._load_from_state_dict and not module._load_state_dict_pre_hooks
            and getattr(cls, "set_extra_state", nn.Module.set_extra_state) is nn.Module.set_extra_state)


def _load_assigned(root: nn.Module, state: dict[str, torch.Tensor], strict: bool) -> None:
    """``root.load_state_dict(state, strict=strict, assign=True)``, the same result (errors in
    its own words: the caller has checked the keys and shapes already), without its scans: ``load_state_dict`` hands every module a copy of the keys under it and
    looks through them for strays, work in the number of keys times the depth of the tree (most
    of the cost of loading a small model; the caller has checked the keys already).  A module
    with a loader of its own (quantized layers, extra state, hooks) gets exactly what
    ``load_state_dict`` would give it."""
    if torch.__future__.get_swap_module_params_on_conversion():
        root.load_state_dict(state, strict=strict, assign=True)
        return
    keys = sorted(state)
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []

    def under(prefix: str) -> dict[str, torch.Tensor]:
        """The keys ``load_state_dict`` would give the module at ``prefix`` (one range of ``keys``)."""
        if not prefix:
            return dict(state)
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        return {k: state[k] for k in keys[bisect.bisect_left(keys, prefix):bisect.bisect_left(keys, end)]}

    def load(module: nn.Module, prefix: str) -> None:
        if _plain(module):
            own = [*module._parameters.items(),
                   *((k, v) for k, v in module._buffers.items() if k not in module._non_persistent_buffers_set)]
            for name, current in own:
                if current is None:
                    continue
                key = prefix + name
                if key not in state:
                    missing.append(key)
                    continue
                value = state[key]
                if value.shape != current.shape:
                    errors.append(f"size mismatch for {key}: copying a param with shape {value.shape} from "
                                  f"checkpoint, the shape in current model is {current.shape}.")
                    continue
                if isinstance(current, nn.Parameter):  # as assign=True does: requires_grad from the model
                    value = (value.requires_grad_(current.requires_grad) if isinstance(value, nn.Parameter)
                             else nn.Parameter(value, requires_grad=current.requires_grad))
                setattr(module, name, value)
        else:
            module._load_from_state_dict(under(prefix), prefix, {"assign_to_params_buffers": True}, True,
                                         missing, unexpected, errors)
        for name, child in module._modules.items():
            if child is not None:
                load(child, prefix + name + ".")  # noqa: F821 (deleted after use, below)
        incompatible = torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
        for hook in module._load_state_dict_post_hooks.values():
            hook(module, incompatible)

    try:
        load(root, "")
    finally:
        del load  # the closure refers to itself: the cycle would hold the tensors until a collection
    if strict and (missing or unexpected):
        errors.insert(0, f"missing key(s): {missing[:5]}; unexpected key(s): {unexpected[:5]}")
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(root).__name__}:\n\t" + "\n\t".join(errors))


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


_PRECISIONS = (torch.float32, torch.float16, torch.bfloat16)


def _describe(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    dtype = str(dtype or tensor.dtype).removeprefix("torch.")
    return f"{dtype}{list(tensor.shape)}"
