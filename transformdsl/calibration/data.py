"""Calibration data: what a method that learns from data (GPTQ, AWQ, SmoothQuant) runs the model on.

Two sources, one object (:class:`CalibrationData`):

- the API: ``transform(model, script, calibration=DATA)``, where ``DATA`` is an iterable of model
  inputs, each a tensor (the forward's first positional argument: token ids of shape
  ``(1, seqlen)`` or ``(batch, seqlen)`` for a language model), a mapping of forward keyword
  arguments, or an ``(args, kwargs)`` pair;
- the script: ``calibrate "PATH" samples=N seqlen=L``, where ``PATH`` is a text file, a folder
  or glob of ``.txt``/``.md`` files (tokenized with the tokenizer beside the model), or a
  safetensors file of input tensors (:func:`read_tensor_file`).

A save records the data's name (a file's name, never its directories), its size, its number of
samples and tokens, and a SHA-256 of what the model was run on, never the data itself.

Checks before the first block runs (:meth:`CalibrationData.check_for`): token ids inside the
vocabulary, keyword names the forward takes; too few samples or tokens is a warning with the
numbers (:data:`FEW_SAMPLES`, :data:`FEW_TOKENS`).
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import TransformError

#: Fewer samples than this is a warning (the reference implementations default to 128-512).
FEW_SAMPLES = 16
#: Fewer tokens in all than this is a warning: a Hessian of a layer wider than the number of
#: tokens has no full rank (GPTQ then leans on its dampening).
FEW_TOKENS = 2048
#: Text file suffixes a folder or glob contributes.
TEXT_SUFFIXES = (".txt", ".md", ".text")
#: Most bytes of text read for calibration (more is never needed: samples x seqlen tokens).
MAX_TEXT_BYTES = 256 << 20
#: Most samples a safetensors file or the API may give (each is run through the model).
MAX_SAMPLES = 100_000


Sample = tuple[tuple, dict]


@dataclass
class CalibrationData:
    """Model inputs to calibrate on, and what a save records of them."""

    #: The inputs the methods fit on, each ``(args, kwargs)`` for ``model(*args, **kwargs)``.
    samples: list[Sample]
    #: The data's name as recorded: a file name, or ``"calibration="`` for the API.
    name: str
    #: Inputs kept apart for ``verify=`` (never fitted on).
    heldout: list[Sample] = field(default_factory=list)
    #: Bytes of the source (a file's size; the tensors' bytes for the API).
    source_bytes: int = 0
    #: Where the samples' activations wait between blocks (``calibrate ... activations=``).
    activations: str = "auto"

    @property
    def tokens(self) -> int:
        """Token positions (or input rows) over all samples: the first tensor's leading dims."""
        return sum(_positions(sample) for sample in self.samples)

    def sha256(self) -> str:
        """SHA-256 over every sample's tensors (names, dtypes, shapes, bytes), in order."""
        digest = hashlib.sha256()
        for args, kwargs in [*self.samples, *self.heldout]:
            for name, value in [*((str(i), a) for i, a in enumerate(args)), *sorted(kwargs.items())]:
                if isinstance(value, torch.Tensor):
                    digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
                    digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                else:
                    digest.update(f"{name}={value!r};".encode())
        return digest.hexdigest()

    def record(self) -> dict:
        """What a save records of the data (JSON)."""
        return {"name": self.name, "samples": len(self.samples), "heldout": len(self.heldout),
                "tokens": self.tokens, "bytes": self.source_bytes, "sha256": self.sha256()}

    def warnings(self) -> list[str]:
        """Too few samples or tokens, with the numbers."""
        out = []
        if len(self.samples) < FEW_SAMPLES:
            out.append(f"calibration data: {len(self.samples)} sample(s), fewer than {FEW_SAMPLES}: the fitted "
                       "scales and error compensation may not generalise (the reference tools use 128-512)")
        if self.tokens < FEW_TOKENS:
            out.append(f"calibration data: {self.tokens} token(s) in all, fewer than {FEW_TOKENS}: a layer wider "
                       "than that has a rank-deficient Hessian (GPTQ leans on its dampening)")
        return out

    def split_heldout(self, fraction: float = 0.125) -> None:
        """Keep the last ``fraction`` of the samples (at least one, when there are two or more)
        apart for verification; the methods never fit on them."""
        if self.heldout or len(self.samples) < 2:
            return
        count = max(1, int(len(self.samples) * fraction))
        self.samples, self.heldout = self.samples[:-count], self.samples[-count:]

    def check_for(self, model: torch.nn.Module) -> None:
        """Refuse data made for another model, before anything runs: token ids past the vocabulary,
        keyword arguments the forward does not take."""
        try:
            parameters = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            parameters = {}
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        vocab = _vocab_size(model)
        for index, (args, kwargs) in enumerate([*self.samples, *self.heldout]):
            if parameters:  # a forward taking **kwargs: a tensor under a name it does not declare
                unknown = sorted(name for name, value in kwargs.items() if name not in parameters
                                 and (not takes_any or isinstance(value, torch.Tensor)))
                if unknown:
                    raise TransformError(f"calibration data ({self.name}): sample {index} passes {', '.join(unknown)}, "
                                         f"which {type(model).__name__}.forward does not take (it takes "
                                         f"{', '.join(list(parameters)[:12])}): data for another model?")
            ids = kwargs.get("input_ids", args[0] if args else None)
            if vocab and isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.numel():
                low, high = int(ids.min()), int(ids.max())
                if low < 0 or high >= vocab:
                    raise TransformError(f"calibration data ({self.name}): sample {index} holds token id "
                                         f"{high if high >= vocab else low}, outside the model's vocabulary of "
                                         f"{vocab}: data tokenized for another model?")


