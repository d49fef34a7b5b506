"""The model corpus: tiny real models of diffusers and transformers, recorded as data.

``diffusers.json`` holds, for every denoiser class that diffusers' own model tests cover, the
tester's init kwargs and dummy inputs; ``transformers.json`` holds tiny configs of 30+
transformers families, at the sizes of transformers' ModelTester classes.  Nothing here is
code copied from those tests: only the numbers.

What users (the matrix, tests/test_zoo.py, the other helpers) may rely on:

- :func:`entries` lists every model as a dict with at least ``id`` (unique, e.g.
  ``diffusers/FluxTransformer2DModel``), ``library`` and ``class``.
- :func:`build` ``(entry)`` returns ``(module in eval mode, (args, kwargs))``, offline and
  deterministic: the same entry gives bit-identical weights and inputs on the same machine.
  ``seed`` changes the inputs only (a held-out sample for the same model).
- :func:`output_tensor` picks the tensor a model's output is compared by (the one
  ``transform(..., verify=True)`` compares: ``.sample``, ``.logits``, ``.last_hidden_state``,
  or the first element).

Input specs (values of ``inputs``, recursively): a JSON scalar, string or null is passed as is;
a list is a list; ``{"tuple": [...]}`` a tuple; ``{"dict": {...}}`` (or any other object) a dict;
``{"int_keys": {"0": ...}}`` a dict whose keys are ints;
``{"dtype": "float32"}`` a torch dtype; ``{"object": "diffusers.<...>.Class", "args": [...]}`` an
instance of a diffusers/transformers class built with those arguments; ``{"tensor": {"shape",
"dtype", "kind", ...}}`` a tensor, where ``kind`` is ``randn``, ``rand``, ``randint`` (with
``low``/``high``, high exclusive), ``arange`` (0, 1, ... reshaped), ``ones``, ``zeros``, ``full``
(with ``value``) or ``values`` (the exact ``values``, flattened).
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
LIBRARIES = ("diffusers", "transformers")

#: Seed for weights (``torch.manual_seed`` before the model is built) and default seed of inputs.
SEED = 0


@functools.cache
def _load(library: str) -> tuple[dict, ...]:
    data = json.loads((HERE / f"{library}.json").read_text())
    models = []
    for model in data["models"]:
        model = dict(model, library=library, id=f"{library}/{model['id']}")
        models.append(model)
    return tuple(models)


def entries(library: str | None = None) -> list[dict]:
    """Every model of the corpus (of one ``library`` if given), in file order."""
    libraries = LIBRARIES if library is None else (library,)
    return [entry for name in libraries for entry in _load(name)]


def entry(model_id: str) -> dict:
    """The entry whose ``id`` is ``model_id`` (``diffusers/...`` or ``transformers/...``)."""
    for candidate in entries():
        if candidate["id"] == model_id:
            return candidate
    raise KeyError(f"no corpus model {model_id!r}")


def skipped() -> dict[str, list[dict]]:
    """library -> models left out of the corpus, each with ``class`` and ``reason``."""
    return {name: json.loads((HERE / f"{name}.json").read_text()).get("skipped", []) for name in LIBRARIES}


# --------------------------------------------------------------------------- building


def build(entry: dict, seed: int = SEED) -> tuple[nn.Module, tuple[tuple, dict]]:
    """``(model in eval mode, (args, kwargs))`` for a corpus entry; see the module docstring."""
    torch.manual_seed(SEED)
    if entry["library"] == "diffusers":
        import diffusers

        model = getattr(diffusers, entry["class"])(**decode(entry["init"], None))
    else:
        import transformers

        config = getattr(transformers, entry["config_class"])(**decode(entry["config"], None))
        model = getattr(transformers, entry["class"])(config)
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    kwargs = decode(entry["inputs"], generator)
    return model, ((), kwargs)


def inputs(entry: dict, seed: int = SEED) -> tuple[tuple, dict]:
    """The inputs alone (same as :func:`build`'s), for another ``seed``."""
    return (), decode(entry["inputs"], torch.Generator().manual_seed(seed))


def decode(spec: Any, generator: torch.Generator | None) -> Any:
    """The Python value a spec describes (tensors drawn from ``generator``)."""
    if isinstance(spec, list):
        return [decode(item, generator) for item in spec]
    if not isinstance(spec, dict):
        return spec
    if "tensor" in spec and len(spec) == 1:
        return _tensor(spec["tensor"], generator)
    if "tuple" in spec and len(spec) == 1:
        return tuple(decode(item, generator) for item in spec["tuple"])
    if "dict" in spec and len(spec) == 1:
        return {key: decode(value, generator) for key, value in spec["dict"].items()}
    if "dtype" in spec and len(spec) == 1:
        return getattr(torch, spec["dtype"])
    if "int_keys" in spec and len(spec) == 1:
        return {int(key): decode(value, generator) for key, value in spec["int_keys"].items()}
    if "object" in spec:
        return _object(spec["object"])(*decode(spec.get("args", []), generator))
    return {key: decode(value, generator) for key, value in spec.items()}


def _object(qualified: str):
    module, _, name = qualified.rpartition(".")
    if module.split(".")[0] not in LIBRARIES:
        raise ValueError(f"corpus objects come from {' or '.join(LIBRARIES)}, not {qualified!r}")
    return getattr(importlib.import_module(module), name)


def _tensor(spec: dict, generator: torch.Generator | None) -> torch.Tensor:
    shape, dtype, kind = tuple(spec["shape"]), getattr(torch, spec["dtype"]), spec["kind"]
    if kind == "values":
        return torch.tensor(spec["values"], dtype=dtype).reshape(shape)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    if kind == "full":
        return torch.full(shape, spec["value"], dtype=dtype)
    if kind == "arange":
        return torch.arange(int(torch.Size(shape).numel())).to(dtype).reshape(shape)
    if generator is None:
        raise ValueError(f"a {kind} tensor needs a generator (random specs belong in inputs, not in init)")
    if kind == "randn":
        return torch.randn(shape, generator=generator).to(dtype)
    if kind == "rand":
        return torch.rand(shape, generator=generator).to(dtype)
    if kind == "randint":
        return torch.randint(spec["low"], spec["high"], shape, generator=generator).to(dtype)
    raise ValueError(f"unknown tensor kind {kind!r}")


# --------------------------------------------------------------------------- comparing


def output_tensor(output: Any) -> torch.Tensor:
    """The tensor a model's output is compared by (the one ``verify`` compares)."""
    from transformdsl.models import one_tensor

    return one_tensor(output)


def run(model: nn.Module, model_inputs: tuple[tuple, dict]) -> torch.Tensor:
    """``output_tensor(model(*args, **kwargs))`` under ``torch.no_grad()``."""
    args, kwargs = model_inputs
    with torch.no_grad():
        return output_tensor(model(*args, **kwargs))
