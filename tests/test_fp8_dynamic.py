"""``fp8 dynamic``: float8 weights and dynamic float8 activations with ``torch._scaled_mm``, no fallback.

On a CPU it is refused when the script is planned, naming the requirement; with the runtime switch
``CPU_SCALED_MM`` the CPU reference kernel runs the code path a GPU takes (what these tests check
numerically).  The GPU test runs only where CUDA has fp8 matmul (compute capability 8.9+).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import transformdsl  # noqa: E402
from transformdsl import models  # noqa: E402
from transformdsl.errors import ScriptError  # noqa: E402
from transformdsl.registry import declaration  # noqa: E402
from transformdsl.transforms.fp8 import CPU_SCALED_MM  # noqa: E402
from transformdsl.transforms.fp8.layers import FP8Linear  # noqa: E402

FACTORIES = {"llama": models.tiny_llama, "flux": models.tiny_flux}


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def test_a_cpu_is_refused_at_plan_time_naming_the_requirement_and_the_switch():
    with pytest.raises(ScriptError) as caught:
        transformdsl.plan(models.tiny_llama(), "fp8 dynamic")
    text = str(caught.value)
    assert "compute capability 8.9+" in text and "CPU_SCALED_MM" in text and "'fp8 native'" in text
    assert text.count("needs CUDA") == 1  # one device problem, said once


@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_cpu_reference_within_bound_and_reload(name, scaling, tmp_path):
    model = FACTORIES[name]().to(torch.bfloat16)
    reference = models.run(model)
    script = f"fp8 dynamic scaling={scaling}"
    with CPU_SCALED_MM.turned(True):
        step = transformdsl.plan(model, script).steps[0]
        assert "CPU reference" in step.device_note
        transformdsl.transform(model, script, verify=True)
        out = models.run(model)
        assert 0 < max_error(out, reference) < declaration("fp8 dynamic").error_bound["max"]
        layers = [model.get_submodule(p) for p in step.targets]
        assert all(type(m) is FP8Linear and m.native and m.strict for m in layers)
        loaded = transformdsl.load(transformdsl.save(model, tmp_path / "saved"))
        assert torch.equal(models.run(loaded), out)
    # switch off: strict layers refuse to upcast, naming the statement that made them and the fix
    with pytest.raises(RuntimeError, match=r"^fp8 dynamic: cpu has no fp8 matmul; move the model to a CUDA device"):
        models.run(loaded)
    with pytest.raises(RuntimeError, match=r"^fp8 dynamic: cpu has no fp8 matmul"):
        models.run(model)


def test_layers_the_cuda_kernel_rejects_are_left_with_the_reason():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 40)).to(torch.bfloat16)
    with CPU_SCALED_MM.turned(True):
        step = transformdsl.plan(model, "fp8 dynamic").steps[0]
    assert step.targets == ["0"]
    assert "CUDA kernels reject it" in dict(step.skipped)["1"]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs CUDA with fp8 matmul (compute capability 8.9+)")
def test_on_a_gpu_with_fp8_matmul():  # pragma: no cover  (no such device on the CPU machines)
    model = models.tiny_llama().to("cuda", torch.bfloat16)
    reference = models.run(model)
    transformdsl.transform(model, "fp8 dynamic scaling=row")
    assert transformdsl.plan(models.tiny_llama().to("cuda", torch.bfloat16), "fp8 dynamic").steps[0].device_note is None
    assert max_error(models.run(model), reference) < declaration("fp8 dynamic").error_bound["max"]


def test_transformers_format_carries_it_as_fp8_native(tmp_path):
    import json

    model = models.tiny_llama().to(torch.bfloat16)
    with CPU_SCALED_MM.turned(True):
        transformdsl.transform(model, "fp8 dynamic scaling=row")
    transformdsl.save(model, tmp_path / "out", format="transformers")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["activation_scheme"] == "dynamic"
