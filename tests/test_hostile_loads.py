"""Hostile saves and races (issue 16): no code runs, no network, no prompt, one save per load.

Real saves of the built-in tiny GPT-2 and Stable Diffusion pipeline are tampered with the
red-team's cases: a pipeline component named after a keyword argument, custom code
(``None.py``, ``auto_map`` at any depth), a hub repository as ``backbone``, a shard index
pointing outside the save, tampered aliases, scheduler numbers, missing devices.  A sentinel
``None.py`` / custom module records any execution; a socket guard records any connection
attempt.  Saves race loads (no load may see two saves), killed saves leave nothing behind
after the next one, and ``save`` replaces only complete saves.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

import transformdsl
from transformdsl import LoadError, TransformError
from transformdsl.persist import META_FILE

SENTINEL_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Pristine saves: a module (GPT-2, tied weights) and a pipeline (SD: library components)."""
    from transformdsl.models import tiny_gpt2, tiny_sd_pipeline

    root = tmp_path_factory.mktemp("saves")
    transformdsl.save(tiny_gpt2(), root / "module")
    transformdsl.save(tiny_sd_pipeline(), root / "pipeline")
    return root


@pytest.fixture
def module_save(saves, copy_of) -> Path:
    return copy_of(saves / "module")


@pytest.fixture
def pipeline_save(saves, copy_of) -> Path:
    return copy_of(saves / "pipeline")


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection attempt is recorded and refused."""
    attempts: list = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError("network use during a test of load()")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the library must force it itself
    yield attempts


def plant_sentinels(directory: Path, marker: Path) -> None:
    """A ``None.py`` and custom modules in the save and in every folder of it."""
    for folder in [directory, *[p for p in directory.rglob("*") if p.is_dir()]]:
        for name in ("None.py", "custom.py", "modeling_custom.py", "pipeline.py"):
            (folder / name).write_text(SENTINEL_CODE.format(marker=str(marker)))


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# --------------------------------------------------------------------------- code execution


@pytest.mark.parametrize("keyword", ["trust_remote_code", "custom_pipeline", "local_files_only", "torch_dtype",
                                     "not_a_component"])
def test_component_named_after_a_keyword_is_refused_and_runs_nothing(pipeline_save, tmp_path, keyword, no_network):
    marker = tmp_path / "ran"
    shutil.copytree(pipeline_save / "scheduler", pipeline_save / keyword)
    edit_json(pipeline_save / META_FILE, lambda m: m["components"].update({keyword: "library"}))
    edit_json(pipeline_save / "model_index.json", lambda m: m.update({keyword: ["diffusers", "DDIMScheduler"]}))
    plant_sentinels(pipeline_save, marker)
    with pytest.raises(LoadError, match="is not a component of StableDiffusionPipeline"):
        transformdsl.load(pipeline_save)
    assert not marker.exists()
    assert no_network == []


CODE_FIELDS = [("auto_map", {"AutoModel": "custom.CustomModel"}), ("custom_pipeline", "pipeline"),
               ("trust_remote_code", True)]


@pytest.mark.parametrize("field,value", CODE_FIELDS, ids=[f for f, _ in CODE_FIELDS])
@pytest.mark.parametrize("where", ["text_encoder/config.json", "text_encoder/config.json:text_config",
                                   "tokenizer/tokenizer_config.json", "scheduler/scheduler_config.json",
                                   "vae/config.json", "unet/config.json:nested:deeper"])
def test_code_fields_at_any_depth_of_a_library_component_are_refused(pipeline_save, tmp_path, monkeypatch, field,
                                                                     value, where, no_network):
    marker = tmp_path / "ran"
    name, *keys = where.split(":")

    def change(config):
        node = config
        for key in keys:
            node = node.setdefault(key, {}) if isinstance(node.get(key, {}), dict) else node.__setitem__(key, {})
        node[field] = value

    edit_json(pipeline_save / name, change)
    plant_sentinels(pipeline_save, marker)

    def no_prompt(*args, **kwargs):
        raise AssertionError("load() asked a question")

    monkeypatch.setattr("builtins.input", no_prompt)
    with pytest.raises(LoadError, match="names code to run"):
        transformdsl.load(pipeline_save)
    assert not marker.exists()
    assert no_network == []


def test_code_fields_in_a_saved_model_configuration_are_stripped(module_save, tmp_path, no_network):
    marker = tmp_path / "ran"

    def change(meta):
        config = meta["model"]["config"]
        config["auto_map"] = {"AutoModel": "custom.CustomModel"}
        config["nested"] = {"auto_map": {"AutoConfig": "custom.C"}, "trust_remote_code": True}
        config["custom_pipeline"] = "pipeline"

    edit_json(module_save / META_FILE, change)
    plant_sentinels(module_save, marker)
    loaded = transformdsl.load(module_save)
    assert not hasattr(loaded.config, "auto_map") or not loaded.config.auto_map
    assert not marker.exists()
    assert no_network == []


def test_standard_input_is_closed_to_libraries_during_load(module_save):
    import sys

    seen = []
    from transformdsl.persist import guard

    with guard.loading():
        seen.append(sys.stdin.read())
    assert seen == [""]
    assert sys.stdin is not None


def test_every_copy_of_the_offline_setting_is_set_during_load_also_new_or_replaced_ones():
    """The guard remembers which modules hold HF_HUB_OFFLINE between loads; a module imported since,
    one replaced in place under its name, and one still being imported are all set too."""
    import sys
    import types
    from importlib.machinery import ModuleSpec

    from transformdsl.persist import guard

    def holder(name: str, initializing: bool = False) -> types.ModuleType:
        module = types.ModuleType(name)
        module.HF_HUB_OFFLINE = False
        if initializing:
            module.__spec__ = ModuleSpec(name, None)
            module.__spec__._initializing = True
        return module

    names = [f"huggingface_hub._tdsl_probe_{i}" for i in range(3)]
    try:
        with guard.loading():
            pass  # the guard has looked at every module now
        first = sys.modules[names[0]] = holder(names[0])
        sys.modules[names[1]] = holder(names[1])  # imported after it: the first is not the last one
        with guard.loading():
            assert first.HF_HUB_OFFLINE is True
        replaced = sys.modules[names[0]] = holder(names[0])  # same name, same place, same count
        partial = sys.modules[names[2]] = holder(names[2], initializing=True)
        with guard.loading():
            assert replaced.HF_HUB_OFFLINE is True and partial.HF_HUB_OFFLINE is True
    finally:
        for name in names:
            sys.modules.pop(name, None)


# --------------------------------------------------------------------------- network and files


@pytest.mark.parametrize("value", ["org/name", "hf-internal-testing/tiny-random-resnet"])
def test_hub_backbone_is_refused_without_network(pipeline_save, value, no_network):
    edit_json(pipeline_save / "text_encoder" / "config.json", lambda c: c.update({"backbone": value}))
    with pytest.raises(LoadError, match="hub repository"):
        transformdsl.load(pipeline_save)
    assert no_network == []


def test_a_clean_load_opens_no_socket_and_forces_the_hub_offline(pipeline_save, no_network):
    import huggingface_hub.constants as hub

    seen = []
    from transformers import CLIPTextModel

    original = CLIPTextModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append((hub.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"), kwargs.get("trust_remote_code")))
        return original(cls, *args, **kwargs)

    CLIPTextModel.from_pretrained = classmethod(spy)
    try:
        pipe = transformdsl.load(pipeline_save)
    finally:
        CLIPTextModel.from_pretrained = classmethod(original)
    assert seen == [(True, "1", False)]
    assert no_network == []
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert "HF_HUB_OFFLINE" not in os.environ  # restored


def test_shard_index_pointing_outside_the_save_is_refused(pipeline_save, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(pipeline_save / "text_encoder" / "model.safetensors", outside / "model.safetensors")
    (pipeline_save / "text_encoder" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"text_model.embeddings.token_embedding.weight":
                                        "../../elsewhere/model.safetensors"}}))
    with pytest.raises(LoadError, match="not a file of this folder"):
        transformdsl.load(pipeline_save)


def test_fifo_in_a_library_component_is_refused_without_blocking(pipeline_save):
    os.mkfifo(pipeline_save / "scheduler" / "extra.json")
    started = time.perf_counter()
    with pytest.raises(LoadError, match="not a regular file"):
        transformdsl.load(pipeline_save)
    assert time.perf_counter() - started < 30


def test_weights_swapped_for_a_symlink_are_refused(module_save, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.move(module_save / "model.safetensors", outside)
    os.symlink(outside, module_save / "model.safetensors")
    with pytest.raises(LoadError, match="symbolic link"):
        transformdsl.load(module_save)


# --------------------------------------------------------------------------- tampered metadata


def test_alias_shadowing_a_stored_tensor_is_refused(module_save):
    edit_json(module_save / META_FILE,
              lambda m: m["tensors"]["aliases"].update({"transformer.wpe.weight": "transformer.wte.weight"}))
    with pytest.raises(LoadError, match="replace the stored tensor"):
        transformdsl.load(module_save)


def test_alias_tying_independent_parameters_is_refused(module_save):
    def change(meta):
        meta["model"]["config"]["tie_word_embeddings"] = False

    edit_json(module_save / META_FILE, change)
    with pytest.raises(LoadError, match="tie two parameters"):
        transformdsl.load(module_save)


def test_repeated_tensor_files_are_refused_quickly(module_save):
    edit_json(module_save / META_FILE, lambda m: m["tensors"].update({"files": ["model.safetensors"] * 200_000}))
    started = time.process_time()  # our CPU time: a busy CI machine must not fail the guard
    with pytest.raises(LoadError, match="each file once"):
        transformdsl.load(module_save)
    assert time.process_time() - started < 5


@pytest.mark.parametrize("value", [3e9, 10**12, -1e9])
def test_scheduler_numbers_are_bounded(pipeline_save, value):
    edit_json(pipeline_save / "scheduler" / "scheduler_config.json",
              lambda c: c.update({"num_train_timesteps": value}))
    with pytest.raises(LoadError, match="out of range"):
        transformdsl.load(pipeline_save)


def test_nested_metadata_without_tensors_is_a_load_error(pipeline_save):
    shutil.copytree(pipeline_save / "scheduler", pipeline_save / "scheduler2", dirs_exist_ok=True)
    meta = json.loads((pipeline_save / META_FILE).read_text())
    meta["components"]["unet"] = "transformdsl"
    (pipeline_save / META_FILE).write_text(json.dumps(meta))
    (pipeline_save / "unet" / META_FILE).write_text(json.dumps(
        {"format": "transformdsl", "format_version": 1, "kind": "module", "model": {"class": "X", "library": None},
         "scripts": [], "steps": []}))
    with pytest.raises(LoadError, match="'tensors'"):
        transformdsl.load(pipeline_save)


@pytest.mark.parametrize("device", ["cuda", "cuda:3", "meta", "cpu:7", "tpu", "nonsense:0"])
def test_a_device_that_does_not_exist_here_is_named(module_save, device):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(LoadError, match=f"device={device!r}"):
        transformdsl.load(module_save, device=device)


# --------------------------------------------------------------------------- consistent reads


def _filled(model, value: float):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_loads_racing_saves_see_one_save_each(tmp_path):
    """>= 500 loads race a writer saving models filled with 1, 2, 3...: each load must see one."""
    rng = random.Random(16)
    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    target = tmp_path / "raced"
    transformdsl.save(_filled(template, 0.0), target, max_shard_size=300)
    stop = threading.Event()
    errors: list = []

    def writer():
        value = 1.0
        while not stop.is_set():
            try:
                transformdsl.save(_filled(template, value), target, max_shard_size=300)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
                return
            value += 1.0
            time.sleep(rng.random() * 0.002)

    thread = threading.Thread(target=writer)
    thread.start()
    mixed = loads = 0
    try:
        for _ in range(500):
            model = transformdsl.load(target, model=template, mmap=rng.random() < 0.5)
            values = {float(v) for p in model.parameters() for v in p.detach().flatten()[:1]}
            mixed += len(values) != 1
            loads += 1
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert loads == 500 and mixed == 0
    assert [p.name for p in tmp_path.iterdir()] == ["raced"]


# --------------------------------------------------------------------------- killed saves


def test_saves_killed_at_random_points_leave_nothing_after_the_next_save(tmp_path):
    """kill -9 a forked process in the middle of saving, at seeded random moments."""
    rng = random.Random(9)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    target = tmp_path / "model"
    transformdsl.save(model, target)
    for _ in range(6):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child saves until killed
            try:
                while True:
                    transformdsl.save(model, target, max_shard_size=4096)
            finally:
                os._exit(0)
        time.sleep(0.02 + rng.random() * 0.1)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        transformdsl.load(target, model=model)  # the previous save, or the new one, loads
    transformdsl.save(model, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("marker", ["", "91", None], ids=["empty marker", "partial marker", "no marker"])
def test_a_save_killed_while_writing_its_marker_is_removed_by_the_next(tmp_path, marker):
    """The kill landed between mkdtemp and the marker's last byte (CI saw it once)."""
    from transformdsl.persist.atomic import _boot_tag

    pid = os.fork()
    if pid == 0:  # pragma: no cover - a process that is gone by the time we save
        os._exit(0)
    os.waitpid(pid, 0)
    killed = tmp_path / f".model.tmp-{pid}.{_boot_tag()}.abcd1234"
    killed.mkdir()
    if marker is not None:
        (killed / ".transformdsl-incomplete").write_text(marker)
        (killed / "model.safetensors").write_bytes(b"the previous save, swapped out")
    transformdsl.save(torch.nn.Linear(4, 4), tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("marker", ["", "91", None], ids=["empty marker", "partial marker", "no marker"])
def test_a_temporary_named_as_ours_of_a_running_process_is_left_alone(tmp_path, marker):
    """The same leftovers as above, named by a process that is still running (this one): a save in progress."""
    from transformdsl.persist.atomic import _boot_tag

    running = tmp_path / f".model.tmp-{os.getpid()}.{_boot_tag()}.abcd1234"
    running.mkdir()
    if marker is not None:
        (running / ".transformdsl-incomplete").write_text(marker)
    transformdsl.save(torch.nn.Linear(4, 4), tmp_path / "model")
    assert running.exists()


def test_a_temporary_directory_of_a_running_save_is_left_alone(tmp_path):
    model = torch.nn.Linear(4, 4)
    running = tmp_path / ".model.tmp-running"
    running.mkdir()
    from transformdsl.persist.atomic import _boot_id

    (running / ".transformdsl-incomplete").write_text(f"{os.getpid()} {_boot_id()}\n")
    foreign = tmp_path / ".model.tmp-foreign"
    foreign.mkdir()  # no marker: not ours
    transformdsl.save(model, tmp_path / "model")
    assert running.exists() and foreign.exists()


# --------------------------------------------------------------------------- what save replaces


def test_save_does_not_wipe_a_directory_that_merely_holds_a_metadata_file(module_save, tmp_path):
    user = tmp_path / "thesis"
    user.mkdir()
    shutil.copy(module_save / META_FILE, user / META_FILE)
    (user / "thesis.tex").write_text("years of work")
    (user / "data").mkdir()
    (user / "data" / "results.csv").write_text("1,2")
    with pytest.raises(TransformError, match="did not write|incomplete"):
        transformdsl.save(torch.nn.Linear(2, 2), user)
    assert (user / "thesis.tex").read_text() == "years of work"
    assert (user / "data" / "results.csv").exists()


def test_save_does_not_replace_a_save_with_extra_files(module_save):
    (module_save / "notes.txt").write_text("mine")
    with pytest.raises(TransformError, match="did not write"):
        transformdsl.save(torch.nn.Linear(2, 2), module_save)
    assert (module_save / "notes.txt").exists()


def test_save_replaces_a_complete_save_and_respects_the_umask(module_save, tmp_path):
    old = os.umask(0o022)
    try:
        transformdsl.save(torch.nn.Linear(2, 2), module_save)
        fresh = tmp_path / "fresh"
        transformdsl.save(torch.nn.Linear(2, 2), fresh)
    finally:
        os.umask(old)
    for directory in (module_save, fresh):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in directory.iterdir())


