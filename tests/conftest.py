"""Shared test setup: offline hubs, hypothesis profiles.

Hypothesis profiles (select with ``HYPOTHESIS_PROFILE``):

- ``ci`` (default): a bounded number of examples, no deadline (CI machines are slow and
  shared), derandomized so that a CI run is reproducible, no example database.
- ``dev``: many more examples, random seeds, the example database on: for a long local
  fuzzing session (``HYPOTHESIS_PROFILE=dev pytest tests/test_fuzz_language.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