def _positions(sample: Sample) -> int:
    args, kwargs = sample
    first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    if first is None:
        return 0
    return int(math.prod(first.shape[:2])) if first.dim() >= 2 else int(first.shape[0]) if first.dim() else 1


def _vocab_size(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size > 0:
        embeddings = getattr(model, "get_input_embeddings", None)
        try:
            table = embeddings() if callable(embeddings) else None
        except (NotImplementedError, AttributeError):
            table = None
        rows = getattr(table, "num_embeddings", None)
        return min(size, rows) if isinstance(rows, int) else size
    return None


# --------------------------------------------------------------------------- from the API


def from_api(data: Any, model: torch.nn.Module | None = None) -> CalibrationData:
    """The ``calibration=`` argument as :class:`CalibrationData` (see the module docstring)."""
    if isinstance(data, CalibrationData):
        return data
    if isinstance(data, torch.Tensor):
        if data.dim() < 2:
            raise TransformError(f"calibration=: a tensor of shape {tuple(data.shape)}; give token ids as (samples, "
                                 "seqlen), or an iterable of inputs")
        data = list(data.unbind(0))
        data = [row.unsqueeze(0) for row in data]
    if isinstance(data, (str, bytes, os.PathLike)) or not isinstance(data, Iterable):
        raise TransformError("calibration= takes an iterable of model inputs (tensors, mappings of forward keyword "
                             f"arguments, or (args, kwargs) pairs), not {type(data).__name__}; for a file, write "
                             "'calibrate \"PATH\"' in the script")
    samples: list[Sample] = []
    for index, item in enumerate(data):
        if index >= MAX_SAMPLES:
            raise TransformError(f"calibration=: more than {MAX_SAMPLES} samples")
        samples.append(_sample(item, index))
    if not samples:
        raise TransformError("calibration= holds no sample")
    nbytes = sum(v.numel() * v.element_size() for args, kwargs in samples for v in (*args, *kwargs.values())
                 if isinstance(v, torch.Tensor))
    return CalibrationData(samples, "calibration=", source_bytes=nbytes)


def _sample(item: Any, index: int) -> Sample:
    if isinstance(item, torch.Tensor):
        return ((item if item.dim() >= 2 or item.is_floating_point() else item.unsqueeze(0)),), {}
    if isinstance(item, Mapping):
        if not all(isinstance(k, str) for k in item):
            raise TransformError(f"calibration=: sample {index}'s keys must be forward argument names")
        return (), dict(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], (tuple, list)) and isinstance(item[1], Mapping):
        return tuple(item[0]), dict(item[1])
    raise TransformError(f"calibration=: sample {index} is a {type(item).__name__}; each sample is a tensor, a "
                         "mapping of forward keyword arguments, or an (args, kwargs) pair")


# --------------------------------------------------------------------------- from a file


def from_path(path: str, samples: int, seqlen: int, model: torch.nn.Module, tokenizer: Any = None,
              seed: int = 0) -> CalibrationData:
    """The data a ``calibrate "PATH"`` statement names (see the module docstring)."""
    if "\x00" in path:
        raise TransformError("calibrate: the path holds a NUL byte")
    target = Path(path)
    if target.suffix == ".safetensors" and target.is_file():
        data = read_tensor_file(target, samples)
        return data
    files = _text_files(path)
    text, size = _read_text(files, path)
    tokenizer = tokenizer if tokenizer is not None else find_tokenizer(model)
    if tokenizer is None:
        raise TransformError(f"calibrate \"{path}\": text needs the model's tokenizer, and none was found beside the "
                             "model (its name_or_path directory has no tokenizer files); pass tokenizer= to "
                             "transform(), or give a safetensors file of input_ids, or calibration=[ids, ...]")
    ids = _encode(tokenizer, text)
    rows = windows(ids, samples, seqlen, seed)
    if not rows:
        raise TransformError(f"calibrate \"{path}\": {len(ids)} token(s) of text, fewer than one sample of "
                             f"seqlen={seqlen}; give more text or a smaller seqlen")
    name = Path(files[0]).name if len(files) == 1 else f"{Path(path).name} ({len(files)} files)"
    return CalibrationData([((row.unsqueeze(0),), {}) for row in rows], name, source_bytes=size)


