"""``attention BACKEND`` (implementation): diffusers' dispatcher per module, transformers' attn_implementation.

Requirements are checked with the libraries' own checks, before anything runs:

- diffusers: ``_check_attention_backend_requirements`` (the package and its version), then the
  backend's registered constraints (``_AttentionBackendRegistry._constraints``: device, dtype) run on
  two-token tensors of the model's device and dtype, plus the device the kernel exists for
  (:data:`~transformdsl.transforms.attention.DEVICE_ONLY`);
- transformers: ``model.get_correct_attn_implementation(name)`` (the package), and a half dtype
  on CUDA for the flash kernels.

The failure names the requirement and a backend that works on this machine for this model.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ...extend import LoadError
from ...tree import ModuleInfo, ModuleTree
from ..common.modules import recorded_targets
from . import DEVICE_ONLY, EQUIVALENT, FALLBACK, MODES, TRANSFORMERS_BACKENDS, class_name
from . import AttentionBackend as AttentionBackendDeclaration

logger = logging.getLogger("transformdsl")


class Unmet(Exception):
    """A requirement of the backend that this machine or model does not meet (the message says which)."""


def _placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    return torch.device("cpu"), torch.float32


def _root(tree: ModuleTree) -> nn.Module | None:
    try:
        return tree[""].module
    except KeyError:
        return None


def _is_diffusers(model: nn.Module) -> bool:
    return hasattr(model, "set_attention_backend")


def _is_transformers(model: nn.Module) -> bool:
    return hasattr(model, "set_attn_implementation") and hasattr(model, "config")


def diffusers_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules whose processor dispatches through diffusers' backends."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (Attention, MochiAttention, AttentionModuleMixin))
            and getattr(m, "processor", None) is not None and hasattr(m.processor, "_attention_backend")]


def check_diffusers(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Every unmet requirement of ``backend`` on this machine for a model on ``device`` in ``dtype``, at once."""
    from diffusers.models import attention_dispatch as dispatch

    name = dispatch.AttentionBackendName(backend)
    unmet = []
    try:
        dispatch._check_attention_backend_requirements(name)
    except RuntimeError as exc:
        unmet.append(str(exc))
    needed = DEVICE_ONLY.get(backend)
    if needed and device.type != needed:
        unmet.append(f"'{backend}' runs on {needed.upper()} devices only; the model is on {device.type}")
    if name in dispatch._HUB_KERNELS_REGISTRY and dispatch._HUB_KERNELS_REGISTRY[name].kernel_fn is None:
        import huggingface_hub.constants as hub

        if hub.HF_HUB_OFFLINE:
            unmet.append(f"'{backend}' downloads its kernel from the Hub "
                         f"({dispatch._HUB_KERNELS_REGISTRY[name].repo_id}), and the Hub is offline here")
    q = torch.zeros(1, 2, 1, 64, device=device, dtype=dtype)
    for constraint in dispatch._AttentionBackendRegistry._constraints.get(name, []):
        if constraint.__name__ in ("_check_shape", "_check_attn_mask_or_causal"):
            continue  # depend on the call, not on the machine
        try:
            constraint(q, q, q)
        except ValueError as exc:
            if "CUDA device" in str(exc) and needed:
                continue  # said above
            unmet.append(f"{exc} (the model is {str(dtype).replace('torch.', '')} on {device.type})")
    if unmet:
        raise Unmet("; ".join(unmet))


