"""The bounded undo log: originals past the budget wait on disk (or in their own file), rollback stays exact.

A real failure is injected half-way through a script on real diffusers models (the fp8 pass
raising on a later layer, or an interrupt), for each ``undo`` mode; every tensor must come back
bit for bit, as the same objects, and the undo file must be gone whatever way the transform ended.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

import transformdsl
from transformdsl import TransformError, models
from transformdsl.spill import AUTO_MAX, AUTO_MIN, auto_budget
from transformdsl.transforms.fp8 import apply as fp8_apply

#: The built-in Flux at width 128: layers of 64 KiB and more, so whole pages are at stake.
WIDE_FLUX = {**models.FLUX_CONFIG, "attention_head_dim": 32, "num_attention_heads": 4, "axes_dims_rope": (8, 12, 12)}
SCRIPT = "fuse qkv; fp8 storage"
MODES = [("memory", None), ("disk", None), ("auto", 1 << 16)]


def wide_flux(dtype=torch.bfloat16) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(**WIDE_FLUX).to(dtype).eval()


def snapshot(model) -> dict:
    """Every tensor's object, type, layout and bytes; every module's object and type."""
    return {
        "state": {key: (id(t), type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad,
                        t.detach().contiguous().view(torch.uint8).clone())
                  for key, t in model.state_dict(keep_vars=True).items()},
        "modules": [(path, id(m), type(m)) for path, m in model.named_modules()],
    }


def assert_same(before: dict, after: dict) -> None:
    assert after["modules"] == before["modules"]
    assert list(after["state"]) == list(before["state"])
    for key, (*meta, data) in before["state"].items():
        *now, now_data = after["state"][key]
        assert now == meta, key
        assert torch.equal(now_data, data), key


def fail_at_conversion(monkeypatch, n: int, exc: type[BaseException] = RuntimeError, during=None) -> None:
    """Make the fp8 pass raise ``exc`` when it converts its ``n``-th layer (a failure on a later module)."""
    convert = fp8_apply._convert
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            if during is not None:
                during()
            raise exc(f"injected at layer {n}")
        return convert(*args, **kwargs)

    monkeypatch.setattr(fp8_apply, "_convert", failing)


def undo_files(directory: Path) -> list[str]:
    """Open file descriptors of this process into ``directory`` (the undo file has no name, but an fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            out.append(target)
    return out


@pytest.mark.parametrize("undo,budget", MODES)
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failure_mid_script_rolls_back_bit_for_bit(monkeypatch, tmp_path, undo, budget, exc):
    model = wide_flux()
    reference = models.run(model)
    before = snapshot(model)
    seen = {}
    fail_at_conversion(monkeypatch, 20, exc, during=lambda: seen.update(files=undo_files(tmp_path),
                                                                        listing=os.listdir(tmp_path)))
    lines = []
    with pytest.raises(TransformError if exc is RuntimeError else exc):
        transformdsl.transform(model, SCRIPT, undo=undo, undo_budget=budget, undo_dir=tmp_path, log=lines.append)
    assert_same(before, snapshot(model))
    assert torch.equal(models.run(model), reference)
    spilled = [line for line in lines if line.startswith("undo log:")]
    if undo == "memory":
        assert not spilled and not seen["files"]
    else:  # the originals of the first layers were on disk when the failure came
        assert spilled and re.match(r"undo log: [1-9][0-9.]* [KM]iB of originals kept on disk", spilled[0]), lines
        assert len(seen["files"]) == 1 and seen["listing"] == [], seen  # one open file, with no name
    assert undo_files(tmp_path) == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("undo,budget", MODES)
def test_success_gives_the_same_model_and_frees_the_undo_file(tmp_path, undo, budget):
    expected = transformdsl.transform(wide_flux(), SCRIPT, undo="memory")
    model = wide_flux()
    transformdsl.transform(model, SCRIPT, undo=undo, undo_budget=budget, undo_dir=tmp_path)
    assert torch.equal(models.run(model), models.run(expected))
    assert undo_files(tmp_path) == [] and os.listdir(tmp_path) == []


def test_originals_someone_else_holds_stay_in_memory(tmp_path):
    model = wide_flux()
    kept = model.single_transformer_blocks[0].proj_out           # the caller keeps a replaced layer
    kept_bytes = kept.weight.detach().clone()
    tied = model.transformer_blocks[0].ff.net[2].weight          # and a tensor of another one
    tied_bytes = tied.detach().clone()
    lines = []
    transformdsl.transform(model, "fp8 storage", undo="disk", undo_dir=tmp_path, log=lines.append)
    assert any(line.startswith("undo log:") for line in lines)  # the others went to disk
    assert torch.equal(kept.weight, kept_bytes) and torch.equal(tied, tied_bytes)
    assert kept(torch.ones(1, kept.in_features, dtype=torch.bfloat16)).shape[-1] == kept.out_features


def test_memory_mapped_originals_are_left_in_their_file(monkeypatch, tmp_path):
    wide_flux(torch.float32).save_pretrained(tmp_path / "model")
    model = FluxTransformer2DModel.from_pretrained(tmp_path / "model").eval()  # memory-mapped, fp32
    reference = models.run(model)
    before = snapshot(model)
    fail_at_conversion(monkeypatch, 20)
    lines = []
    with pytest.raises(TransformError, match="injected at layer 20"):
        transformdsl.transform(model, "fp8 storage", undo="disk", undo_dir=tmp_path / "undo", log=lines.append)
    assert any(re.match(r"undo log: [1-9][0-9.]* [KM]iB of memory-mapped originals left in their files", line)
               for line in lines), lines
    assert not (tmp_path / "undo").exists()  # nothing was written: the pages are the file's
    assert_same(before, snapshot(model))
    assert torch.equal(models.run(model), reference)


def test_weights_mapped_from_one_storage_each_give_their_pages_back(monkeypatch, tmp_path):
    """A loader may map a whole file as one storage and hand out views of it: every weight's own
    pages go back, not only the first one's (the log tells them apart by their bytes)."""
    weights = tmp_path / "weights.bin"
    torch.manual_seed(0)
    values = torch.randn(2, 64, 64)
    weights.write_bytes(values.numpy().tobytes())
    storage = torch.UntypedStorage.from_file(str(weights), shared=False, nbytes=values.numel() * 4)
    whole = torch.tensor([], dtype=torch.float32).set_(storage)  # one storage, the file's pages
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    for i, layer in enumerate(model[:2]):
        layer.weight = torch.nn.Parameter(whole[i * 4096:(i + 1) * 4096].view(64, 64), requires_grad=False)
    del whole, storage, layer  # the model alone holds them (what the caller holds stays in memory)
    with torch.no_grad():  # an autograd graph would hold the weights too
        reference = model(torch.ones(1, 64))
    fail_at_conversion(monkeypatch, 4)  # the log has taken both mapped layers by then
    lines = []
    with pytest.raises(TransformError, match="injected at layer 4"):
        transformdsl.transform(model, "fp8 storage", undo="disk", log=lines.append)
    assert any("32.0 KiB of memory-mapped originals left in their files" in line for line in lines), lines
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 64)), reference)


