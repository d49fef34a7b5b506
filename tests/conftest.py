"""Test environment: never reach a model hub; one inductor cache shared by the whole test run;
hypothesis profiles.

Set at import time, before any test module imports torch or huggingface_hub (both read these once).

Hypothesis profiles (select with ``HYPOTHESIS_PROFILE``):

- ``ci`` (default): a bounded number of examples, no deadline (CI machines are slow and
  shared), derandomized so that a CI run is reproducible, no example database.
- ``dev``: many more examples, random seeds, the example database on: for a long local
  fuzzing session (``HYPOTHESIS_PROFILE=dev pytest tests/test_fuzz_language.py``).
"""

import os
import shutil
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "torchinductor")
)
# One intra-op thread: the tiny models gain nothing from more, and with other processes on the same
# cores OpenMP's spinning made a 2-step tiny pipeline call take 2-8 s instead of 0.2 s.  Override with
# OMP_NUM_THREADS=N.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from stock_kernels import stock_runs_portable_4bit  # noqa: E402, F401  (tests import it from here)

torch.manual_seed(0)

settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def copy_of(tmp_path):
    """``copy_of(directory)``: a fresh copy of a pristine save directory (a module-scoped fixture's)
    under this test's ``tmp_path``, with the same name, for the test to damage."""

    def copy(directory: Path) -> Path:
        return Path(shutil.copytree(directory, tmp_path / directory.name))

    return copy



@pytest.fixture
def aten_kernels(monkeypatch):
    """Our compiled decode kernels switched off (``TRANSFORMDSL_KERNELS=off``): quantized layers built
    in the test decode with aten's packed kernels, the path of a machine without a C compiler."""
    from transformdsl.transforms.quantize import kernels

    monkeypatch.setenv(kernels.SWITCH, "off")
    kernels.reset()
    yield
    monkeypatch.undo()
    kernels.reset()
