"""Saves the ecosystem loads, and ecosystem checkpoints transformdsl loads (spec.md "Interchange").

- :mod:`.export`: ``save(model, dir, format="transformers" | "diffusers")`` writes a directory that
  the library's stock ``from_pretrained`` loads without transformdsl installed (``config.json``
  with the library's own ``quantization_config``, ``model.safetensors`` in the library's key
  layout), plus our metadata and script so that :func:`transformdsl.load` restores everything.
- :mod:`.imports`: :func:`transformdsl.load` on a diffusers/transformers directory whose
  ``config.json`` carries a bitsandbytes ``quantization_config`` rebuilds our quantized layers
  from the saved tensors (nothing is quantized again), as if a ``quantize`` statement had run.
- :mod:`.layout`: how tensor keys move between the library's layout and ours (fp8 scale names,
  unfused q/k/v projections), written into the metadata and undone on load.
- :mod:`.hook_types`: :class:`~.hook_types.Exported` and :class:`~.hook_types.Headers`, what a transform's
  ``export`` and ``import_checkpoint`` hooks receive (low: :mod:`transformdsl.extend` names them);
- :mod:`.rules`: the libraries' own rules for which layers they quantize, checked against the
  layers the script quantized before anything is written.
"""

from __future__ import annotations

#: ``format=`` values :func:`transformdsl.save` takes.
FORMATS = ("transformdsl", "transformers", "diffusers", "compressed-tensors", "gguf")
#: What a library checkpoint's configuration file is called.
CONFIG_FILE = "config.json"


def check_format(value: object) -> str:
    """``value`` if it is a known save format, else a clear error."""
    from ..errors import TransformError

    if value not in FORMATS:
        raise TransformError(f"unknown save format {value!r}; choose one of {', '.join(FORMATS)}")
    return value  # type: ignore[return-value]


def carried_as_bitsandbytes(key: str) -> bool:
    """Whether the step ``key`` is carried in a library's layout as a bitsandbytes ``quantization_config``:
    its declaration reads such checkpoints (``quant_methods``), the one list of them."""
    from .. import registry

    try:
        declared = registry.declaration(key)
    except registry.PluginError:  # a key read from a file, naming a broken plugin: not one of ours
        return False
    return declared is not None and "bitsandbytes" in declared.quant_methods


def stock_needs(fmt: str | None, step_keys: list[str]) -> str | None:
    """What the library's stock ``from_pretrained`` needs, beyond the library, to load a save in
    layout ``fmt`` made by the steps ``step_keys`` (None: nothing more; ``inspect`` says so)."""
    if fmt == "diffusers" and any(carried_as_bitsandbytes(key) for key in step_keys):
        return ("a GPU (CUDA, XPU or MPS): diffusers' bitsandbytes loader refuses without one "
                "(\"No GPU found\"), even for a pre-quantized checkpoint")
    if fmt == "compressed-tensors":
        return "the compressed-tensors package (transformers reads the format through it)"
    return None


def summary(value: object) -> dict | None:
    """The metadata's ``interop`` field as ``inspect`` reports it: checked, printable, bounded
    (it comes from a file)."""
    if not isinstance(value, dict):
        return None
    if value.get("imported") in FORMATS[1:]:
        return {"imported": value["imported"]}
    notes = value.get("notes")
    if value.get("format") in FORMATS[1:] and isinstance(notes, list):
        return {"format": value["format"],
                "notes": ["".join(c if c.isprintable() else "?" for c in n[:300]) for n in notes[:50]
                          if isinstance(n, str)]}
    return None