def check_transformers(model: nn.Module, backend: str, device: torch.device, dtype: torch.dtype) -> None:
    try:
        model.get_correct_attn_implementation(backend)
    except (ImportError, ValueError) as exc:
        raise Unmet(str(exc).split(". ")[0] if len(str(exc)) > 300 else str(exc)) from None
    if backend.startswith("flash_attention"):
        if device.type != "cuda":
            raise Unmet(f"'{backend}' runs on CUDA devices only; the model is on {device.type}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise Unmet(f"'{backend}' needs float16 or bfloat16; the model is {str(dtype).replace('torch.', '')}")


def _works_here(model: nn.Module, library: str) -> list[str]:
    """Backends that pass every check on this machine for this model (the alternative to offer)."""
    device, dtype = _placement(model)
    found = []
    for mode in (("native", "native_math", "flex", "flash", "sage", "xformers") if library == "diffusers"
                 else ("sdpa", "eager", "flex_attention", "flash_attention_2")):
        try:
            requirements(model, library, _backend_name(mode), device, dtype)
        except Unmet:
            continue
        found.append(mode)
    return found


def _backend_name(mode: str) -> str:
    from . import library_name

    return library_name(mode)[1]


def requirements(model: nn.Module, library: str, backend: str, device=None, dtype=None) -> None:
    if device is None:
        device, dtype = _placement(model)
    if library == "diffusers":
        check_diffusers(backend, device, dtype)
    else:
        check_transformers(model, backend, device, dtype)


class AttentionBehaviour:

    def _library_error(self, model: nn.Module, path: str, root: nn.Module | None = None) -> str | None:
        where = f"'{path}'" if path else "the model"
        if self.library == "diffusers" and not _is_diffusers(model) and not (root is not None and _is_diffusers(root)):
            other = EQUIVALENT.get(self.backend)
            hint = f" (for a transformers model write 'attention {other.lstrip('_')}')" \
                if _is_transformers(model) and other in TRANSFORMERS_BACKENDS else ""
            return (f"'{self.backend}' is a diffusers attention backend; {where} is a {type(model).__name__}, not a "
                    f"diffusers model{hint}")
        if self.library == "transformers" and not _is_transformers(model):
            other = EQUIVALENT.get(self.backend)
            hint = f" (for a diffusers model write 'attention {other.lstrip('_')}')" if other else ""
            return (f"'{self.backend}' is a transformers attn_implementation; {where} is a {type(model).__name__}, "
                    f"not a transformers model{hint}")
        return None

    def check(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        model = info.module
        if model is None:
            return None
        problem = self._library_error(model, info.path, _root(tree))
        if problem:
            return problem
        if self.library == "diffusers" and not diffusers_attention(model):
            return (f"{type(model).__name__} has no attention module whose processor dispatches through diffusers' "
                    "attention backends (its processors compute attention themselves), so no backend applies")
        refused = self._processors_refusing(model, info.path)
        if refused:
            return refused
        try:
            requirements(model, self.library, self.backend)
        except Unmet as exc:
            works = [m for m in _works_here(model, self.library) if m != self.mode]
            alternative = f"; works here: {', '.join(f'attention {m}' for m in works)}" if works else ""
            return f"cannot use 'attention {self.mode}' here: {exc}{alternative}"
        return None

    def _processors_refusing(self, model: nn.Module, path: str) -> str | None:
        """Processors that declare the only backends they run with (``_SUPPORTED_BACKENDS``: AnyFlow's
        causal attention needs flex) and this is not one: they raise at the first call, so say it now."""
        if self.library != "diffusers":
            return None
        refusing: dict[str, tuple[tuple[str, ...], list[str]]] = {}
        for name, module in diffusers_attention(model):
            supported = getattr(module.processor, "_SUPPORTED_BACKENDS", None)
            if isinstance(supported, (tuple, list, set, frozenset)) and supported \
                    and self.backend not in {str(getattr(b, "value", b)) for b in supported}:
                where = f"{path}.{name}".strip(".")
                refusing.setdefault(type(module.processor).__name__, (tuple(supported), []))[1].append(where)
        if not refusing:
            return None
        processor, (supported, paths) = next(iter(refusing.items()))
        names = [str(getattr(b, "value", b)) for b in supported]
        modes = [n.lstrip("_") for n in names if n.lstrip("_") in MODES]
        fix = f"write 'attention {modes[0]}'" if modes else "leave these modules' attention as it is"
        more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
        return (f"{processor} (on {paths[0]}{more}) runs only with the {', '.join(names)} backend(s) and raises "
                f"at its first call with '{self.backend}': {fix}, or scope the statement with 'in' to other modules")

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        lines = []
        for path in targets:
            model = tree[path].module
            if model is None or self._library_error(model, path, _root(tree)):
                continue
            if self.library == "diffusers":
                n = len(diffusers_attention(model))
                lines.append(f"sets {n} attention processor(s) to '{self.backend}' (the process-wide default "
                             "backend is left alone)")
            else:
                lines.append(f"sets attn_implementation='{self.backend}' on the model and its sub-models")
        return lines

    # The backend is a run-time setting: nothing is stored, and loading sets it again (:meth:`finalize`).
    not_stored = "{library} keeps the attention backend in no checkpoint"
    after_from_pretrained = ("call set_attention_backend (diffusers) or pass attn_implementation= (transformers) "
                             "after from_pretrained; transformdsl.load sets it again")
    attached_field = "modules"

    def record_fields(self) -> dict:
        return {"library": self.library, "backend": self.backend}

    @classmethod
    def attach(cls, module: nn.Module, path: str, options: Any, edit) -> list[str]:
        """Set the backend on ``module``'s attention modules; their paths."""
        return set_backend(module, cls.library, cls.backend, edit, path)

    @classmethod
    def finalize(cls, root: nn.Module, record: dict, options: Any) -> None:
        """Set the backend again on the loaded model, if this machine can run it (else LoadError, or the fallback).

        The backend is the statement's, never the record's alone: a record that names another backend or
        targets the model does not have is refused (an edited file must not choose what runs, e.g. a
        backend that downloads its kernel)."""
        library, backend = cls.library, cls.backend
        where = f"the record of 'attention {cls.mode}'"
        if (record.get("library"), record.get("backend")) != (library, backend):
            raise LoadError(f"{where} names backend {str(record.get('backend'))[:60]!r} "
                            f"({str(record.get('library'))[:20]}), not the statement's '{backend}' ({library}): "
                            "transformdsl.json was edited or is corrupt; save the model again")
        # The modules it applies to are the statement's targets' attention modules on the loaded model (the
        # record's list of them is informative: a processor the user wrapped, or another diffusers version,
        # may change it, and it chooses nothing).
        targets = recorded_targets(root, record, cls.key())
        for path, model in targets:
            try:
                requirements(model, library, backend)
            except Unmet as exc:
                if FALLBACK.enabled:
                    logger.warning("attention %s: %s; loaded with the library's default attention instead "
                                   "(attention fallback is on)", cls.mode, exc)
                    continue
                raise LoadError(
                    f"the saved model runs attention with '{backend}' ('attention {cls.mode}'), which this machine "
                    f"cannot: {exc}.  Load it anyway with the library's default attention: "
                    "`with transformdsl.transforms.attention.FALLBACK.turned(True): transformdsl.load(...)` "
                    "(or TRANSFORMDSL_ATTENTION_FALLBACK=1)") from None
            cls.attach(model, path, options, None)


def set_backend(model: nn.Module, library: str, backend: str, edit, prefix: str) -> list[str]:
    """Set ``backend`` on ``model`` (through ``edit`` when given, so a rollback restores it)."""
    if library == "diffusers":
        from diffusers.models import attention_dispatch as dispatch

        name = dispatch.AttentionBackendName(backend)
        dispatch._check_attention_backend_requirements(name)
        dispatch._maybe_download_kernel_for_backend(name)
        paths = []
        for path, module in diffusers_attention(model):
            if edit is not None:
                edit.setattr(module.processor, "_attention_backend", name)
            else:
                module.processor._attention_backend = name
            paths.append(f"{prefix}.{path}".strip(".") if path else prefix)
        return paths
    previous = model.config._attn_implementation
    if edit is not None:
        edit.on_rollback(lambda: model.set_attn_implementation(previous))
    model.set_attn_implementation(backend)
    return [prefix]


def _implement(mode: str) -> type:
    from .. import attention as declarations

    declared = getattr(declarations, class_name(mode))
    return type(class_name(mode), (AttentionBehaviour, declared), {"__module__": __name__})


for _mode in MODES:
    globals()[class_name(_mode)] = _implement(_mode)
del _mode
assert issubclass(globals()[class_name("native")], AttentionBackendDeclaration)