def test_a_mapped_weight_written_in_memory_keeps_its_pages(monkeypatch, tmp_path):
    """A page of a mapped weight that was written to (copied on write) is no longer the file's:
    the log keeps it (giving it back would read the file's stale bytes on rollback)."""
    if mmap.PAGESIZE > 16 << 10:
        pytest.skip("each 16 KiB weight must span whole pages")
    weights = tmp_path / "weights.bin"
    torch.manual_seed(0)
    weights.write_bytes(torch.randn(2, 64, 64).numpy().tobytes())
    storage = torch.UntypedStorage.from_file(str(weights), shared=False, nbytes=2 * 64 * 64 * 4)
    whole = torch.tensor([], dtype=torch.float32).set_(storage)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    for i, layer in enumerate(model[:2]):
        layer.weight = torch.nn.Parameter(whole[i * 4096:(i + 1) * 4096].view(64, 64), requires_grad=False)
    del whole, storage, layer
    with torch.no_grad():
        model[1].weight[-1, -1] = 7.0  # the last page of the second weight is now the process's own
        reference = model(torch.ones(1, 64))
    fail_at_conversion(monkeypatch, 4)
    lines = []
    with pytest.raises(TransformError, match="injected at layer 4"):
        transformdsl.transform(model, "fp8 storage", undo="disk", log=lines.append)
    assert any("16.0 KiB of memory-mapped originals left in their files" in line for line in lines), lines
    assert model[1].weight[-1, -1].item() == 7.0
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 64)), reference)


def test_a_mapped_file_changed_during_the_transform_is_reported(monkeypatch, tmp_path):
    wide_flux(torch.float32).save_pretrained(tmp_path / "model")
    model = FluxTransformer2DModel.from_pretrained(tmp_path / "model").eval()
    weights = next((tmp_path / "model").glob("*.safetensors"))
    fail_at_conversion(monkeypatch, 20, during=lambda: os.utime(weights, ns=(1, 1)))
    with pytest.raises(TransformError, match=r"memory-mapped from .*changed during the transform"):
        transformdsl.transform(model, "fp8 storage", undo="disk")


def test_undo_options_are_checked():
    model = models.tiny_flux()
    with pytest.raises(ValueError, match="expected one of 'auto', 'memory', 'disk'"):
        transformdsl.transform(model, "fp8 storage", undo="tape")
    with pytest.raises(ValueError, match="undo_budget=-1"):
        transformdsl.transform(model, "fp8 storage", undo_budget=-1)
    assert auto_budget(0) == AUTO_MIN and auto_budget(1 << 40) == AUTO_MAX
    assert auto_budget(4 << 30) == int(0.05 * (4 << 30))


def test_unwritable_undo_dir_keeps_originals_in_memory(monkeypatch, tmp_path):
    model = wide_flux()
    before = snapshot(model)
    fail_at_conversion(monkeypatch, 20)
    with pytest.warns(ResourceWarning, match="cannot keep originals on disk"), pytest.raises(TransformError):
        transformdsl.transform(model, SCRIPT, undo="disk", undo_dir=tmp_path / "missing")
    assert_same(before, snapshot(model))
