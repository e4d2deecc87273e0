"""The executor's config is the replica's: one typed tree (``phalanx.config.replica``), each default
written there once. ``ExecutorConfig`` is its name where the executor takes it."""

from __future__ import annotations

from phalanx.config.replica import ReplicaConfig

ExecutorConfig = ReplicaConfig

__all__ = ["ExecutorConfig"]
