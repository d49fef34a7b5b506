"""Which layers a library's stock loader quantizes, given a skip list: its rules, checked here.

A checkpoint's ``quantization_config`` says *how* layers are quantized and which modules are
*not* (``llm_int8_skip_modules`` / ``modules_to_not_convert``); the loader quantizes every
other layer of the kinds it handles.  :func:`skip_list` finds a short skip list under which the
stock loader rebuilds exactly the layers the script quantized, or says which layer it cannot.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from ..errors import TransformError


def _transformers_converts(path: str, skip: list[str]) -> bool:
    """transformers 5 ``should_convert_module``: a pattern matches from the start up to a module
    boundary (also as a regex), or as a suffix of the module's name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", path) or path.endswith(key) for key in skip)


def _diffusers_converts(path: str, skip: list[str]) -> bool:
    """diffusers 0.42 ``_replace_with_bnb_linear``: the layer's own name is not in the list and no
    entry is the layer's path or a substring of it ending at a dot."""
    name = path.rpartition(".")[2]
    return name not in skip and not any(key + "." in path or key == path for key in skip)


CONVERTS = {"transformers": _transformers_converts, "diffusers": _diffusers_converts}


def convertible(model: nn.Module, conv1d: bool) -> list[str]:
    """Paths of the plain layers a library's loader would quantize (before its skip list):
    ``nn.Linear`` (exactly: our quantized layers are added by the caller), and GPT-2's ``Conv1D``
    if ``conv1d`` (transformers' bitsandbytes loader converts those)."""
    return [path for path, module in model.named_modules()
            if type(module) is nn.Linear or (conv1d and type(module).__name__ == "Conv1D")]


def skip_list(layers: Iterable[str], library: str, quantized: set[str], keep: Iterable[str] = ()) -> list[str]:
    """A skip list under which ``library`` quantizes exactly ``quantized`` among ``layers`` (the
    layers its loader converts, quantized or not, as the library names them).

    ``keep`` are patterns the loader adds itself (a model class's ``_keep_in_fp32_modules``).
    Tries the shortest list first (the topmost modules holding no quantized layer), then every
    unquantized layer's full path; raises :class:`TransformError` naming a layer the library
    would treat differently under both.
    """
    layers = sorted(set(layers) | quantized)
    plain = [p for p in layers if p not in quantized]
    converts = CONVERTS[library]
    keep = list(keep)
    short = _topmost_without(plain, quantized)
    for candidate in (short, plain):
        if all(converts(p, candidate + keep) == (p in quantized) for p in layers):
            return candidate
    wrong = [p for p in layers if converts(p, plain + keep) != (p in quantized)]
    first = wrong[0]
    leaf = first.rpartition(".")[2]
    if first in quantized and library == "diffusers" and any(p.rpartition(".")[2] == leaf for p in plain):
        raise TransformError(f"format='diffusers': diffusers skips every layer named '{leaf}' once one is skipped, "
                             f"and the script quantized '{first}' but not {[p for p in plain if p.endswith(leaf)][:3]}; "
                             f"treat them alike (e.g. 'except {leaf}'), or save with format='transformdsl'")
    if first in quantized:
        raise TransformError(f"format={library!r}: {library}'s loader never quantizes '{first}' (its skip rules "
                             f"or the model's _keep_in_fp32_modules {keep} exclude it); exclude it from the "
                             "quantize statement, or save with format='transformdsl'")
    raise TransformError(f"format={library!r}: {library}'s loader would quantize '{first}', which the script left "
                         "unquantized, and no skip list prevents it without skipping a quantized layer; quantize "
                         "it too, or save with format='transformdsl'")


def _topmost_without(plain: list[str], quantized: set[str]) -> list[str]:
    """For each unquantized layer, its topmost ancestor (not the root) holding no quantized layer."""
    out: list[str] = []
    for path in plain:
        parts = path.split(".")
        chosen = path
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if not any(q == prefix or q.startswith(prefix + ".") for q in quantized):
                chosen = prefix
                break
        if chosen not in out:
            out.append(chosen)
    return out


def kept_in_float(module: nn.Module) -> list[str]:
    """The module names a transformers model keeps in float32 whatever it is loaded in
    (``_keep_in_fp32_modules`` and its strict variant): its quantizers leave them alone too."""
    keep: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        value = getattr(module, attr, None)
        if isinstance(value, (list, tuple, set)):
            keep.extend(value)
    return keep
