"""The launch contract: everything one rank needs to start, encodable (msgspec JSON) so no pickle
crosses the spawn, and the spawn target that runs a rank's entry point named by qualified name
(the coordinator starts ranks without importing the worker)."""

from __future__ import annotations

import importlib

import msgspec

# The function a spawned rank runs, given its encoded WorkerConfig.
WORKER_ENTRY = "phalanx.worker.entry:spawn_main"


class WorkerLimits(msgspec.Struct, frozen=True):
    """Configured upper bounds. On CPU they are the capacity; on CUDA memory may lower them.

    On CUDA ``kv_pages`` 0 means "as many as fit" and ``max_slots`` 0 "as many as the largest
    graph bucket, if their states fit in half of the cache memory" (``phalanx.worker.capacity``).
    """

    kv_pages: int
    page_size: int
    max_slots: int
    max_batch_tokens: int
    gpu_memory_utilization: float = 0.9  # the fraction of the GPU's total memory this rank may use


class WorkerConfig(msgspec.Struct, frozen=True):
    model_dir: str
    rank: int
    world_size: int
    coordinator: str  # the coordinator's ROUTER address (ipc:// or tcp://)
    limits: WorkerLimits
    device: str = "cpu"  # "cpu" or "cuda"
    local_rank: int = 0  # the CUDA device index on this host
    dtype: str = ""  # "" picks float32 on CPU, bfloat16 on CUDA
    epoch: int = 0  # 0: not known yet (ranks started by torchrun learn it from Go)
    dist_init_timeout: float = 60.0  # the startup watchdog
    gate_timeout: float = 600.0  # how long to wait for Go/Cancel before giving up
    heartbeat_interval: float = 0.0  # > 0 for ranks the coordinator did not spawn
    coordinator_grace: float = 10.0  # such ranks exit after this long without a coordinator
    log_level: str = "info"
    log_format: str = "console"  # "console" or "json" (protocol.logs)
    auth_key: str = ""  # hex HMAC-SHA256 key of the tcp control plane ("" on ipc: no authentication)
    cuda_graph: bool = False  # decode through per-bucket graphs (eager static buffers on CPU)


def encode_config(config: WorkerConfig) -> bytes:
    return msgspec.json.encode(config)


def decode_config(data: bytes) -> WorkerConfig:
    return msgspec.json.decode(data, type=WorkerConfig)


def run_entry(entry: str, config_json: bytes) -> None:
    """Import ``module:function`` and call it with the encoded config (a spawned rank's target)."""
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)(config_json)
