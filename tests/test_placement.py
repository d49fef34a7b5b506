"""``load(dir, device_map=..., max_memory=..., offload_folder=...)``: a saved model placed over CPU and disk.

Every quantization mode, on a diffusers model (Flux) and a transformers one (Llama), split between
the CPU and disk offload (an explicit map, and ``"auto"`` with a ``max_memory`` that forces the
split): outputs bit-identical to the unsplit load, each layer still of its quantized class with
its quantized dtypes, the offloaded ones read from files in ``offload_folder``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import transformdsl
from transformdsl import LoadError, models
from transformdsl.persist.placement import no_split_classes

SCRIPTS = ["quantize int8", "quantize nf4", "quantize hqq bits=4 group_size=16", "fp8 storage",
           "quantize int8 weight_only=true", "quantize w8a8", "quantize int4 group_size=32"]
BUILDERS = {"flux": models.tiny_flux, "llama": models.tiny_llama}


def bf16_flux():
    return models.tiny_flux().to(torch.bfloat16)


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict:
    """One save per (model, script), built once."""
    return {}


def saved(saves: dict, tmp_path_factory, family: str, script: str) -> Path:
    key = (family, script)
    if key not in saves:
        model = BUILDERS[family]()
        transformdsl.transform(model, script)
        directory = tmp_path_factory.mktemp("save")
        transformdsl.save(model, directory)
        saves[key] = directory
    return saves[key]


def layout(model) -> list:
    """Every module's class and every tensor's class, dtype and shape."""
    return ([(path, type(m)) for path, m in model.named_modules()] +
            [(name, type(t), t.dtype, tuple(t.shape)) for name, t in model.state_dict(keep_vars=True).items()])


def mapped_from(directory: Path) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(str(directory)):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((start, end))
    return ranges


def in_files(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= tensor.data_ptr() < end for start, end in ranges)


def resident_pages(tensor: torch.Tensor) -> int:
    """Pages of the tensor's bytes in memory now (``/proc/self/pagemap``'s present bit)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = tensor.data_ptr() // page, (tensor.data_ptr() + tensor.numel() * tensor.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    return sum(int.from_bytes(entries[i:i + 8], "little") >> 63 for i in range(0, len(entries), 8))


