"""The tokenizer a GGUF save writes (``tokenizer.ggml.*``), as llama.cpp's ``convert_hf_to_gguf.py`` writes it.

Where it comes from, first found first (:func:`tokenizer_fields`):

1. a tokenizer the caller passes (``save_gguf(..., tokenizer=)``);
2. the ``tokenizer.*`` fields of the GGUF file the model was read from (``load("file.gguf")`` keeps them
   on the model as :data:`KEPT_ATTRIBUTE`): written again as they were, value types included, so an
   import → export keeps them byte for byte;
3. the Hugging Face tokenizer saved beside the model (its ``name_or_path`` directory, or for a Hub id the
   Hub cache's snapshot of it; read offline as calibration reads it).

A byte-level BPE tokenizer (GPT-2's kind: SmolLM, Llama 3, Qwen2/3) is written as ``_set_vocab_gpt2``
does: ``tokenizer.ggml.model = "gpt2"``, ``pre`` (the pre-tokenizer llama.cpp knows, found as the
converter finds it: the hash of the ids of its check text, then from the tokenizer's pre-tokenizer
settings, else ``"default"``), ``tokens`` (padded with ``[PAD<i>]`` unused tokens to the model's
vocabulary), ``token_type`` (control for special added tokens, user-defined for other added ones), and
with ``gguf.SpecialVocab``: ``merges``, the bos/eos/unk/pad/... ids, ``add_bos_token``/``add_eos_token``
(as the tokenizer behaves) and the chat template.  Any other tokenizer (SentencePiece, Unigram,
WordPiece) is not written yet: the file says ``no_vocab``, with a warning.  No tokenizer: ``no_vocab``
(llama.cpp then runs on token ids).
"""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
from hashlib import sha256
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import TransformError

#: The attribute ``load("file.gguf")`` sets on the model: ``{key: (value, GGUF value type, element type)}``
#: for each ``tokenizer.*`` field of the file, in its order.
KEPT_ATTRIBUTE = "gguf_tokenizer_fields"

#: llama.cpp's check text (``convert_hf_to_gguf.py`` ``get_vocab_base_pre``'s ``chktxt``): the sha256 of
#: ``str(tokenizer.encode(CHECK_TEXT))`` names the pre-tokenizer.
CHECK_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f (multiple '
    'emojis concatenated) \u2705 \U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 '
    '\u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 ?\u6211\u60f3'
    '\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= \u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a'
    '\u043b\u0433\u0430\u0440\u0441\u043a\u0438 \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s '
    'there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'
)

#: Hashes from llama.cpp's ``get_vocab_base_pre`` (the families of the architectures written here, and
#: some fine-tunes of them), with the model each was taken from.
KNOWN_HASHES = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # Smaug-Llama-3-70B-Instruct
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",  # Llama-4-Scout-17B-16E-Instruct
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",  # tiiuae/Falcon3-7B-Base
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",  # deepseek-llm-7b-base
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",  # deepseek-coder-6.7b-base
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",  # R1-Distill-Qwen-1.5B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen/Qwen3-Embedding-0.6B
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",  # Qwen/Qwen3.5-9B-Instruct
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",  # bigcode/starcoder2-3b
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",  # smallcloudai/Refact-1_6-base
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",  # allenai/OLMo-1.7-7B-hf
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral-Nemo-Base-2407
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",  # mistral-community/pixtral-12b
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # Xenova/gpt-4o
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",  # Infinigence/Megrez-3B-Instruct
    "d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec": "seed-coder",  # Seed-Coder-8B-Base
}

#: The split expressions of the pre-tokenizers llama.cpp names (as a tokenizer.json spells them), for a
#: tokenizer whose hash is not in :data:`KNOWN_HASHES` (a fine-tune that added tokens, a retrained vocabulary).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}

#: Added tokens llama.cpp's converter marks as control although the tokenizer does not call them special.
_LOOKS_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")


