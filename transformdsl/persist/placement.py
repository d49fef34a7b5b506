"""Placing a loaded model across devices, CPU and disk: ``load(dir, device_map=...)``.

The map is accelerate's: ``{"module.path": device}`` with devices ``0``/``"cuda:1"``..., ``"cpu"``,
``"disk"`` and ``"meta"``, or ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` / ``"sequential"``,
which accelerate's :func:`~accelerate.infer_auto_device_map` computes from ``max_memory`` (default:
what the devices have free), never splitting a module of the model's ``_no_split_modules`` nor
one of the layers a transform put in (fp8, bitsandbytes, hqq, int8 weight-only...: a quantized
layer lands whole, and stays quantized where it lands).

Placement itself is done here rather than by accelerate's ``dispatch_model``: its hooks move
tensors through ``setattr``/``getattr`` and rebuild parameters by class, which turns an fp8 layer's
stored weight into its dequantized value (the layer reads ``weight`` as a property), asks a CUDA
device for bitsandbytes int8 on a CPU and leaves 4-bit quantization state on the meta device.
Here tensors keep their objects and classes; only their storage moves:

- a device (``"cpu"``, ``"cuda:N"``...): the module's tensors move there (``Module._apply``, which
  the quantized layers implement); a pre-forward hook sends its inputs to that device, and the
  model's outputs come back to the device of its first placed module;
- ``"disk"``: the module's tensors are written to ``offload_folder`` (one safetensors file per
  module: every dtype bit for bit, int8, uint8, float8 and bfloat16 included) and replaced by views
  of that file, memory-mapped; the module runs on the CPU, and after each of its forwards its pages
  are given back to the system, so it costs memory only while it runs;
- ``"meta"``: the module's tensors are dropped (meta tensors: shapes and dtypes, no data); calling
  it fails.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import LoadError

#: ``device_map`` strings that ask accelerate to compute the map.
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
#: Places that are not torch devices of their own.
OFFLOAD = ("disk", "meta")
#: Modules whose classes come from these packages are transformed layers: never split.
_REPLACEMENT_PACKAGES = ("transformdsl.", "bitsandbytes.", "hqq.")


def no_split_classes(model: nn.Module) -> list[str]:
    """Class names accelerate may not split: the model's ``_no_split_modules`` and every layer class a
    transform put in (quantized, fp8, fused)."""
    names = list(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        cls = type(module)
        if cls.__module__.startswith(_REPLACEMENT_PACKAGES) and cls.__name__ not in names:
            names.append(cls.__name__)
    return names


def place(model: nn.Module, device_map: str | Mapping, *, max_memory: Mapping | None = None,
          offload_folder: str | os.PathLike | None = None, where: str = "load") -> nn.Module:
    """Put ``model``'s modules where ``device_map`` says (see the module's docstring); return it.

    ``model.hf_device_map`` is set to the map used (as transformers and diffusers do).  A map that
    names no module of the model, a device that is not on this machine, ``"disk"`` without
    ``offload_folder``, or modules left out of an explicit map are :class:`LoadError`.
    """
    resolved = _resolve(model, device_map, max_memory, where)
    if "disk" in resolved.values() and offload_folder is None:
        disk = [k for k, v in resolved.items() if v == "disk"]
        raise LoadError(f"{where}(device_map=...): {len(disk)} module(s) go to the disk ({_names(disk)}); "
                        "pass offload_folder=DIR, a directory for their weights")
    folder = Path(offload_folder) if offload_folder is not None else None
    if folder is not None and "disk" in resolved.values():
        folder = offload_directory(folder, where)
    devices = {_device(v) for v in resolved.values() if v not in OFFLOAD}
    main = next((_device(v) for v in resolved.values() if v not in OFFLOAD), torch.device("cpu"))
    cpu = torch.device("cpu")
    route = len(devices | ({cpu} if "disk" in resolved.values() else set())) > 1
    owned = _tensors_by_key(model, resolved)
    for path, where_to in _units(resolved):
        module = model.get_submodule(path) if path else model
        if where_to == "meta":
            _to_meta(module, owned.get(path, []))
        elif where_to == "disk":
            _offload(module, path, owned.get(path, []), folder, where)
        else:
            _move(owned.get(path, []), _device(where_to), path, where)
        if route and path and where_to != "meta":
            for called in _called(module):
                _send_inputs(called, cpu if where_to == "disk" else _device(where_to))
    if route:
        model.register_forward_hook(lambda _module, _args, output: _send(output, main))
    model.hf_device_map = dict(resolved)
    return model


# ---------------------------------------------------------------------- the map

def _resolve(model: nn.Module, device_map: Any, max_memory: Mapping | None, where: str) -> dict[str, Any]:
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise LoadError(f"{where}(device_map={device_map!r}): expected a dict {{module: device}} or one of "
                            f"{', '.join(map(repr, STRATEGIES))}")
        return _infer(model, device_map, max_memory, where)
    if not isinstance(device_map, Mapping):
        raise LoadError(f"{where}(device_map=...): expected a dict {{module: device}} or 'auto', "
                        f"not {type(device_map).__name__}")
    if max_memory is not None:
        raise LoadError(f"{where}(max_memory=...): only used to compute a map (device_map='auto'); "
                        "an explicit map says where everything goes")
    names = {name for name, _ in model.named_modules()}
    resolved = {}
    for key, value in device_map.items():
        if not isinstance(key, str) or key not in names:
            near = difflib.get_close_matches(str(key), sorted(names), n=3)
            raise LoadError(f"{where}(device_map=...): the model has no module {key!r}"
                            + (f" (did you mean {', '.join(map(repr, near))}?)" if near else
                               "; keys are module paths as in model.named_modules(), '' for the whole model"))
        resolved[key] = _check_place(value, key, where)
    uncovered = [name for name, _ in _tensors(model) if _owner_key(name, resolved) is None]
    if uncovered:
        raise LoadError(f"{where}(device_map=...): {len(uncovered)} tensor(s) belong to no module of the map "
                        f"({_names(uncovered)}); add their modules, or '' for everything else")
    return resolved


def _infer(model: nn.Module, strategy: str, max_memory: Mapping | None, where: str) -> dict[str, Any]:
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory, get_max_memory

    no_split = no_split_classes(model)
    try:
        memory = get_max_memory(dict(max_memory) if max_memory is not None else None)
        if strategy != "sequential":
            memory = get_balanced_memory(model, max_memory=memory, no_split_module_classes=no_split,
                                         low_zero=strategy == "balanced_low_0")
        for key in memory:
            _check_place("cpu" if key == "cpu" else "disk" if key == "disk" else key, f"max_memory[{key!r}]", where)
        resolved = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    except (ValueError, RuntimeError, AssertionError, KeyError) as exc:
        raise LoadError(f"{where}(device_map={strategy!r}, max_memory={max_memory!r}): {exc}") from None
    return {key: _check_place(value, key, where) for key, value in resolved.items()}


def _check_place(value: Any, key: str, where: str) -> Any:
    """``value`` if it is a place on this machine, else a LoadError naming ``key`` and the devices there are."""
    if value in OFFLOAD:
        return value
    try:
        device = _device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise LoadError(f"{where}(device_map=...): {key!r} -> {value!r} is not a device ({exc}); "
                        f"expected {_available()} or 'disk'") from None
    if device.type == "cpu":
        if device.index:  # torch takes 'cpu:7' for the CPU: a map meaning another device would be misread
            raise LoadError(f"{where}(device_map=...): {key!r} -> {value!r}: the CPU is one device, 'cpu' "
                            f"(there are {_available()}, and 'disk')")
        return "cpu"
    backend = getattr(torch, device.type, None)
    count = getattr(backend, "device_count", None)
    present = count() if callable(count) and getattr(backend, "is_available", lambda: False)() else 0
    if device.index is not None and device.index >= present or present == 0:
        raise LoadError(f"{where}(device_map=...): {key!r} -> {value!r}: no such device on this machine "
                        f"(there are {_available()}, and 'disk')")
    return value


def _available() -> str:
    names = ["'cpu'"]
    if torch.cuda.is_available():
        names += [str(i) for i in range(torch.cuda.device_count())]
    return ", ".join(names)


def _device(value: Any) -> torch.device:
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return torch.device(value)


def _owner_key(name: str, resolved: Mapping[str, Any]) -> str | None:
    """The most specific key of the map that contains the module or tensor ``name``."""
    best = None
    for key in resolved:
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    return best


def _units(resolved: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(module path, place) for every key, shallow first, so that a deeper key overrides its parent."""
    return sorted(resolved.items(), key=lambda item: (item[0].count(".") + (item[0] != ""), item[0]))


