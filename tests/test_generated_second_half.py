"""The second half of the generated models (Note [The generated run in two halves] in test_generated.py):
a file of its own so that the suite's other worker runs it."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")
from test_generated import generated_test  # noqa: E402  (tests/ is on sys.path: conftest)

test_generated_models_match_eager_or_raise_what_eager_raises = generated_test(1)
