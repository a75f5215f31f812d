"""What the stateful models (tests/bucket/test_model.py, tests/test_multirate_model.py, and the
tables' machines run on every backend) share."""

from __future__ import annotations

import os
import unittest
from typing import Optional, Tuple

from hypothesis import HealthCheck, settings

from shmlimit.shm.cells import native_available


def model_settings(default_examples: int) -> settings:
    """A model's hypothesis settings: ``default_examples`` runs of 25 steps (``SHMLIMIT_MODEL_EXAMPLES``
    sets another count, for a longer search), no deadline (time is the model's fake clock)."""
    return settings(
        max_examples=int(os.environ.get("SHMLIMIT_MODEL_EXAMPLES", str(default_examples))),
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def on_each_backend(
    machine: type, atomics: settings, native: Optional[settings] = None
) -> Tuple[type, type]:
    """The TestCases of the stateful ``machine`` (its ``backend`` attribute picks the cells) on the
    atomics backend and on the native one (with ``native`` settings, else ``atomics``'; skipped
    where the extension is not built)."""
    cases = []
    for backend, chosen in (("atomics", atomics), ("native", native or atomics)):
        case = type(f"{machine.__name__}_{backend}", (machine,), {"backend": backend}).TestCase
        case.settings = chosen
        cases.append(case)
    skip = unittest.skipUnless(native_available(), "the native extension is not built here")
    return cases[0], skip(cases[1])
