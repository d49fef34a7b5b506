"""``compile`` and ``compile regional``: torch.compile, whole-model or per block (implementation).

Both compile in place with ``nn.Module.compile``: the module object, its class, its
state_dict keys and the pipeline holding it stay the same; only the module's
``_compiled_call_impl`` attribute is set (through the edit log, so a rollback uncompiles).
Compilation itself is lazy: it happens at the first call, not during ``transform()``.

``compile regional in SELECTOR`` compiles each selected block on its own.  All blocks of
one class run the same code, and dynamo treats their parameters as inputs, so repeated
blocks share one compiled graph: the compile time is that of one block, not of the model.

Compiled artefacts are not portable (they depend on torch, the compiler and the device),
so nothing compiled is saved: the record names the compiled modules and the options,
and :meth:`finalize` compiles them again after ``load()``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...tree import ModuleInfo, ModuleTree
from ..common.fullgraph import breaks_fullgraph, refusal
from . import CompileOptions
from . import RegionalCompile as RegionalCompileDeclaration
from . import WholeCompile as WholeCompileDeclaration

_DYNAMIC = {"auto": None, "true": True, "false": False}
#: Containers without a forward of their own: compiling them compiles nothing.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def compile_kwargs(options: Any) -> dict:
    """The ``torch.compile`` keyword arguments for the options (a dataclass or its dict)."""
    if isinstance(options, dict):
        options = CompileOptions(**options)
    kwargs = {"fullgraph": options.fullgraph, "dynamic": _DYNAMIC[options.dynamic], "backend": options.backend}
    if options.mode != "default":  # only inductor takes a mode (check() enforces it)
        kwargs["mode"] = options.mode
    return kwargs


def generates_with_static_cache(cls: type) -> str | None:
    """None if ``cls`` is a transformers model whose ``generate`` can run on a static KV cache and compile
    its decode step, else why not."""
    if not callable(getattr(cls, "can_generate", None)) or not cls.can_generate():
        return f"{cls.__name__} is not a transformers model that generates (kv_cache=static is generate's)"
    if not getattr(cls, "_can_compile_fullgraph", False):
        return (f"transformers does not run {cls.__name__} on a static KV cache (its _can_compile_fullgraph is "
                "false); use kv_cache=dynamic")
    return None


def static_decode(module: nn.Module, options: Any, edit) -> None:
    """What ``kv_cache=static`` attaches: ``module.generate`` runs on a static KV cache and, on every device,
    compiles its decode step (transformers' ``compile_config``; the prefill stays eager, as transformers runs
    it), through the edit log so a rollback restores the generation config."""
    from transformers import CompileConfig

    kwargs = compile_kwargs(options)
    if kwargs["dynamic"] is None:
        kwargs["dynamic"] = False  # a decode step on a static cache has one shape: transformers' default
    config = CompileConfig(**{"mode": "default", **kwargs})
    config._compile_all_devices = True  # transformers compiles generate's decode step on GPUs only otherwise
    generation = module.generation_config
    for name, value in (("cache_implementation", "static"), ("compile_config", config), ("disable_compile", False)):
        if edit is None:
            setattr(generation, name, value)
        else:
            edit.setattr(generation, name, value)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on this module."""
    return module.__dict__.get("_compiled_call_impl") is not None


def compile_in_place(module: nn.Module, kwargs: dict) -> None:
    """``module.compile(**kwargs)``: the module stays the same object (only its call is wrapped)."""
    module.compile(**kwargs)


def _cache_of(tree: ModuleTree) -> str | None:
    """The step cache the planned model already runs, if it breaks a full graph: the statement that
    enabled it (from the model's history), or diffusers' config class for one enabled by hand."""
    from ... import registry
    from ...history import history_of

    root = tree[""].module
    if root is None or not getattr(root, "is_cache_enabled", False):
        return None
    for step in reversed(history_of(root).steps if history_of(root) else []):
        declared = registry.declaration(step.key) if step.key.startswith("cache ") else None
        if declared is not None:
            return f"'{step.statement}'" if getattr(declared, "breaks_fullgraph", True) else None
    config = type(getattr(root, "_cache_config", None)).__name__
    return config if breaks_fullgraph(config) else None


class CompileBehaviour:
    """What both compile statements do (mixed into each declaration)."""

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        if issubclass(info.cls, _CONTAINERS):
            return (f"a {info.cls.__name__} has no forward of its own; select the blocks inside it "
                    f"(e.g. in {info.path}.*)" if info.path else "the root has no forward of its own")
        if info.module is not None and is_compiled(info.module):
            return "already compiled (torch.compile)"
        return None

    def check(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        if self.options.mode != "default" and self.options.backend != "inductor":
            return f"mode={self.options.mode} needs backend=inductor"
        if self.options.kv_cache == "static":
            if self.mode == "regional":
                return ("kv_cache=static compiles the decode step of the whole model's generate(); use "
                        "'compile kv_cache=static' instead of the regional form")
            why = generates_with_static_cache(info.cls)
            if why:
                return why
        if self.options.fullgraph:
            cache = _cache_of(tree)
            if cache:
                return refusal(f"the model already runs a step cache ({cache}) that", f"'{self.statement.key}'"
                               " with fullgraph=true", "fullgraph=false")
        return None

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        if not targets:
            return []
        if self.options.kv_cache == "static":
            return ["generate() runs on a static KV cache and compiles its decode step (the prefill and direct "
                    "calls of the model stay eager); the first generate() pays the compile time, and one that "
                    "needs a longer cache compiles again"]
        return ["compiles lazily: the first call after transform() (or load()) pays the compile time"]

    # Compiled code is not portable: nothing is stored, and loading compiles the recorded modules again.
    not_stored = "{library} keeps no compiled code"
    after_from_pretrained = "call torch.compile after from_pretrained; transformdsl.load compiles again"

    @classmethod
    def export(cls, step, out) -> None:
        if step.options.get("kv_cache") != "static":
            return super().export(step, out)
        out.notes.append(f"{out.where(step)}: not stored ({cls.not_stored.format(library=out.library)}); after "
                         "from_pretrained set model.generation_config.cache_implementation = 'static' and its "
                         "compile_config (transformers' CompileConfig); transformdsl.load does it again")

    @classmethod
    def attach(cls, module: nn.Module, path: str, options: Any, edit) -> None:
        """Compile ``module`` in place (the saved ``__dict__`` of :meth:`touches` undoes it: a rollback
        removes ``_compiled_call_impl``); with ``kv_cache=static``, arm generate's compiled decode step instead."""
        if isinstance(options, dict):
            options = CompileOptions(**options)
        if options.kv_cache == "static":
            static_decode(module, options, edit)
            return
        compile_in_place(module, compile_kwargs(options))


class WholeCompile(CompileBehaviour, WholeCompileDeclaration):
    pass


class RegionalCompile(CompileBehaviour, RegionalCompileDeclaration):

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        if info.path == "":
            return "regional compilation compiles blocks, not the root; use 'compile' for the whole model"
        return super().candidate(info, tree)

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        classes: dict[str, int] = {}
        for path in targets:
            name = tree[path].cls.__name__
            classes[name] = classes.get(name, 0) + 1
        shared = ", ".join(f"{n} × {name}" for name, n in classes.items())
        lines = super().notes(tree, targets)
        if targets:
            lines.append(f"{shared}: blocks of one class share one compiled graph (per input shape and dtype)")
        return lines