def test_save_replaces_a_complete_pipeline_save(saves, tmp_path):
    from transformdsl.models import tiny_sd_pipeline

    target = Path(shutil.copytree(saves / "pipeline", tmp_path / "pipe"))
    transformdsl.save(tiny_sd_pipeline(seed=1), target)
    assert type(transformdsl.load(target)).__name__ == "StableDiffusionPipeline"


# --------------------------------------------------------------------------- command line


def test_inspect_escapes_control_characters(module_save, capsys):
    from transformdsl.cli import main

    edit_json(module_save / META_FILE, lambda m: m.update({"scripts": ["\x1b]0;pwned\x07"]}))
    assert main(["inspect", str(module_save)]) == 0
    assert main(["inspect", "--json", str(module_save)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out


def test_load_errors_escape_control_characters(module_save, capsys):
    from transformdsl.cli import main

    edit_json(module_save / META_FILE, lambda m: m.update({"format": "\x1b[2Jnope"}))
    assert main(["inspect", str(module_save)]) == 1
    assert "\x1b" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["check", "fmt"])
def test_check_and_fmt_refuse_devices_and_fifos_without_reading(tmp_path, command, capsys):
    from transformdsl.cli import main

    fifo = tmp_path / "script.tfm"
    os.mkfifo(fifo)
    started = time.perf_counter()
    assert main([command, "/dev/zero"]) == 1
    assert main([command, str(fifo)]) == 1
    assert time.perf_counter() - started < 5
    assert "not a regular file" in capsys.readouterr().err


# --------------------------------------------------------------------------- tampered step records


def _add_step(directory: Path, key: str, options: dict, record: dict) -> None:
    step = {"key": key, "options": options, "common": {}, "record": record, "line": 1, "statement": key,
            "script_index": 0}
    edit_json(directory / META_FILE, lambda m: (m["steps"].append(step), m.update({"scripts": [key]})))


RECORDS = {
    "fp8 compute looked up on torch": ("fp8 storage", {}, {"format": 1, "dtype": "e4m3", "compute": "load",
                                                          "layers": {}}),
    "fp8 compute not a float": ("fp8 storage", {}, {"format": 1, "dtype": "e4m3", "compute": "int8", "layers": {}}),
    "fp8 native strict as text": ("fp8 native", {}, {"format": 1, "scaling": "tensor", "compute": "bfloat16",
                                                     "strict": "no", "layers": {}}),
    "compile backend": ("compile", {}, {"targets": [], "options": {"backend": "tvm"}}),
    "compile options disagree": ("compile", {}, {"targets": [], "options": {"backend": "eager"}}),
    "NaN threshold": ("quantize int8", {"threshold": float("nan")}, {"layers": {}}),
    "infinite threshold": ("quantize int8", {"threshold": float("inf")}, {"layers": {}}),
}


@pytest.mark.parametrize("case", list(RECORDS))
def test_tampered_step_records_are_checked_like_script_options(module_save, case):
    key, options, record = RECORDS[case]
    _add_step(module_save, key, options, record)
    with pytest.raises(LoadError, match="invalid options?|disagree"):
        transformdsl.load(module_save)


def test_elementwise_record_cannot_swap_the_activation(tmp_path):
    from transformdsl.models import tiny_gpt2

    model = transformdsl.transform(tiny_gpt2(), "fuse bias_act_dropout kernel=eager")
    transformdsl.save(model, tmp_path / "fused")
    meta = json.loads((tmp_path / "fused" / META_FILE).read_text())
    chains = meta["steps"][0]["record"]["chains"]
    assert chains and all("act" in c["spec"] for c in chains)
    for chain in chains:
        chain["spec"]["act"] = "relu"
    (tmp_path / "fused" / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(LoadError, match="the record describes"):
        transformdsl.load(tmp_path / "fused")


def test_code_fields_in_a_nested_file_of_a_component_are_refused(pipeline_save):
    nested = pipeline_save / "tokenizer" / "extra"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"deep": [{"auto_map": {"AutoTokenizer": "custom.T"}}]}))
    with pytest.raises(LoadError, match="names code to run"):
        transformdsl.load(pipeline_save)


def test_zero_size_tensors_and_aliases_do_not_enlarge_the_module_budget(module_save):
    from transformdsl.persist.safetensors_io import save_aligned

    junk = {f"junk.{i}": torch.empty(0) for i in range(20_000)}
    save_aligned(junk, module_save / "junk.safetensors", metadata={"format": "pt"})

    def change(meta):
        meta["tensors"]["files"].append("junk.safetensors")
        meta["model"]["config"]["n_layer"] = 100_000
        meta.pop("save_id", None)

    edit_json(module_save / META_FILE, change)
    started = time.perf_counter()
    with pytest.raises(LoadError, match="far more modules"):
        transformdsl.load(module_save)
    assert time.perf_counter() - started < 30
