"""The command line's ``--model DIR``: a plain diffusers or transformers directory, loaded by its
library with the guards :func:`transformdsl.load` has.

``from_pretrained`` on a directory someone shared would run its custom code on a "y" (an
``auto_map`` naming ``DIR/evil.py``), look a named ``backbone`` up on the hub, follow a
``model.safetensors`` linked to a file outside the directory, and build whatever class a file
names.  Here, as for a pipeline component of a save (:func:`transformdsl.persist.pipelines.load_library_component`):

- the directory is opened once and handed to the library as ``/proc/self/fd/N``; every entry in it
  must be a regular file or folder (no symbolic link: a hub cache snapshot, whose files link to its
  blobs, is copied first with ``cp -rL``), shard indexes name files of the folder only;
- every JSON file is checked before the library reads it: no ``auto_map``, ``custom_pipeline`` or
  ``trust_remote_code`` at any depth, no hub kernel, no hub backbone;
- the class is a diffusers or transformers *model* class (``ModelMixin``, ``PreTrainedModel``), or a
  diffusers pipeline class assembled from its index's components (each loaded the same way),
  never an ``Auto`` class, a function or custom code; ``trust_remote_code=False``;
- the library runs with the hub offline and standard input empty (no prompt can be answered);
- the model's size is bounded by the tensors its files hold, and its configuration's shapes are
  checked against the safetensors headers before anything is allocated (a ``config.json`` edited
  to ``max_position_embeddings: 1e8`` is refused, not built).

Every problem is a :class:`~transformdsl.LoadError` naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import LoadError
from ..persist import guard
from ..persist.savedir import SaveDir


def load_directory(cls: Any, path: Path, load_kwargs: dict[str, Any]) -> Any:
    """``cls.from_pretrained(path, **load_kwargs)`` with the guards above.  ``cls`` is the class the
    caller found named in the directory (``DiffusionPipeline`` for a ``model_index.json``); only
    ``load_kwargs["dtype"]`` is passed on (for a pipeline, a dtype or ``{component: dtype,
    "default": dtype}``): the other arguments are the guards' own."""
    import diffusers

    dtype = load_kwargs.get("dtype", load_kwargs.get("torch_dtype"))
    with guard.loading(), SaveDir.open(path) as folder:
        if isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline):
            return _pipeline(folder, dtype)
        return _model(cls, folder, dtype)


def _model(cls: Any, folder: SaveDir, dtype: Any) -> Any:
    import diffusers
    import transformers

    from ..persist.pipelines import load_library_component

    config_path = folder.path / "config.json"
    name = getattr(cls, "__name__", type(cls).__name__)
    bases = (diffusers.ModelMixin, transformers.PreTrainedModel)
    if isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin) and cls not in bases:
        library = "diffusers"
    elif isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) and cls not in bases:
        library = "transformers"
    else:
        if name.startswith("Auto"):
            what = "an Auto class, which picks the class (or custom code) from the files"
        elif cls in bases:
            what = "the base class of all models, not a model"
        elif isinstance(cls, type):
            what = "a class that is not a model"
        else:
            what = f"a {type(cls).__name__}, not a model class"
        raise LoadError(f"{config_path}: names {name!r}, {what}; --model DIR loads a diffusers model class "
                        "('_class_name') or a transformers one ('architectures'), such as 'LlamaForCausalLM'")
    if getattr(diffusers if library == "diffusers" else transformers, name, None) is not cls:
        raise LoadError(f"{config_path}: {name!r} is not one of {library}'s own model classes")
    extra = {"dtype": dtype} if dtype is not None else None
    return load_library_component(library, name, folder, config_path, extra)


def _pipeline(folder: SaveDir, dtype: Any) -> Any:
    import torch

    from ..persist.checks import read_json
    from ..persist.pipelines import load_pipeline

    index_path = folder.path / "model_index.json"
    index = read_json(folder, "model_index.json", "pipeline index")
    name = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(name, str):
        # a [file, class] pair is a custom pipeline: code diffusers would import from the directory
        raise LoadError(f"{index_path}: '_class_name' is {str(name)[:80]!r}, not the name of a diffusers pipeline "
                        "class; refusing custom pipeline code")
    components = {key: "library" for key, entry in index.items()
                  if not key.startswith("_") and isinstance(entry, list) and len(entry) == 2
                  and entry != [None, None]}

    def kwargs(component: str) -> dict[str, Any]:
        wanted = dtype.get(component, dtype.get("default")) if isinstance(dtype, dict) else dtype
        return {"dtype": wanted} if isinstance(wanted, torch.dtype) else {}

    meta = {"pipeline_class": name, "components": components}
    return load_pipeline(folder, meta, torch.device("cpu"), True, library_kwargs=kwargs)
