"""Third-party transforms: a plugin package of one file, installed with pip, through every stage.

The plugins live in ``tests/plugins/`` as packages a user would write (spec.md, "Writing a
transform"); each test installs them with ``pip install --target`` into a folder of its own and runs
transformdsl in a fresh interpreter with that folder on ``PYTHONPATH``, the way an installed plugin
is found: through its entry point in the group ``transformdsl.transforms``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"


def _install(name: str, into: Path) -> Path:
    """``pip install`` the plugin package ``tests/plugins/NAME`` into ``into`` (a copy is built, so
    the source tree gets no build folders)."""
    source = into.parent / f"src-{name}"
    shutil.copytree(PLUGINS / name, source)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(into), str(source)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return into


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding the installed ``transformdsl-scale`` plugin."""
    return _install("scale_weights", tmp_path_factory.mktemp("site") / "lib")


def _run(sites: list[Path], code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([*map(str, sites), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=cwd or ROOT, timeout=300)


#: The command line in a fresh interpreter; reports whether torch was imported.
_CLI = """
import sys
from transformdsl.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit_:
    status = exit_.code
print("TORCH", "torch" in sys.modules, file=sys.stderr)
sys.exit(status)
"""


def _cli(sites, *argv, tmp_path=None):
    done = _run(sites, _CLI, *argv)
    return done.returncode, done.stdout, done.stderr


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "script.tfm"
    path.write_text(text)
    return str(path)


def test_check_validates_a_plugin_without_torch(site, tmp_path):
    status, out, err = _cli([site], "check", _script(tmp_path, "scale weights factor=3 in model.layers.0\n"))
    assert status == 0, err
    assert "ok (1 statement(s))" in out
    assert "TORCH False" in err


def test_check_suggests_the_plugins_option_names(site, tmp_path):
    status, _, err = _cli([site], "check", _script(tmp_path, "scale weights factr=3\n"))
    assert status == 1
    assert "unknown option 'factr' for 'scale weights' (did you mean 'factor'?)" in err
    assert "TORCH False" in err


def test_check_runs_the_plugins_rules_that_depend_on_option_values(site, tmp_path):
    rule = _script(tmp_path, "scale weights factor=500\nfp8 storage\n")
    status, _, err = _cli([site], "check", rule)
    assert status == 1
    assert "'scale weights' (line 1) and 'fp8 storage' (line 2) cannot be combined: factor=500" in err
    fields = _script(tmp_path, "scale weights factor=0 learnable=true\n")
    status, _, err = _cli([site], "check", fields)
    assert status == 1 and "learnable=true needs factor > 0" in err
    assert "TORCH False" in err
    status, _, err = _cli([site], "check", _script(tmp_path, "scale weights factor=400\nfp8 storage except Linear\n"))
    assert status == 0, err


def test_the_plugins_ordering_and_exclusivity_hold_against_the_built_ins(site):
    code = """
import transformdsl
from transformdsl import models
model = models.tiny_llama()
order = [s.transform.key() for s in transformdsl.plan(model, "quantize int8 in model.layers.1\\n"
                                                       "scale weights in model.layers.0").steps]
print(order)
try:
    transformdsl.plan(model, "scale weights\\nquantize int8")
except transformdsl.ScriptError as exc:
    print("CONFLICT", "a module takes one of them" in str(exc))
"""
    done = _run([site], code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['scale weights', 'quantize int8']", "CONFLICT True"]


def test_explain_shows_the_plugins_step(site, tmp_path):
    status, out, err = _cli([site], "explain", _script(tmp_path, "scale weights factor=3 in model.layers.0\n"),
                            "--model", "llama")
    assert status == 0, err
    assert "scale weights" in out and "7 module(s)" in out, out


def test_transform_save_and_load_in_a_fresh_process(site, tmp_path):
    save = tmp_path / "saved"
    transformed = """
import sys, torch, transformdsl
from safetensors.torch import save_file
from transformdsl import models
model = models.tiny_llama()
before = models.run(model)
transformdsl.transform(model, "scale weights factor=3 in model.layers.0")
after = models.run(model)
assert not torch.equal(before, after)
transformdsl.save(model, sys.argv[1])
save_file({"output": after}, sys.argv[1] + ".expected.safetensors")
print(type(model.model.layers[0].self_attn.q_proj).__name__)
"""
    done = _run([site], transformed, str(save))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ScaledLinear"]
    loaded = """
import sys, json, torch, transformdsl
from safetensors.torch import load_file
from transformdsl import models
from transformdsl_scale import ScaleWeights
model = transformdsl.load(sys.argv[1])
expected = load_file(sys.argv[1] + ".expected.safetensors")["output"]
print(json.dumps({"equal": torch.equal(models.run(model), expected), "finalized": ScaleWeights.finalized,
                  "class": type(model.model.layers[0].self_attn.q_proj).__name__}))
"""
    done = _run([site], loaded, str(save))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"equal": True, "finalized": [7], "class": "ScaledLinear"}


def test_the_plugin_composes_with_a_later_built_in_and_converts_in_a_fresh_process(site, tmp_path):
    """A later built-in statement selects the child the plugin's plan_effect announced
    (``<path>.linear``), and ``convert`` of a checkpoint writes what transform -> save writes."""
    code = """
import sys, json, torch, transformdsl
from pathlib import Path
from transformdsl import models
script = ("scale weights factor=3 in model.layers.0.self_attn.q_proj\\n"
          "quantize int8 weight_only=true in model.layers.0.self_attn.q_proj.linear")
root = Path(sys.argv[1])
models.tiny_llama().save_pretrained(root / "source")
plan = transformdsl.plan(models.tiny_llama(), script)
targets = [list(step.targets) for step in plan.steps]
reference = transformdsl.transform(transformdsl.load(root / "source"), script)
transformdsl.save(reference, root / "saved")
transformdsl.convert(root / "source", script, root / "converted")
converted = transformdsl.load(root / "converted")
layer = converted.model.layers[0].self_attn.q_proj
print(json.dumps({"targets": targets, "classes": [type(layer).__name__, type(layer.linear).__name__],
                  "equal": torch.equal(models.run(converted), models.run(reference)),
                  "script": json.loads((root / "converted" / "transformdsl.json").read_text())["scripts"]}))
"""
    done = _run([site], code, str(tmp_path))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["targets"] == [["model.layers.0.self_attn.q_proj"], ["model.layers.0.self_attn.q_proj.linear"]]
    assert result["classes"] == ["ScaledLinear", "Int8WeightOnlyLinear"]
    assert result["equal"]
    assert "scale weights factor=3" in str(result["script"]) and "q_proj.linear" in str(result["script"])


def test_a_plugin_that_fails_to_import_is_named_where_it_is_used(site, tmp_path):
    broken = _install("broken_plugin", tmp_path / "broken")
    status, _, err = _cli([site, broken], "check", _script(tmp_path, "prune heads\n"))
    assert status == 1
    assert ("transform 'prune heads' (entry point of transformdsl-broken 0.1: transformdsl_broken:PruneHeads) "
            "failed to import: ModuleNotFoundError") in err, err
    status, _, err = _cli([site, broken], "check", _script(tmp_path, "scale weights\nquantize int8 except Linear\n"))
    assert status == 0, err  # a script that does not use it is not affected


def test_two_plugins_claiming_one_key_is_an_error_naming_both(site, tmp_path):
    rival = _install("rival_plugin", tmp_path / "rival")
    status, _, err = _cli([site, rival], "check", _script(tmp_path, "quantize int8\n"))
    assert status == 1
    assert "two installed transforms claim 'scale weights'" in err, err
    assert "transformdsl-scale 1.0" in err and "transformdsl-rival 0.2" in err, err


def test_spec_shows_the_plugin_the_tests_install():
    spec = (ROOT / "spec.md").read_text(encoding="utf-8")
    for name in ("transformdsl_scale.py", "pyproject.toml"):
        assert (PLUGINS / "scale_weights" / name).read_text(encoding="utf-8") in spec, name


def test_a_transform_requiring_a_newer_api_is_refused_naming_both_versions():
    from transformdsl import extend, registry

    class Future(extend.Transform):
        verb = "future"
        requires_api = extend.API_VERSION + 1

    with pytest.raises(registry.PluginError, match=rf"requires transformdsl.extend API version "
                                                   rf"{extend.API_VERSION + 1}, and this transformdsl provides "
                                                   rf"version {extend.API_VERSION}: upgrade transformdsl"):
        registry.register(Future)
    assert "future" not in registry.keys()


def test_extend_exports_the_helpers_the_built_ins_use():
    """A plugin needs nothing but ``transformdsl.extend``: the helpers are the built-ins' own objects."""
    from transformdsl import explain, extend
    from transformdsl.transforms.common import modules

    for name in ("put_module", "recorded_targets", "tied_weights", "is_conv1d"):
        assert getattr(extend, name) is getattr(modules, name) and name in extend.__all__
    assert extend.human_bytes is explain.human_bytes and extend.human_bytes(1536) == "1.5 KiB"

