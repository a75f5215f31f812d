"""What the stateful models (tests/test_model.py, tests/test_multirate_model.py) share."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def model_settings(default_examples: int) -> settings:
    """A model's hypothesis settings: ``default_examples`` runs of 25 steps (``SHMLIMIT_MODEL_EXAMPLES``
    sets another count, for a longer search), no deadline (time is the model's fake clock)."""
    return settings(
        max_examples=int(os.environ.get("SHMLIMIT_MODEL_EXAMPLES", str(default_examples))),
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
