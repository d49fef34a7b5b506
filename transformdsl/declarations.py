"""What a model declares about its own modules, honoured as default exclusions.

diffusers and transformers models name the modules that must keep their precision:

- ``_keep_in_fp32_modules`` (transformers and diffusers) and ``_keep_in_fp32_modules_strict``
  (transformers): kept in float32 when the model loads in half precision, and left alone by
  their bitsandbytes/quanto integrations (T5's ``wo``, whose activations overflow otherwise);
- ``_skip_layerwise_casting_patterns`` (diffusers): modules ``enable_layerwise_casting`` keeps
  in the compute dtype (ZImage's ``t_embedder``, a DiT's ``pos_embed``...).

A transform lists the declarations it honours (``Transform.honoured_declarations``); the
planner adds the modules they name to the statement's default exclusions (shown in the plan,
dropped with ``default_except=false`` like the other defaults).  Each declaration is matched
as its library matches it, on paths relative to the declaring model (which may sit anywhere in
the tree: a pipeline component, or a model wrapped in a user's module):

- transformers: ``should_convert_module``'s rule, a regex from the start of the path up to a
  module boundary, or a suffix of the path (``"wo"`` names ``encoder.block.0.layer.1.DenseReluDense.wo``);
- diffusers: ``re.search`` on the path (``enable_layerwise_casting``'s rule).

>>> from transformers import T5Config, T5EncoderModel
>>> from transformdsl.tree import ModuleTree
>>> model = T5EncoderModel(T5Config(vocab_size=8, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
>>> [(d.label, paths) for d, paths in declared_exclusions(ModuleTree.of(model), ("_keep_in_fp32_modules",))]
[("T5EncoderModel._keep_in_fp32_modules 'wo'", ['encoder.block.0.layer.1.DenseReluDense.wo'])]
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .tree import ModuleTree

#: The declarations this module knows (what ``Transform.honoured_declarations`` may list).
KNOWN = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict", "_skip_layerwise_casting_patterns")


@dataclass(frozen=True)
class Declaration:
    """One pattern of one declaration of one model in the tree."""

    #: Path of the declaring model in the tree (``""``: the root).
    owner: str
    owner_class: str
    attribute: str
    pattern: str
    library: str

    @property
    def label(self) -> str:
        """How the plan names it: ``T5EncoderModel._keep_in_fp32_modules 'wo'``."""
        where = f" (at {self.owner})" if self.owner else ""
        return f"{self.owner_class}.{self.attribute} {self.pattern!r}{where}"

    def matches(self, path: str) -> bool:
        """Whether the module at ``path`` (in the tree) is named by this declaration itself."""
        if self.owner:
            if not path.startswith(self.owner + "."):
                return False
            path = path[len(self.owner) + 1:]
        if self.pattern.isidentifier() and self.pattern not in path:
            return False  # a plain name matches only where it occurs (the common case: cheap)
        return bool(path) and _regex(self.library, self.pattern)(path)


def declarations(tree: ModuleTree, attributes: tuple[str, ...]) -> list[Declaration]:
    """The ``attributes`` declared by the diffusers/transformers models in ``tree``."""
    found = []
    for info in tree:
        module = info.module
        library = type(module).__module__.partition(".")[0] if module is not None else ""
        if library not in ("diffusers", "transformers"):
            continue
        for attribute in attributes:
            # The instance first (transformers gathers its submodels' declarations there),
            # then the class; never nn.Module.__getattr__ (slow, and it would find submodules).
            value = module.__dict__.get(attribute, getattr(type(module), attribute, None))
            if isinstance(value, str):
                value = (value,)
            if not value:
                continue
            for pattern in sorted(p for p in value if isinstance(p, str) and p):
                found.append(Declaration(info.path, type(module).__name__, attribute, pattern, library))
    return found


def declared_exclusions(tree: ModuleTree, attributes: tuple[str, ...]) -> list[tuple[Declaration, list[str]]]:
    """Each declaration with the paths it names (the planner excludes their subtrees too).

    Declarations that name no module are left out, and so is a nested model's declaration that
    names the same modules as its parent's (transformers' ``T5Stack`` inside ``T5EncoderModel``).
    """
    if not attributes:
        return []
    out = []
    seen = set()
    for declaration in declarations(tree, attributes):
        paths = [info.path for info in tree if declaration.matches(info.path)]
        key = (declaration.attribute, declaration.pattern, tuple(paths))
        if paths and key not in seen:
            seen.add(key)
            out.append((declaration, paths))
    return out


@functools.lru_cache(maxsize=256)
def _regex(library: str, pattern: str):
    """The match function of ``pattern`` under its library's rule (an invalid regex: literal)."""
    try:
        re.compile(pattern)
        body = pattern
    except re.error:
        body = re.escape(pattern)
    if library == "transformers":
        # transformers.quantizers.quantizers_utils.should_convert_module (transformers 5)
        regex = re.compile(rf"(?:{body})(?:(?<=\.)|(?=\.|$))")
        return lambda path: bool(regex.match(path)) or path.endswith(pattern)
    regex = re.compile(body)  # diffusers: re.search (hooks/layerwise_casting.py)
    return lambda path: bool(regex.search(path))