def _tensors(model: nn.Module):
    for path, module in model.named_modules():
        for container in ("_parameters", "_buffers"):
            for name, tensor in vars(module)[container].items():
                if tensor is not None:
                    yield (f"{path}.{name}" if path else name), tensor


def _names(names: list[str], limit: int = 5) -> str:
    return ", ".join(repr(n) for n in names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------------- putting modules in place

def _tensors_by_key(model: nn.Module, resolved: Mapping[str, Any]) -> dict[str, list[tuple[nn.Module, str, str]]]:
    """(owner module, container, name) of every tensor, under the most specific key of the map holding it."""
    out: dict[str, list] = {}
    for path, module in model.named_modules():
        key = _owner_key(path, resolved) if path else ("" if "" in resolved else None)
        for container in ("_parameters", "_buffers"):
            for name, tensor in vars(module)[container].items():
                if tensor is not None and key is not None:
                    out.setdefault(key, []).append((module, container, name))
    return out


def _move(owned: list[tuple[nn.Module, str, str]], device: torch.device, path: str, where: str) -> None:
    """Move the unit's tensors (not those of deeper keys): a layer that says how (``place_on(device)``,
    e.g. hqq's, whose ``.to()`` does nothing), a layer with its own ``.to()`` (quantized layers move their
    quantization state with it), the tensors of a module with children with ``_apply`` on that module
    alone."""
    owners = {id(owner): owner for owner, _, _ in owned}
    try:
        for owner in owners.values():
            place_on = getattr(type(owner), "place_on", None)
            if place_on is not None:
                place_on(owner, device)
            elif next(owner.children(), None) is None:
                owner.to(device)
            else:
                owner._apply(lambda t: t.to(device), recurse=False)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        raise LoadError(f"{where}(device_map=...): cannot move {path or 'the model'!r} to {device}: {exc}") from None


def _to_meta(module: nn.Module, owned: list[tuple[nn.Module, str, str]]) -> None:
    """Shapes and dtypes without data: each tensor becomes a meta tensor (tied ones stay tied)."""
    done: dict[int, torch.Tensor] = {}
    for owner, container, name in owned:
        tensor = vars(owner)[container][name]
        if id(tensor) not in done:
            empty = torch.empty_like(tensor.detach().as_subclass(torch.Tensor), device="meta")
            done[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, nn.Parameter) else empty
        vars(owner)[container][name] = done[id(tensor)]


#: Files whose presence makes a folder a saved model (ours, a library's or a pipeline's).
_SAVE_FILES = ("transformdsl.json", "config.json", "model_index.json")


def offload_directory(folder: Path, where: str = "load") -> Path:
    """A new, empty folder inside ``folder`` (made if needed) to write offloaded tensors into.

    The offload files go to a fresh subfolder, so they never replace a file of the user's; a
    saved model (``folder`` holding ``transformdsl.json``, ``config.json`` or ``model_index.json``, or
    inside a transformdsl save) is refused: offloading there would add files to a save.  A ``folder``
    that is a file, or lies under one, is a :class:`LoadError`.
    """
    label = f"{where}(offload_folder={str(folder)!r})"
    resolved = folder.resolve()
    for holder in (resolved, *resolved.parents):
        # the folder itself, and the folders above it that are saves of ours (a pipeline's component)
        found = next((name for name in (_SAVE_FILES if holder == resolved else _SAVE_FILES[:1])
                      if (holder / name).exists()), None)
        if found:
            raise LoadError(f"{label}: {holder} holds {found}: it is a saved model, and offloading there would "
                            "write into it; give a directory of its own for the offloaded weights")
    try:
        resolved.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise LoadError(f"{label}: it exists and is not a directory; give a directory for the offloaded "
                        "weights") from None
    except NotADirectoryError:
        raise LoadError(f"{label}: a part of the path is a file, not a directory; give a directory for the "
                        "offloaded weights") from None
    except OSError as exc:
        raise LoadError(f"{label}: cannot make the directory: {exc.strerror or exc}") from None
    import tempfile

    try:
        return Path(tempfile.mkdtemp(prefix="transformdsl-offload-", dir=resolved))
    except OSError as exc:
        raise LoadError(f"{label}: cannot write there: {exc.strerror or exc}") from None


def _offload(module: nn.Module, path: str, owned: list[tuple[nn.Module, str, str]], folder: Path,
             where: str) -> None:
    """Write the unit's tensors to ``folder`` and make them memory-mapped views of that file (each
    tensor object, of whatever class, keeps its identity and attributes: only its storage changes)."""
    from safetensors.torch import load_file, save_file

    tensors: dict[int, torch.Tensor] = {}
    for owner, container, name in owned:
        tensor = vars(owner)[container][name]
        if not tensor.is_meta:
            tensors.setdefault(id(tensor), tensor)
    if not tensors:
        return
    plain = {f"t{i}": t.detach().as_subclass(torch.Tensor).to("cpu").contiguous()
             for i, t in enumerate(tensors.values())}
    target = folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", path or "model") + ".safetensors")
    try:
        save_file(plain, str(target))
        mapped = load_file(str(target))
    except (OSError, RuntimeError) as exc:
        raise LoadError(f"{where}(device_map=...): cannot offload {path or 'the model'!r} to {target}: {exc}") from None
    del plain
    for i, tensor in enumerate(tensors.values()):
        with torch.no_grad():
            tensor.data = mapped[f"t{i}"]
    # after each forward of a module that holds some of them, its pages go back (the unit itself may
    # be a container that is never called, such as a ModuleList of blocks)
    owners: dict[int, tuple[nn.Module, list[torch.Tensor]]] = {}
    for owner, container, name in owned:
        owners.setdefault(id(owner), (owner, []))[1].append(vars(owner)[container][name])
    for owner, held in owners.values():
        ranges = _page_ranges(held)
        owner.register_forward_hook(lambda *_, ranges=ranges: _give_back(ranges))
    for called in _called(module):
        if id(called) not in owners:
            ranges = _page_ranges(list(mapped.values()))
            called.register_forward_hook(lambda *_, ranges=ranges: _give_back(ranges))


def _called(module: nn.Module):
    """The modules that run for ``module``: itself, or for a container without a forward of its own
    (``ModuleList``, ``ModuleDict``), its children."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        for child in module.children():
            yield from _called(child)
    else:
        yield module


def _page_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    from ..spill import PAGE, page_span

    spans = sorted((t.data_ptr(), t.data_ptr() + page_span(t)) for t in tensors if t.numel())
    out: list[tuple[int, int]] = []
    for start, end in spans:
        first, last = start // PAGE * PAGE, -(-end // PAGE) * PAGE
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def _give_back(ranges: list[tuple[int, int]]) -> None:
    """Drop the pages of an offloaded module after it ran, unless some were written to (kept then)."""
    from ..spill import madvise_dontneed, pages_are_the_files

    for first, last in ranges:
        if pages_are_the_files(first, last):
            madvise_dontneed(first, last - first)


def _send(value: Any, device: torch.device) -> Any:
    from accelerate.utils import send_to_device

    return send_to_device(value, device)


def _send_inputs(module: nn.Module, device: torch.device) -> None:
    def pre_hook(_module, args, kwargs):
        return _send(args, device), _send(kwargs, device)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