def _looks_special(token: str) -> bool:
    return (token in _LOOKS_SPECIAL or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _pre_tokenizer_steps(spec: dict | None) -> list[dict]:
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [step for inner in spec.get("pretokenizers", []) for step in _pre_tokenizer_steps(inner)]
    return [spec]


def is_byte_level_bpe(spec: dict) -> bool:
    """Whether a ``tokenizer.json`` (parsed) is byte-level BPE (GPT-2's kind), what ``"gpt2"`` holds."""
    if (spec.get("model") or {}).get("type") != "BPE":
        return False
    steps = _pre_tokenizer_steps(spec.get("pre_tokenizer"))
    return any(step.get("type") == "ByteLevel" for step in steps) and \
        (spec.get("decoder") or {}).get("type") in ("ByteLevel", None)


def pre_tokenizer_name(tokenizer: Any, spec: dict) -> tuple[str, str | None]:
    """(``tokenizer.ggml.pre``, a note or None): the hash of the check text's ids as llama.cpp's converter
    computes it, else the name of the pre-tokenizer the tokenizer's settings spell, else ``"default"``."""
    digest = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if digest in KNOWN_HASHES:
        return KNOWN_HASHES[digest], None
    steps = [{k: v for k, v in step.items() if k != "trim_offsets"}
             for step in _pre_tokenizer_steps(spec.get("pre_tokenizer"))]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    if steps == [byte_level]:
        return "gpt-2", None
    if steps == [{"type": "Digits", "individual_digits": True}, byte_level]:
        return "smollm", None
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1] == {**byte_level, "use_regex": False}:
        name = _SPLITS.get((steps[0].get("pattern") or {}).get("Regex"))
        if name and steps[0].get("behavior") == "Isolated":
            return name, None
    return "default", ("tokenizer.ggml.pre = 'default': llama.cpp knows no pre-tokenizer by this tokenizer's check "
                       f"hash ({digest[:16]}...) and its pre-tokenizer is none of GPT-2's, SmolLM's, Llama 3's or "
                       "Qwen2's; llama.cpp may split text differently from it")


def _scratch_writer():
    import gguf

    return gguf.GGUFWriter(None, "llama")


def _from_writer(writer) -> dict[str, tuple[Any, int, int | None]]:
    return {key: (v.value, int(v.type), None if v.sub_type is None else int(v.sub_type))
            for key, v in writer.kv_data[0].items() if key.startswith("tokenizer.")}


def hf_fields(tokenizer: Any, vocab_size: int) -> tuple[dict | None, list[str]]:
    """The ``tokenizer.*`` fields for a transformers tokenizer (``_set_vocab_gpt2``), or ``(None, notes)`` for
    one that is not byte-level BPE.  A tokenizer with more tokens than the model has rows is refused."""
    import gguf

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not callable(getattr(tokenizer, "save_pretrained", None)) or not callable(getattr(tokenizer, "get_vocab", None)):
        raise TransformError(f"format='gguf': tokenizer= takes a transformers tokenizer, not {type(tokenizer).__name__}")
    spec = json.loads(backend.to_str()) if backend is not None else {}
    if not is_byte_level_bpe(spec):
        kind = (spec.get("model") or {}).get("type") or type(tokenizer).__name__
        return None, [f"the tokenizer ({kind}, not byte-level BPE: SentencePiece, Unigram or WordPiece) is not written "
                      "yet; the file says tokenizer.ggml.model = 'no_vocab' (llama.cpp runs on token ids)"]
    vocab = tokenizer.get_vocab()
    if max(vocab.values(), default=-1) >= vocab_size:
        raise TransformError(f"format='gguf': the tokenizer has token id {max(vocab.values())}; the model's "
                             f"vocabulary is {vocab_size} (config.vocab_size): they do not belong together")
    pre, note = pre_tokenizer_name(tokenizer, spec)
    reverse = {index: token for token, index in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):  # get_vocab_base, as llama.cpp's converter writes it
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer = _scratch_writer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    log = logging.getLogger("gguf.vocab")  # its guesses about post-processor templates: not the user's concern
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="transformdsl-tokenizer-") as scratch:
            tokenizer.save_pretrained(scratch)
            special = gguf.SpecialVocab(scratch, load_merges=True, n_vocab=vocab_size)
    finally:
        log.setLevel(level)
    # add_bos/add_eos as the tokenizer behaves (SpecialVocab reads them from its post-processor template).
    ids = tokenizer("a")["input_ids"]
    for name in ("bos", "eos"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if isinstance(token_id, int):
            special.add_special_token[name] = bool(ids) and ids[0 if name == "bos" else -1] == token_id
    special.add_to_gguf(writer, quiet=True)
    padded = f" (padded to the model's {vocab_size})" if vocab_size > len(vocab) else ""
    notes = [f"tokenizer written: byte-level BPE, {len(vocab)} tokens{padded}, {len(special.merges)} merges, "
             f"pre '{pre}'"]
    return _from_writer(writer), notes + ([note] if note else [])


def kept_fields(model: nn.Module, vocab_size: int) -> dict | None:
    """The ``tokenizer.*`` fields ``load("file.gguf")`` kept on the model, checked against its vocabulary."""
    fields = getattr(model, KEPT_ATTRIBUTE, None)
    if not fields:
        return None
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens[0]) != vocab_size:
        raise TransformError(f"format='gguf': the tokenizer read from the GGUF file has {len(tokens[0])} tokens; the "
                             f"model's vocabulary is now {vocab_size}")
    return fields