def windows(ids: torch.Tensor, samples: int, seqlen: int, seed: int = 0) -> list[torch.Tensor]:
    """``samples`` windows of ``seqlen`` consecutive tokens: disjoint and evenly spread when the text
    holds enough of them, else as many disjoint ones as fit, in a seeded random order."""
    available = len(ids) // seqlen
    if available == 0:
        return []
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(available, generator=generator)[:samples].sort().values
    return [ids[i * seqlen:(i + 1) * seqlen].clone() for i in chosen.tolist()]


def _text_files(path: str) -> list[str]:
    target = Path(path)
    if target.is_file():
        return [str(target)]
    if target.is_dir():
        found = sorted(str(p) for p in target.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    else:
        found = sorted(p for p in glob.glob(path, recursive=True) if Path(p).is_file())
    if not found:
        raise TransformError(f"calibrate \"{path}\": no such file, or no text file ({', '.join(TEXT_SUFFIXES)}) "
                             "under it")
    return found


def _read_text(files: list[str], path: str) -> tuple[str, int]:
    parts, size = [], 0
    for name in files:
        try:
            with open(name, "rb") as handle:
                raw = handle.read(MAX_TEXT_BYTES - size + 1)
        except OSError as exc:
            raise TransformError(f"calibrate \"{path}\": cannot read {name}: {exc.strerror}") from None
        size += len(raw)
        parts.append(raw.decode("utf-8", errors="replace"))
        if size > MAX_TEXT_BYTES:
            break
    return "\n\n".join(parts)[:MAX_TEXT_BYTES], min(size, MAX_TEXT_BYTES)


def _encode(tokenizer: Any, text: str) -> torch.Tensor:
    if callable(tokenizer) and not hasattr(tokenizer, "encode"):
        return torch.tensor(list(tokenizer(text)), dtype=torch.long)
    encoded = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    return torch.tensor(ids, dtype=torch.long).reshape(-1)


def find_tokenizer(model: torch.nn.Module) -> Any:
    """The tokenizer saved beside ``model`` (its ``name_or_path`` directory), or None."""
    directory = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return tokenizer_in(directory) if directory else None


#: Fewer tokens than this is no language model's vocabulary (byte-level ones start at 256).
MIN_TOKENIZER_VOCABULARY = 256


def tokenizer_in(directory: str | Path) -> Any:
    """The tokenizer saved in ``directory`` (a model's, or ``convert``'s source), or None."""
    if not Path(directory).is_dir() or not any((Path(directory) / name).is_file() for name in (
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # noqa: BLE001  (a broken tokenizer directory is the user's to fix)
        raise TransformError(f"the tokenizer beside the model ({directory}) does not load: "
                             f"{type(exc).__name__}: {exc}") from None
    # A tokenizer_config.json without its vocabulary loads as a tokenizer of a few special tokens that
    # encodes any text to nothing: calibrating on it would fit on no real token.
    size = len(tokenizer)
    if size < MIN_TOKENIZER_VOCABULARY:
        raise TransformError(f"the tokenizer beside the model ({directory}) knows only {size} token(s): its "
                             "vocabulary file (tokenizer.json, vocab.json with merges.txt, or tokenizer.model) is "
                             "missing; copy it there, pass tokenizer= to transform() or convert(), or give the samples "
                             "as token ids")
    return tokenizer


def read_tensor_file(path: Path, limit: int | None = None) -> CalibrationData:
    """A safetensors file of inputs: either one tensor per forward argument with the samples along
    the first dimension (``input_ids`` of shape ``(samples, seqlen)``), or tensors named
    ``"<index>.<argument>"`` (what :func:`~transformdsl.calibration.record_inputs` writes: one
    denoiser call per index).  Read with our bounded reader; nothing is unpickled."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:  # safetensors: header checked, no pickle
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # noqa: BLE001  (a malformed file or an OSError: said as the statement's)
        raise TransformError(f"calibrate \"{path.name}\": not a readable safetensors file: {exc}") from None
    if not tensors:
        raise TransformError(f"calibrate \"{path.name}\": the file holds no tensor")
    indexed: dict[int, dict[str, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        head, _, rest = name.partition(".")
        if head.isdigit() and rest:
            indexed.setdefault(int(head), {})[rest] = tensor
        else:
            plain[name] = tensor
    if indexed and plain:
        raise TransformError(f"calibrate \"{path.name}\": mixes indexed ('0.hidden_states') and plain tensor names "
                             f"({sorted(plain)[0]})")
    if indexed:
        samples = [((), indexed[i]) for i in sorted(indexed)]
    else:
        counts = {name: t.shape[0] if t.dim() else 0 for name, t in plain.items()}
        count = min(counts.values())
        if count == 0 or len(set(counts.values())) != 1:
            raise TransformError(f"calibrate \"{path.name}\": every tensor needs the samples along its first "
                                 f"dimension, with the same count ({counts})")
        samples = [((), {name: t[i:i + 1] for name, t in plain.items()}) for i in range(count)]
    if len(samples) > MAX_SAMPLES:
        raise TransformError(f"calibrate \"{path.name}\": more than {MAX_SAMPLES} samples")
    if limit is not None:
        samples = samples[:limit]
    return CalibrationData(samples, path.name, source_bytes=path.stat().st_size)
