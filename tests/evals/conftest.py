from __future__ import annotations

import os

import pytest

TRAINED = os.path.join(os.path.dirname(__file__), "..", "..", "service", "assets", "tiny-trained")


@pytest.fixture(scope="session")
def trained_model() -> str:
    return os.path.abspath(TRAINED)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The trained model is small: one intra-op thread is as fast, and far faster on a busy machine (OpenMP
    threads spin when cores are oversubscribed)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
