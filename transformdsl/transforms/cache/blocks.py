"""``cache MODE``: the modules diffusers' cache hooks wrap, found by the hooks' own rules (implementation).

Block caches hook the children of the denoiser's block lists (diffusers' block identifiers) whose classes
its ``TransformerBlockRegistry`` knows; :func:`residual_chain` checks what the residual caches
(``first_block``, ``mag``) further assume.  A model a mode cannot wrap raises :class:`Unsupported`, which
the plan shows as the statement's error.
"""

from __future__ import annotations

import functools
import inspect
import re

from torch import nn


def block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks diffusers' block caches hook: children named like its block lists, in order."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    blocks = []
    for name, child in model.named_children():
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList):
            blocks.extend((f"{name}.{i}", block) for i, block in enumerate(child))
    return blocks


def registered_blocks(model: nn.Module, mode: str, least: int) -> list[tuple[str, nn.Module]]:
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from diffusers.hooks._helpers import TransformerBlockRegistry

    blocks = block_lists(model)
    if len(blocks) < least:
        found = f"{len(blocks)} block(s)" if blocks else "none"
        raise Unsupported(
            f"'cache {mode}' hooks the blocks of the denoiser's block lists (children named "
            f"{', '.join(sorted(_ALL_TRANSFORMER_BLOCK_IDENTIFIERS))} holding a ModuleList) and needs at least "
            f"{least}; {type(model).__name__} has {found}")
    TransformerBlockRegistry._register()
    unknown = sorted({type(block).__name__ for _, block in blocks
                      if type(block) not in TransformerBlockRegistry._registry})
    if unknown:
        raise Unsupported(
            f"'cache {mode}' needs diffusers to know where each block returns its hidden states "
            f"(diffusers.hooks._helpers.TransformerBlockRegistry); it does not know {', '.join(unknown)}")
    return blocks


def residual_chain(model: nn.Module, blocks: list[tuple[str, nn.Module]], mode: str, argument: str | None) -> None:
    """What the residual caches (first_block, mag) assume of the blocks they chain, checked: each block's
    forward takes the hidden states under the name the hook reads (``argument``; None: the block's
    registered name), the block lists run one after the other (not interleaved), and, for first_block,
    the first and last block return the same kind of output (it subtracts one from the other)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from diffusers.hooks._helpers import TransformerBlockRegistry

    for cls in dict.fromkeys(type(block) for _, block in blocks):  # each block class once, in order
        metadata = TransformerBlockRegistry.get(cls)
        name = argument or getattr(metadata, "hidden_states_argument_name", "hidden_states")
        parameters = list(inspect.signature(cls.forward).parameters)[1:]
        if name not in parameters:
            raise Unsupported(
                f"'cache {mode}' reads each block's '{name}' argument, and {cls.__name__}.forward takes "
                f"{', '.join(parameters[:4])}{', ...' if len(parameters) > 4 else ''} (no {name}): its blocks are not "
                "the hidden-states blocks this cache chains")
    source = _forward_source(type(model))
    lists = sorted({path.split(".")[0] for path, _ in blocks} & set(_ALL_TRANSFORMER_BLOCK_IDENTIFIERS))
    for first in lists:
        for second in lists:
            if first != second and re.search(rf"zip\(\s*self\.{first}\s*,\s*self\.{second}\b", source):
                raise Unsupported(
                    f"'cache {mode}' treats the block lists as one chain (the first block decides, the last one's "
                    f"residual is cached), and {type(model).__name__}.forward interleaves {first} and {second}, "
                    "reshaping between them: a skipped step would add a residual of another shape")
    if argument is not None and len(blocks) > 1:  # first_block: the tail's output minus the head's
        head, tail = (TransformerBlockRegistry.get(type(b)) for _, b in (blocks[0], blocks[-1]))
        if (head.return_encoder_hidden_states_index is None) != (tail.return_encoder_hidden_states_index is None):
            both, alone = ((blocks[0], blocks[-1]) if head.return_encoder_hidden_states_index is not None
                           else (blocks[-1], blocks[0]))
            raise Unsupported(
                f"'cache {mode}' subtracts the first block's output from the last block's, and here they differ: "
                f"{type(both[1]).__name__} ({both[0]}) returns text and image states, {type(alone[1]).__name__} "
                f"({alone[0]}) image states only")


@functools.lru_cache(maxsize=64)
def _forward_source(cls: type) -> str:
    """``cls.forward``'s source ("" when unavailable); read once per class: planning asks for it at each
    check, note and enable, and reading source takes milliseconds."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


class Unsupported(Exception):
    """The model has nothing this mode can hook (the message says what the mode looks for)."""


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from diffusers.hooks._common import _ATTENTION_CLASSES

    return [(name, m) for name, m in model.named_modules() if isinstance(m, _ATTENTION_CLASSES)]
