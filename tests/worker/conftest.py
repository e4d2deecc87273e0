"""The tiny model on the CPU and a fresh rank state on it, for the step command and loop tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.models.qwen35 import Qwen35Model
from phalanx.worker.commands import StepRunner
from tests.support.step_runner import new_runner


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Qwen35Model:
    return Qwen35Model.load(tiny_model_dir, rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture
def runner(model: Qwen35Model) -> StepRunner:
    return new_runner(model)