def check_placed(model, reference_model, offload: Path) -> None:
    assert layout(model) == layout(reference_model)  # quantized where they landed, every dtype kept
    ranges = mapped_from(offload)
    places = model.hf_device_map
    assert "disk" in places.values() and "cpu" in places.values(), places
    for key, place in places.items():
        module = model.get_submodule(key)
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            assert in_files(tensor, ranges) == (place == "disk"), (key, place)
    for _ in range(2):  # the second call after the offloaded pages were given back
        assert torch.equal(models.run(model), models.run(reference_model))
        offloaded = [t for key, place in places.items() if place == "disk"  # (bnb's SCB: an attribute)
                     for t in [*model.get_submodule(key).parameters(), *model.get_submodule(key).buffers()]]
        assert offloaded and not any(resident_pages(t) for t in offloaded)  # memory only while it runs


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("script", SCRIPTS)
def test_explicit_map_over_cpu_and_disk(saves, tmp_path_factory, tmp_path, family, script):
    directory = saved(saves, tmp_path_factory, family, script)
    reference = transformdsl.load(directory)
    children = [name for name, _ in reference.named_children()]
    device_map = {name: ("disk" if i % 2 else "cpu") for i, name in enumerate(children)}
    model = transformdsl.load(directory, device_map=device_map, offload_folder=tmp_path)
    check_placed(model, reference, tmp_path)


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("script", SCRIPTS)
def test_auto_map_with_a_memory_limit_splits_and_runs_the_same(saves, tmp_path_factory, tmp_path, family, script):
    directory = saved(saves, tmp_path_factory, family, script)
    reference = transformdsl.load(directory)
    size = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    model = transformdsl.load(directory, device_map="auto", max_memory={"cpu": size * 9 // 10},
                              offload_folder=tmp_path)
    check_placed(model, reference, tmp_path)
    # a transformed layer is never split, nor a module the model declares unsplittable
    unsplit = set(no_split_classes(model))
    for key in model.hf_device_map:
        parts = key.split(".")
        for depth in range(1, len(parts)):
            assert type(model.get_submodule(".".join(parts[:depth]))).__name__ not in unsplit, key


@pytest.mark.parametrize("script", ["fp8 storage", "quantize int8 weight_only=true"])
def test_bfloat16_tensors_offload_bit_for_bit(tmp_path, script):
    model = bf16_flux()
    transformdsl.transform(model, script)
    transformdsl.save(model, tmp_path / "save")
    reference = transformdsl.load(tmp_path / "save")
    assert torch.bfloat16 in {t.dtype for t in reference.state_dict().values()}
    children = [name for name, _ in reference.named_children()]
    placed = transformdsl.load(tmp_path / "save", device_map={n: "disk" if i % 2 else "cpu" for i, n in
                                                              enumerate(children)}, offload_folder=tmp_path / "off")
    check_placed(placed, reference, tmp_path / "off")


def test_transformed_layers_and_declared_blocks_are_never_split():
    model = models.tiny_llama()
    transformdsl.transform(model, "fp8 storage")
    names = no_split_classes(model)
    assert "LlamaDecoderLayer" in names and "FP8Linear" in names


def test_meta_modules_hold_no_data(saves, tmp_path_factory):
    directory = saved(saves, tmp_path_factory, "flux", "fp8 storage")
    key = "single_transformer_blocks.0.proj_out"
    model = transformdsl.load(directory, device_map={"": "cpu", key: "meta"})
    layer = model.get_submodule(key)
    assert type(layer).__name__ == "FP8Linear" and layer.fp8_weight.dtype == torch.float8_e4m3fn
    assert all(t.is_meta for t in layer.state_dict().values())
    assert not any(t.is_meta for k, t in model.state_dict().items() if not k.startswith(key + "."))
    with pytest.raises((NotImplementedError, RuntimeError)):
        models.run(model)


def test_bad_maps_are_clear_errors(saves, tmp_path_factory, tmp_path):
    directory = saved(saves, tmp_path_factory, "flux", "fp8 storage")
    with pytest.raises(LoadError, match=r"no module 'proj_ot' \(did you mean 'proj_out'"):
        transformdsl.load(directory, device_map={"": "cpu", "proj_ot": "disk"}, offload_folder=tmp_path)
    with pytest.raises(LoadError, match=r"'proj_out' -> 'cuda:3': no such device on this machine"):
        transformdsl.load(directory, device_map={"": "cpu", "proj_out": "cuda:3"})
    with pytest.raises(LoadError, match=r"'proj_out' -> 'gpu' is not a device"):
        transformdsl.load(directory, device_map={"": "cpu", "proj_out": "gpu"})
    with pytest.raises(LoadError, match="pass offload_folder=DIR"):
        transformdsl.load(directory, device_map={"": "cpu", "proj_out": "disk"})
    with pytest.raises(LoadError, match=r"[0-9]+ tensor\(s\) belong to no module of the map \('time_text_embed"):
        transformdsl.load(directory, device_map={"proj_out": "cpu"})
    with pytest.raises(LoadError, match="expected a dict {module: device} or one of 'auto'"):
        transformdsl.load(directory, device_map="everywhere")
    with pytest.raises(LoadError, match="only used to compute a map"):
        transformdsl.load(directory, device_map={"": "cpu"}, max_memory={"cpu": 10})
    with pytest.raises(LoadError, match=r"device= and device_map="):
        transformdsl.load(directory, device="cpu", device_map={"": "cpu"})
    with pytest.raises(LoadError, match="add device_map='auto'"):
        transformdsl.load(directory, max_memory={"cpu": 10})
    assert not os.listdir(tmp_path)  # nothing offloaded before the map was checked


def test_a_pipeline_is_placed_component_by_component(tmp_path):
    pipe = models.tiny_sd_pipeline()
    transformdsl.transform(pipe, "fp8 storage")
    transformdsl.save(pipe, tmp_path / "pipe")
    with pytest.raises(LoadError, match="this is a pipeline: load it, then place its components"):
        transformdsl.load(tmp_path / "pipe", device_map="auto")
