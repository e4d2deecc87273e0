"""Shared session fixtures: tiny random Qwen3.5 checkpoints (with tokenizer) built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied tiny model (separate lm_head.weight), seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_untied"), tied=False, seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied tiny model (lm_head shares embed_tokens), seed 1."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_tied"), tied=True, seed=1)
