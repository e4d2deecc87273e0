"""Qwen3.5 (Gated DeltaNet + gated full attention) behind the interface the worker calls."""

from models.qwen35.config import ConfigError, Qwen35Config

__all__ = ["ConfigError", "Qwen35Config"]
