from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))   # cache_helpers (the seed bug)

TRAINED = os.path.join(os.path.dirname(__file__), "..", "..", "service", "assets", "tiny-trained")


@pytest.fixture(scope="session")
def trained_model() -> str:
    return os.path.abspath(TRAINED)