def tokenizer_beside(model: nn.Module) -> Any:
    """The tokenizer saved beside the model: in its ``name_or_path`` directory, or, for a Hub id, in the
    Hub cache's snapshot that holds its files (offline); None if there is none."""
    from ..calibration.data import find_tokenizer, tokenizer_in

    found = find_tokenizer(model)
    config = getattr(model, "config", None)
    name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if found is not None or not isinstance(name, str) or not name or Path(name).exists() or name.count("/") != 1:
        return found
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "tokenizer.json", revision=getattr(config, "_commit_hash", None))
    except Exception:  # noqa: BLE001  (not a Hub id, no cache: no tokenizer beside the model)
        return None
    return tokenizer_in(Path(cached).parent) if isinstance(cached, str) else None


def tokenizer_fields(model: nn.Module, tokenizer: Any = None) -> tuple[dict, list[str]]:
    """``({key: (value, GGUF value type, element type)}, notes)``: the ``tokenizer.*`` fields to write (see
    the module docstring), ``tokenizer.ggml.model = "no_vocab"`` alone when there is no tokenizer to write."""
    vocab_size = int(model.config.vocab_size)
    notes: list[str] = []
    fields = None
    if tokenizer is not None:
        fields, notes = hf_fields(tokenizer, vocab_size)
    else:
        fields = kept_fields(model, vocab_size)
        if fields is not None:
            notes = ["tokenizer written as the GGUF file the model was read from holds it"]
        else:
            found = tokenizer_beside(model)
            if found is not None:
                fields, notes = hf_fields(found, vocab_size)
    if fields is None:
        if notes:  # a tokenizer that could not be written: say so where it is seen
            warnings.warn(f"format='gguf': {notes[0]}", UserWarning, stacklevel=4)
        writer = _scratch_writer()
        writer.add_tokenizer_model("no_vocab")
        fields = _from_writer(writer)
        notes = notes or ["no tokenizer beside the model: tokenizer.ggml.model = 'no_vocab' (llama.cpp runs on "
                          "token ids)"]
    return fields, notes


def write_fields(writer, fields: dict) -> None:
    """Add ``fields`` (:func:`tokenizer_fields`) to a ``gguf.GGUFWriter`` with their value types."""
    from gguf import GGUFValueType

    for key, (value, kind, item) in fields.items():
        writer.add_key_value(key, value, GGUFValueType(kind), None if item is None else GGUFValueType(item))
