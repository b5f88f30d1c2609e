from __future__ import annotations

import pytest

from tests.engine.hf_models import VARIANTS, write_hf_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, str]:
    """variant name -> folder written by transformers.save_pretrained."""
    root = tmp_path_factory.mktemp("hf")
    return {v: write_hf_checkpoint(str(root / v), v) for v in VARIANTS}


@pytest.fixture(scope="session")
def mixed_ckpt(hf_checkpoints) -> str:
    return hf_checkpoints["mixed_g2_c16"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from service.testing.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
