"""The launch contract: everything one rank needs to start, encodable (msgspec JSON) so no pickle
crosses the spawn, and the spawn target that runs a rank's entry point named by qualified name
(the coordinator starts ranks without importing the worker)."""

from __future__ import annotations

import importlib

import msgspec

from phalanx.config.replica import ReplicaConfig

# The function a spawned rank runs, given its encoded WorkerConfig.
WORKER_ENTRY = "phalanx.worker.entry:spawn_main"


class WorkerLimits(msgspec.Struct, frozen=True):
    """Configured upper bounds. On CPU they are the capacity; on CUDA memory may lower them.

    On CUDA ``kv_pages`` 0 means "as many as fit" and ``max_slots`` 0 "as many as the largest
    graph bucket, if their states fit in half of the cache memory" (``phalanx.worker.capacity``).
    ``max_batch_tokens`` 0 lets the rank pick it for its device: 8192 on a GPU of 70 GiB or more but
    an A100, 2048 elsewhere; its Capacity reports the value it picked.
    """

    kv_pages: int
    page_size: int
    max_slots: int
    max_batch_tokens: int
    gpu_memory_utilization: float  # the fraction of the GPU's total memory this rank may use
    prefix_cache: bool = True  # False: no prefix-cache snapshot slots (Capacity.snapshot_slots 0)
    prefix_snapshots: int = 0  # snapshot slots; 0: as the rank sizes them (phalanx.worker.capacity)
    recurrent_state_dtype: str = ""  # float32, bfloat16; "": the model's (recurrent_state_dtype_for)


class WorkerConfig(msgspec.Struct, frozen=True):
    """One rank's launch contract; ``rank_config`` fills it from the replica's config."""

    model_dir: str
    rank: int
    world_size: int
    coordinator: str  # the coordinator's ROUTER address (ipc:// or tcp://)
    limits: WorkerLimits
    device: str  # "cpu" or "cuda"
    local_rank: int  # the CUDA device index on this host
    dtype: str  # "" picks float32 on CPU, bfloat16 on CUDA
    epoch: int  # 0: not known yet (ranks started by torchrun learn it from Go)
    dist_init_timeout: float  # the startup watchdog
    gate_timeout: float  # how long to wait for Go/Cancel before giving up
    heartbeat_interval: float  # > 0 for ranks the coordinator did not spawn
    coordinator_grace: float  # a rank exits after this long without a coordinator
    log_level: str
    log_format: str  # "console" or "json" (protocol.logs)
    auth_key: str  # hex HMAC-SHA256 key of the tcp control plane ("" on ipc: no authentication)
    cuda_graph: bool  # decode through per-bucket graphs (eager static buffers on CPU)


def rank_config(
    replica: ReplicaConfig, rank: int, local_rank: int, coordinator: str, epoch: int, auth_key: bytes | None
) -> WorkerConfig:
    """The launch contract of one rank of ``replica``. A spawned rank waits for Go as long as the
    coordinator waits for it and sends no heartbeats; an attached one (``replica.parallel.attach``:
    started by torchrun, SLURM) has its own gate timeout and heartbeats."""
    timeouts = replica.timeouts
    attached = replica.parallel.attach
    return WorkerConfig(
        model_dir=replica.model.model_dir,
        rank=rank,
        world_size=replica.parallel.tp,
        coordinator=coordinator,
        limits=WorkerLimits(
            kv_pages=replica.cache.kv_pages,
            page_size=replica.cache.page_size,
            max_slots=replica.scheduling.max_slots,
            max_batch_tokens=replica.scheduling.max_batch_tokens,
            gpu_memory_utilization=replica.cache.gpu_memory_utilization,
            prefix_cache=replica.cache.prefix_cache,
            prefix_snapshots=replica.cache.prefix_snapshots,
            recurrent_state_dtype=replica.cache.recurrent_state_dtype,
        ),
        device=replica.parallel.device,
        local_rank=local_rank,
        dtype=replica.model.dtype,
        epoch=epoch,
        dist_init_timeout=timeouts.dist_init_timeout,
        gate_timeout=timeouts.gate_timeout if attached else timeouts.startup_timeout,
        heartbeat_interval=timeouts.heartbeat_interval if attached else 0.0,
        coordinator_grace=timeouts.coordinator_grace,
        log_level=replica.log.log_level,
        log_format=replica.log.log_format,
        auth_key=auth_key.hex() if auth_key else "",
        cuda_graph=replica.model.cuda_graph,
    )


def encode_config(config: WorkerConfig) -> bytes:
    return msgspec.json.encode(config)


def decode_config(data: bytes) -> WorkerConfig:
    return msgspec.json.decode(data, type=WorkerConfig)


def run_entry(entry: str, config_json: bytes) -> None:
    """Import ``module:function`` and call it with the encoded config (a spawned rank's target)."""
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)(config_json)
