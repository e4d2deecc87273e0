"""Qwen3.5 (Gated DeltaNet + gated full attention) behind the interface the worker calls."""

from phalanx.models.qwen35.batch import DecodeBatch, PrefillBatch
from phalanx.models.qwen35.config import ConfigError, Qwen35Config
from phalanx.models.qwen35.model import Qwen35Model, recurrent_state_dtype
from phalanx.models.qwen35.weights import WeightError

__all__ = [
    "ConfigError",
    "DecodeBatch",
    "PrefillBatch",
    "Qwen35Config",
    "Qwen35Model",
    "WeightError",
    "recurrent_state_dtype",
]
