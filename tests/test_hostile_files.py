"""Hostile saved models: every corruption or tampering gives a LoadError saying what is wrong.

A real tiny model (the built-in GPT-2 of :mod:`transformdsl.models`, with tied weights and one applied
step of a test-only transform) and a real tiny pipeline (DDPM: UNet2DModel + scheduler)
are saved with :func:`transformdsl.save`, then damaged: truncated and bit-flipped
safetensors files, forged headers (huge sizes, overflowing shapes, bad offsets), wrong
dtypes and shapes, missing and extra tensors, symbolic links out of the directory,
invalid or mistyped metadata, and metadata or pipeline indexes naming modules to import.

For each one, :func:`transformdsl.load` must raise :class:`LoadError` with a message that
names the problem; nothing may be imported beyond the libraries transformdsl loads models
from (a sentinel module on ``sys.path`` records any import of it), and a template passed
as ``model=`` must be left bit-identical.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import sys
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import transformdsl
from tests.saved_files import edit_meta, read_meta, write_meta
from transformdsl import LoadError, registry
from transformdsl.extend import Transform
from transformdsl.options import option
from transformdsl.persist import META_FILE, WEIGHTS

PACKAGE = Path(transformdsl.__file__).resolve().parent
SENTINEL = "tdsl_hostile_sentinel"
#: Top-level packages a load may import lazily (model classes live there).
ALLOWED_IMPORTS = {"transformdsl", "torch", "safetensors", "diffusers", "transformers", "huggingface_hub"}


# --------------------------------------------------------------------------- a test-only transform


@dataclass(frozen=True)
class _TagOptions:
    n: int = option(1, "a number, to give the options something to check", min=0, max=10)


class HostileTag(Transform):
    """Changes nothing; records the paths it was applied to and checks them on reload."""

    verb = "hostiletag"
    summary = "test-only: record targets"
    Options = _TagOptions
    default_target = ("Linear", "Conv1D", "Conv2d")
    changes_weights = False

    def apply(self, ctx, targets):
        return {"targets": list(targets)}

    @classmethod
    def rebuild(cls, root, record, options):
        for path in record["targets"]:
            root.get_submodule(path)


@pytest.fixture(scope="module", autouse=True)
def tag_transform():
    registry.register(HostileTag)
    yield HostileTag
    registry._TRANSFORMS.pop(HostileTag.key(), None)


# --------------------------------------------------------------------------- models and saves


def tiny_gpt2():
    from transformdsl.models import tiny_gpt2 as built_in

    return built_in()


def tiny_pipeline():
    import diffusers

    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4).eval()
    return diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=10))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tag_transform):
    """Saved module and pipeline directories, never modified (tests corrupt copies)."""
    root = tmp_path_factory.mktemp("pristine")
    model = transformdsl.transform(tiny_gpt2(), "hostiletag n=3")
    transformdsl.save(model, root / "module")
    pipe = transformdsl.transform(tiny_pipeline(), "hostiletag")
    transformdsl.save(pipe, root / "pipeline")
    # Warm up: the first legitimate loads import what loading legitimately imports.
    transformdsl.load(root / "module")
    transformdsl.load(root / "pipeline")
    return root


@pytest.fixture
def saved(pristine, copy_of) -> Path:
    """A fresh copy of the saved module, to damage."""
    return copy_of(pristine / "module")


@pytest.fixture
def saved_pipeline(pristine, copy_of) -> Path:
    return copy_of(pristine / "pipeline")


@pytest.fixture(scope="module")
def template():
    """A module passed as ``load(..., model=template)``; checked to be untouched."""
    return tiny_gpt2()


@pytest.fixture(autouse=True)
def sentinel(tmp_path_factory, monkeypatch):
    """A module that, if ever imported, writes a marker file."""
    where = tmp_path_factory.mktemp("sentinel")
    marker = where / "IMPORTED"
    (where / f"{SENTINEL}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        "class Evil:\n    pass\n"
        "def system(*args):\n    pathlib.Path(" + repr(str(marker)) + ").write_text('called')\n")
    (where / "evil.py").write_text((where / f"{SENTINEL}.py").read_text())
    monkeypatch.syspath_prepend(str(where))
    yield where
    assert not marker.exists(), "a hostile file made transformdsl import or run the sentinel"
    assert SENTINEL not in sys.modules and "evil" not in sys.modules


# --------------------------------------------------------------------------- helpers


def state_snapshot(model) -> tuple:
    """Keys in order, module types, and every tensor's dtype, shape and bytes."""
    tensors = tuple((k, v.dtype, tuple(v.shape), v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
                    for k, v in model.state_dict().items())
    return tensors, tuple((name, type(m)) for name, m in model.named_modules())


def assert_refused(directory: Path, match: str, *, template=None) -> LoadError:
    """load() raises LoadError matching ``match``, imports nothing new and leaves ``template`` as it was."""
    before = set(sys.modules)
    snapshot = state_snapshot(template) if template is not None else None
    with pytest.raises(LoadError, match=match) as caught:
        transformdsl.load(directory, model=template)
    imported = {m for m in set(sys.modules) - before if m.split(".")[0] not in ALLOWED_IMPORTS}
    assert not imported, f"loading a hostile file imported {sorted(imported)}"
    if template is not None:
        assert state_snapshot(template) == snapshot, "load() changed the template model"
    return caught.value


def split_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: Path, header: dict, data: bytes, declared: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if declared is None else declared) + text + data)


def rewrite_tensors(directory: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / WEIGHTS))
    save_file(change(dict(tensors)), str(directory / WEIGHTS), metadata={"format": "pt"})


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- the pristine save loads


def test_pristine_saves_load(pristine, template):
    model = transformdsl.load(pristine / "module")
    ids = torch.arange(8).view(1, 8)
    original = transformdsl.transform(tiny_gpt2(), "hostiletag n=3")
    assert torch.equal(model(ids).logits, original(ids).logits)
    assert transformdsl.load(pristine / "module", model=template) is not template
    assert type(transformdsl.load(pristine / "pipeline")).__name__ == "DDPMPipeline"


# --------------------------------------------------------------------------- the weights file


@pytest.mark.parametrize("keep", [0, 4, 8, 100, "header", "half", "minus1"])
def test_truncated_weights(saved, template, keep):
    path = saved / WEIGHTS
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    size = {"header": 8 + n // 2, "half": 8 + n + (len(raw) - 8 - n) // 2, "minus1": len(raw) - 1}.get(keep, keep)
    path.write_bytes(raw[:size])
    assert_refused(saved, "corrupt or truncated safetensors file", template=template)
    assert_refused(saved, "corrupt or truncated safetensors file")


@given(st.data())
def test_flipped_header_bytes(pristine, tmp_path_factory, data):
    directory = Path(shutil.copytree(pristine / "module", tmp_path_factory.mktemp("flip") / "m"))
    path = directory / WEIGHTS
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    at = data.draw(st.integers(0, 8 + n - 1), label="byte")
    raw[at] ^= data.draw(st.integers(1, 255), label="xor")
    path.write_bytes(bytes(raw))
    try:
        transformdsl.load(directory)
    except LoadError as error:
        assert str(directory) in str(error)
    # A flip can leave a valid file (a digit of a shape and of an offset changing
    # together is unlikely; a flipped "__metadata__" value is harmless): loading it
    # is fine, crashing is not.


def test_flipped_data_bytes_load_but_compute_garbage(saved):
    # Not detected: safetensors has no checksum.  SECURITY.md says so.
    raw = bytearray((saved / WEIGHTS).read_bytes())
    header, _ = split_safetensors(saved / WEIGHTS)
    start = 8 + len(raw) - len(_) + header["transformer.wpe.weight"]["data_offsets"][0]
    raw[start:start + 64] = bytes(b ^ 0xFF for b in raw[start:start + 64])
    (saved / WEIGHTS).write_bytes(bytes(raw))
    model = transformdsl.load(saved)
    assert not torch.equal(model.state_dict()["transformer.wpe.weight"], tiny_gpt2().state_dict()["transformer.wpe.weight"])


@pytest.mark.parametrize("declared", [2**63, 2**64 - 1, 100_000_001, "file+1"])
def test_oversized_header_length(saved, template, declared):
    header, data = split_safetensors(saved / WEIGHTS)
    size = (saved / WEIGHTS).stat().st_size
    before = peak_rss_mb()
    write_safetensors(saved / WEIGHTS, header, data, declared=size + 1 if declared == "file+1" else declared)
    assert_refused(saved, "corrupt or truncated safetensors file", template=template)
    assert peak_rss_mb() - before < 256


@pytest.mark.parametrize("shape, offsets", [
    ([2**20, 2**18], [0, 2**40]),            # a 1 TiB tensor in a small file
    ([2**40, 2**40], [0, 16]),               # shape product overflows 64 bits
    ([4, 4], [0, 2**64 - 1]),                 # offset beyond any file
    ([4, 4], [64, 0]),                        # end before start
    ([-1, 4], [0, 64]),                       # negative dimension
])
def test_forged_sizes_allocate_nothing(saved, template, shape, offsets):
    header, data = split_safetensors(saved / WEIGHTS)
    name = "transformer.wte.weight"
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": offsets}
    write_safetensors(saved / WEIGHTS, header, data)
    before = peak_rss_mb()
    assert_refused(saved, "corrupt or truncated safetensors file", template=template)
    assert peak_rss_mb() - before < 256


def test_unknown_dtype_in_header(saved):
    header, data = split_safetensors(saved / WEIGHTS)
    header["transformer.wte.weight"]["dtype"] = "Q99"
    write_safetensors(saved / WEIGHTS, header, data)
    assert_refused(saved, "corrupt or truncated safetensors file")


def test_header_is_not_json(saved):
    header, data = split_safetensors(saved / WEIGHTS)
    text = b"[" * 4096
    (saved / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + data)
    assert_refused(saved, "corrupt or truncated safetensors file")


def test_wrong_dtype_for_a_layer(saved, template):
    rewrite_tensors(saved, lambda t: {**t, "transformer.h.0.mlp.c_fc.weight": t["transformer.h.0.mlp.c_fc.weight"].double()})
    error = assert_refused(saved, "tensor 'transformer.h.0.mlp.c_fc.weight' is float64", template=template)
    assert "expects float32[64, 256]" in str(error)
    assert_refused(saved, "is float64")


def test_wrong_shape_for_a_layer(saved, template):
    rewrite_tensors(saved, lambda t: {**t, "transformer.h.1.attn.c_attn.bias": torch.zeros(7)})
    assert_refused(saved, r"'transformer.h.1.attn.c_attn.bias' is float32\[7\] .* expects float32\[192\]",
                   template=template)


def test_missing_tensor(saved, template):
    rewrite_tensors(saved, lambda t: {k: v for k, v in t.items() if k != "transformer.ln_f.bias"})
    assert_refused(saved, r"missing 1 tensor\(s\): transformer.ln_f.bias", template=template)


def test_extra_tensor(saved, template):
    rewrite_tensors(saved, lambda t: {**t, "transformer.evil": torch.zeros(3)})
    assert_refused(saved, r"unexpected 1 tensor\(s\): transformer.evil", template=template)


def test_tensor_stored_in_two_files(saved):
    shutil.copy(saved / WEIGHTS, saved / "second.safetensors")
    edit_meta(saved, ("tensors", "files"), [WEIGHTS, "second.safetensors"])
    assert_refused(saved, "is stored twice")


def test_alias_to_a_missing_tensor(saved):
    edit_meta(saved, ("tensors", "aliases"), {"lm_head.weight": "nowhere"})
    assert_refused(saved, "alias 'lm_head.weight' points to missing tensor 'nowhere'")


def test_weights_missing(saved, template):
    (saved / WEIGHTS).unlink()
    assert_refused(saved, "missing tensor file", template=template)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_weights_not_a_regular_file(saved, kind):
    (saved / WEIGHTS).unlink()
    if kind == "directory":
        (saved / WEIGHTS).mkdir()
    else:
        os.mkfifo(saved / WEIGHTS)  # reading it would block forever
    assert_refused(saved, "missing tensor file|not a regular file")


# --------------------------------------------------------------------------- paths and links


@pytest.mark.parametrize("target", ["/etc/passwd", "outside-copy", "inside-copy", "/dev/zero"])
def test_weights_symlink_refused(saved, template, tmp_path, target):
    if target == "outside-copy":
        target = shutil.copy(saved / WEIGHTS, tmp_path / "outside.safetensors")
    elif target == "inside-copy":
        target = shutil.copy(saved / WEIGHTS, saved / "other.safetensors")
    (saved / WEIGHTS).unlink()
    (saved / WEIGHTS).symlink_to(target)
    assert_refused(saved, "symbolic link", template=template)


def test_metadata_symlink_refused(saved, tmp_path):
    outside = tmp_path / "meta.json"
    shutil.move(saved / META_FILE, outside)
    (saved / META_FILE).symlink_to(outside)
    assert_refused(saved, "symbolic link")


def test_subdirectory_symlink_out_refused(saved, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    shutil.move(saved / WEIGHTS, tmp_path / "elsewhere" / WEIGHTS)
    (saved / "sub").symlink_to(tmp_path / "elsewhere")
    edit_meta(saved, ("tensors", "files"), [f"sub/{WEIGHTS}"])
    assert_refused(saved, "symbolic link or leads outside|refusing file name")


@pytest.mark.parametrize("name", ["../model.safetensors", "/etc/passwd", "a/../../x", "x\x00y", "", "."])
def test_file_names_leading_outside_refused(saved, name):
    edit_meta(saved, ("tensors", "files"), [name])
    assert_refused(saved, "refusing file name|not a regular file|missing tensor file")


# --------------------------------------------------------------------------- the metadata file


@pytest.mark.parametrize("text, match", [
    ("{", "not valid JSON"),
    ("", "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON|nested too deeply|nests deeper"),
    ('{"a": 1e999999, "format": NaN}', "not transformdsl metadata"),
    ('{"format": "transformdsl", "format_version": ' + "9" * 5000 + "}", "not valid JSON"),
    ("[]", "not transformdsl metadata"),
    ('"transformdsl"', "not transformdsl metadata"),
    ("null", "not transformdsl metadata"),
    ("3", "not transformdsl metadata"),
])
def test_metadata_not_json_or_not_a_dict(saved, template, text, match):
    (saved / META_FILE).write_text(text)
    assert_refused(saved, match, template=template)


def test_metadata_not_utf8(saved):
    (saved / META_FILE).write_bytes(b'{"format": "\xff\xfe"}')
    assert_refused(saved, "not valid JSON")


def test_metadata_missing(saved):
    (saved / META_FILE).unlink()
    assert_refused(saved, "not a transformdsl save")


def test_metadata_too_large_is_not_read(saved):
    with open(saved / META_FILE, "r+b") as f:
        f.truncate(65 * 1024**2)  # sparse: costs no disk
    before = peak_rss_mb()
    assert_refused(saved, "over the .* limit")
    assert peak_rss_mb() - before < 32


@pytest.mark.parametrize("field, value, match", [
    (("format_version",), 3, "format version 3; .* upgrade transformdsl"),
    (("format_version",), 0, "unknown format version 0"),
    (("format_version",), "1", "format_version is missing or not an integer"),
    (("format_version",), True, "format_version is missing or not an integer"),
    (("format_version",), 1.0, "format_version is missing or not an integer"),
    (("format",), "pickle", "not transformdsl metadata"),
    (("kind",), "evil", "unknown kind 'evil'"),
    (("steps", 0, "key"), "quantize evil", "uses transform 'quantize evil', which this transformdsl .* does not know"),
    (("steps", 0, "options", "n"), 99, "invalid options: option 'n'|must be at most 10"),
    (("steps", 0, "options", "evil"), 1, r"unknown options \['evil'\]"),
    (("steps", 0, "common", "evil"), 1, r"unknown options \['evil'\]"),
    (("steps", 0, "record", "targets"), ["nowhere"], "cannot replay 'hostiletag'"),
    (("model", "library"), "os", "unknown model library 'os'"),
    (("model", "library"), SENTINEL, f"unknown model library '{SENTINEL}'"),
    (("model", "class"), "os.system", "invalid class name 'os.system'"),
    (("model", "class"), "AutoModel", "'AutoModel' is not a transformers model class"),
    (("model", "class"), "GPT2Config", "'GPT2Config' is not a transformers model class"),
    (("model", "class"), "__loader__", "'__loader__' is not a transformers model class"),
    (("model", "class"), SENTINEL, f"'{SENTINEL}' is not a transformers model class"),
    (("model", "config", "n_layer"), "two", "cannot build GPT2LMHeadModel from the saved configuration"),
    (("model", "config", "attn_implementation"), "kernels-community/evil", "asks for the code kernel"),
    (("model", "config", "text_config"), {"_attn_implementation": "evil/kernel"}, "asks for the code kernel"),
])
def test_metadata_values_refused(saved, field, value, match):
    edit_meta(saved, field, value)
    assert_refused(saved, match)


def test_module_metadata_naming_a_pipeline(saved):
    edit_meta(saved, ("kind",), "pipeline")
    edit_meta(saved, ("pipeline_class",), SENTINEL)
    assert_refused(saved, "'components' is malformed")


def test_config_describing_a_huge_model_is_refused_quickly(saved):
    # A 50-byte change asks for a million layers: building them (even on the meta
    # device) would take hours and gigabytes.  The saved tensors bound the model size.
    edit_meta(saved, ("model", "config", "n_layer"), 1_000_000)
    started = time.perf_counter()
    assert_refused(saved, "far more modules than the saved tensors")
    assert time.perf_counter() - started < 30


# Every field of the metadata, replaced by a value of every JSON type: LoadError (or a
# successful load, for purely informational fields), never another exception.
FIELDS = [
    ("model",), ("model", "library"), ("model", "class"), ("model", "config"),
    ("scripts",), ("scripts", 0), ("steps",), ("steps", 0), ("steps", 0, "key"), ("steps", 0, "line"),
    ("steps", 0, "statement"), ("steps", 0, "options"), ("steps", 0, "options", "n"), ("steps", 0, "common"),
    ("steps", 0, "common", "component"), ("steps", 0, "record"), ("steps", 0, "record", "targets"),
    ("steps", 0, "script_index"), ("tensors",), ("tensors", "files"), ("tensors", "files", 0),
    ("tensors", "nonpersistent"), ("tensors", "aliases"), ("tensors", "aliases", "lm_head.weight"),
    ("versions",), ("kind",), ("format",), ("format_version",),
]
JUNK = [None, True, -1, 2.5, "", "x", [], [None], {}, {"x": {}}, [[[]]]]


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: ".".join(map(str, f)))
def test_every_metadata_field_with_every_json_type(pristine, tmp_path, field):
    unexpected = []
    for i, junk in enumerate(JUNK):
        directory = Path(shutil.copytree(pristine / "module", tmp_path / str(i)))
        edit_meta(directory, field, junk)
        try:
            transformdsl.load(directory)
        except LoadError:
            pass
        except Exception as exc:  # noqa: BLE001 - the point of the test
            unexpected.append(f"{junk!r}: {type(exc).__name__}: {exc}")
    assert not unexpected, "\n".join(unexpected)


@pytest.mark.parametrize("field, junk", [
    (("scripts", 0), 3), (("steps", 0, "line"), "x"), (("steps", 0, "statement"), []),
    (("steps", 0, "script_index"), 5), (("tensors", "nonpersistent"), [{}]), (("versions",), []),
])
def test_mistyped_history_fields_are_named(saved, field, junk):
    # These used to load, carrying the junk into the model's history (and crash a later save).
    edit_meta(saved, field, junk)
    name = {"scripts": "'scripts'", "steps": "step 0", "tensors": "'tensors.nonpersistent'",
            "versions": "'versions'"}[field[0]]
    assert_refused(saved, name)


def test_inspect_refuses_what_load_refuses(saved_pipeline, saved):
    from transformdsl.persist import inspect

    edit_meta(saved_pipeline, ("components",), {"../../etc": "transformdsl"})
    with pytest.raises(LoadError, match="invalid component name"):
        inspect(saved_pipeline)
    edit_meta(saved_pipeline, ("components",), [])
    with pytest.raises(LoadError, match="'components'"):
        inspect(saved_pipeline)
    (saved / WEIGHTS).write_bytes(b"\x00" * 7)
    with pytest.raises(LoadError, match="corrupt or truncated"):
        inspect(saved)


# --------------------------------------------------------------------------- pipelines


@pytest.mark.parametrize("name, match", [
    ("os.system", "is not a diffusers pipeline class"),
    (SENTINEL, "is not a diffusers pipeline class"),
    ("UNet2DModel", "is not a diffusers pipeline class"),
    ("__class__", "is not a diffusers pipeline class"),
    (["evil", "Evil"], "'pipeline_class' is malformed"),
    ("StableDiffusionPipeline", "model_index.json names 'DDPMPipeline'"),
])
def test_pipeline_class_refused(saved_pipeline, name, match):
    edit_meta(saved_pipeline, ("pipeline_class",), name)
    assert_refused(saved_pipeline, match)


@pytest.mark.parametrize("components, match", [
    ([], "'components' is malformed"),
    ({"../unet": "transformdsl"}, "invalid component name"),
    ({"unet": "pickle", "scheduler": "library"}, "unknown storage 'pickle'"),
    ({"unet": ["transformdsl"], "scheduler": "library"}, "unknown storage"),
    ({"unet": "transformdsl"}, "component 'scheduler' of model_index.json is not in"),
])
def test_pipeline_components_refused(saved_pipeline, components, match):
    edit_meta(saved_pipeline, ("components",), components)
    assert_refused(saved_pipeline, match)


@pytest.mark.parametrize("entry, match", [
    ([SENTINEL, "Evil"], f"component class {SENTINEL}.Evil is not allowed"),
    (["os", "system"], "component class os.system is not allowed"),
    (["diffusers", "DiffusionPipeline"], "not a loadable component class"),
    (["diffusers", "DDPMPipeline"], "not a loadable component class"),
    (["transformers", "AutoModel"], "not a loadable component class"),
    (["diffusers", "os"], "not a loadable component class"),
    (["diffusers"], "no \\[library, class\\] entry"),
    ("DDPMScheduler", "no \\[library, class\\] entry"),
])
def test_pipeline_index_component_classes_refused(saved_pipeline, entry, match):
    index = json.loads((saved_pipeline / "model_index.json").read_text())
    index["scheduler"] = entry
    write_meta(saved_pipeline, index, "model_index.json")
    assert_refused(saved_pipeline, match)


def test_pipeline_index_entry_diffusers_would_import_is_refused(saved_pipeline):
    # A component in model_index.json but not in transformdsl.json: diffusers would load
    # it itself, importing whatever module the entry names.
    index = json.loads((saved_pipeline / "model_index.json").read_text())
    index["scheduler"] = [SENTINEL, "Evil"]
    write_meta(saved_pipeline, index, "model_index.json")
    meta = read_meta(saved_pipeline)
    del meta["components"]["scheduler"]
    write_meta(saved_pipeline, meta)
    assert_refused(saved_pipeline, "component 'scheduler' of model_index.json is not in")


def test_pipeline_index_custom_code_is_refused(saved_pipeline):
    # diffusers reads `_class_name: [file, class]` as custom pipeline code in the folder.
    shutil.copy(sys.modules["pathlib"].__file__, saved_pipeline / "evil.py")
    index = json.loads((saved_pipeline / "model_index.json").read_text())
    index["_class_name"] = ["evil", "Evil"]
    write_meta(saved_pipeline, index, "model_index.json")
    assert_refused(saved_pipeline, "model_index.json names")


@pytest.mark.parametrize("text", ["[]", "{", "null", "[" * 100_000])
def test_pipeline_index_not_a_dict(saved_pipeline, text):
    (saved_pipeline / "model_index.json").write_text(text)
    assert_refused(saved_pipeline, "cannot read the pipeline index|model_index.json")


def test_pipeline_index_symlink_refused(saved_pipeline, tmp_path):
    shutil.move(saved_pipeline / "model_index.json", tmp_path / "index.json")
    (saved_pipeline / "model_index.json").symlink_to(tmp_path / "index.json")
    assert_refused(saved_pipeline, "symbolic link")


def test_pipeline_component_folder_symlink_refused(saved_pipeline, tmp_path):
    shutil.move(saved_pipeline / "scheduler", tmp_path / "scheduler")
    (saved_pipeline / "scheduler").symlink_to(tmp_path / "scheduler")
    assert_refused(saved_pipeline, "symbolic link")


def test_pipeline_transformdsl_component_is_checked_too(saved_pipeline):
    edit_meta(saved_pipeline / "unet", ("model", "class"), "os.system")
    assert_refused(saved_pipeline, "invalid class name 'os.system'")


def test_pipeline_library_component_config_bomb_refused(saved_pipeline):
    # A library component is loaded by diffusers; its config is bounded by its tensors too.
    meta = read_meta(saved_pipeline)
    meta["components"]["unet"] = "library"
    write_meta(saved_pipeline, meta)
    shutil.rmtree(saved_pipeline / "unet")
    tiny_pipeline().unet.save_pretrained(str(saved_pipeline / "unet"))
    config = json.loads((saved_pipeline / "unet" / "config.json").read_text())
    config["layers_per_block"] = 100_000
    (saved_pipeline / "unet" / "config.json").write_text(json.dumps(config))
    started = time.perf_counter()
    assert_refused(saved_pipeline, "far more modules than the saved tensors")
    assert time.perf_counter() - started < 30


def test_pipeline_with_model_argument_refused(saved_pipeline, template):
    assert_refused(saved_pipeline, "drop model=", template=template)


# --------------------------------------------------------------------------- the package source


#: Builtins that run code from text (``x.eval()``, a method, is fine).
FORBIDDEN_BUILTINS = {"eval", "exec", "execfile", "__import__"}
#: Unpickling, code loading and process spawning, however reached.
FORBIDDEN_NAMES = {"pickle", "cPickle", "marshal", "shelve", "dill", "joblib", "cloudpickle", "subprocess", "runpy",
                   "import_module", "spec_from_file_location", "exec_module", "load_source", "unsafe_load"}
FORBIDDEN_ATTRIBUTES = {("torch", "load"), ("torch", "serialization"), ("os", "system"), ("os", "popen"),
                        ("yaml", "load"), ("numpy", "load"), ("np", "load")}
#: (file, name) uses that are not driven by file content, with the reason.
ALLOWED_USES = {
    ("resolve.py", "import_module"): "`--model module:factory` imports the code the user names on the command line",
    ("registry.py", "import_module"): "a transform's module, as the built-in table or an installed entry point names "
                                      "it; a key read from a file only selects among those",
    ("build.py", "subprocess"): "the C compiler on PATH, run on the package's own kernels/rows.c (nothing from a "
                                "file being loaded reaches it)",
}


def _violations(path: Path) -> list[str]:
    """Uses of unpickling, code evaluation or dynamic imports in one source file (names
    in code only: comments and strings are not scanned; ``x.eval()`` is a method)."""
    found = []
    with open(path, "rb") as f:
        tokens = [t for t in tokenize.tokenize(f.readline) if t.type in (tokenize.NAME, tokenize.OP)]
    for previous, token, following in zip([None] + tokens, tokens, tokens[1:] + [None]):
        after_dot = previous is not None and previous.string == "."
        if token.type == tokenize.NAME and (token.string in FORBIDDEN_NAMES
                                            or token.string in FORBIDDEN_BUILTINS and not after_dot):
            found.append(f"{path.name}:{token.start[0]}: {token.string}")
        if (following is not None and following.string == "." and token.type == tokenize.NAME):
            index = tokens.index(following)
            if index + 1 < len(tokens) and (token.string, tokens[index + 1].string) in FORBIDDEN_ATTRIBUTES:
                found.append(f"{path.name}:{token.start[0]}: {token.string}.{tokens[index + 1].string}")
    return found


def test_package_source_never_unpickles_evaluates_or_imports_by_name():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 10
    violations = [v for path in sources for v in _violations(path)
                  if (v.split(":")[0], v.split(": ")[1]) not in ALLOWED_USES]
    assert not violations, "\n".join(violations)


def test_source_scan_catches_what_it_should(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import pickle\nx = torch.load(p)\nmodel.eval()\n# eval( in a comment\ny = eval('1')\n"
                      "s = 'exec(1)'\nimportlib.import_module(name)\n")
    assert [v.split(": ")[1] for v in _violations(sample)] == ["pickle", "torch.load", "eval", "import_module"]
