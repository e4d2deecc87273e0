"""``phalanx worker``: one rank started by torchrun, SLURM or by hand, joining a coordinator over TCP.

The rank reads the usual launcher variables: RANK and WORLD_SIZE (or SLURM_PROCID and
SLURM_NTASKS), LOCAL_RANK (or SLURM_LOCALID) for the CUDA device, and MASTER_ADDR / MASTER_PORT
for torch.distributed (``env://``). The coordinator's address comes from ``--coordinator`` or
PHALANX_COORDINATOR, e.g. ``tcp://10.0.0.1:29400``; the coordinator must have been launched with
``attach=True`` and the same world size. Attached ranks send heartbeats so the coordinator notices
them die. Control frames are authenticated with a key derived from PHALANX_SECRET, which the
coordinator and every rank must share.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from phalanx.config import settings
from phalanx.config.replica import (
    DEVICES,
    CacheConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    ReplicaConfig,
    SchedulingConfig,
    Timeouts,
)
from phalanx.tools.launch_options import (
    DEVICE_HELP,
    add_batch_arguments,
    add_log_arguments,
    add_prefix_cache_arguments,
    add_state_dtype_argument,
    memory_fraction,
    state_dtype_setting,
)


def _env_int(*names: str, default: int | None = None) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    if default is None:
        raise SystemExit(f"phalanx worker: none of {', '.join(names)} is set")
    return default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (visible on this host)")
    parser.add_argument(
        "--coordinator",
        default=settings.coordinator_address(),
        help=f"the coordinator's tcp:// address (default: ${settings.COORDINATOR})",
    )
    parser.add_argument("--device", choices=DEVICES, default="cuda", help=DEVICE_HELP)
    parser.add_argument(
        "--dtype",
        default=ModelConfig.dtype,
        help="torch dtype name (default: float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument("--kv-pages", type=int, default=0, help="KV pages cap (0 on cuda: as many as fit)")
    add_prefix_cache_arguments(parser)
    add_state_dtype_argument(parser)
    add_batch_arguments(parser)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=memory_fraction,
        default=CacheConfig.gpu_memory_utilization,
        help="fraction of the GPU's memory this rank may use",
    )
    parser.add_argument(
        "--dist-init-timeout",
        type=float,
        default=Timeouts.dist_init_timeout,
        help="startup watchdog, seconds",
    )
    parser.add_argument(
        "--gate-timeout", type=float, default=Timeouts.gate_timeout, help="wait for Go/Cancel, seconds"
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=Timeouts.heartbeat_interval,
        help="seconds between heartbeats",
    )
    parser.add_argument(
        "--coordinator-grace",
        type=float,
        default=Timeouts.coordinator_grace,
        help="exit after this many seconds without a connection to the coordinator",
    )
    parser.add_argument("--cuda-graph", action="store_true", help="decode from CUDA graphs")
    add_log_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from phalanx.protocol.auth import key_from_secret
    from phalanx.protocol.launch import rank_config
    from phalanx.worker.main import run_worker

    # A rank started by torchrun or SLURM dies of SIGTERM, as those launchers expect (they follow
    # it with SIGKILL): unwinding one mid-collective could hang its exit.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not args.coordinator:
        print(f"phalanx worker: give --coordinator or set {settings.COORDINATOR}", file=sys.stderr)
        return 2
    if args.device == "cpu" and (args.kv_pages <= 0 or args.max_slots is None):
        print("phalanx worker: on cpu give --kv-pages and --max-slots", file=sys.stderr)
        return 2
    try:
        key = key_from_secret(settings.shared_secret())
        replica = _replica(args)
    except ValueError as exc:
        print(f"phalanx worker: {exc}", file=sys.stderr)
        return 2
    rank = _env_int("RANK", "SLURM_PROCID")
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    return run_worker(rank_config(replica, rank, local_rank, args.coordinator, epoch=0, auth_key=key))


def _replica(args: argparse.Namespace) -> ReplicaConfig:
    """The replica this rank joins, as far as its flags say (the coordinator holds the rest)."""
    return ReplicaConfig(
        model=ModelConfig(args.model, args.dtype, cuda_graph=args.cuda_graph),
        parallel=ParallelConfig(
            _env_int("WORLD_SIZE", "SLURM_NTASKS"), args.device, transport="tcp", attach=True
        ),
        cache=CacheConfig(
            args.kv_pages,
            args.page_size,
            args.gpu_memory_utilization,
            args.prefix_cache,
            args.prefix_snapshots or 0,
            state_dtype_setting(args),
        ),
        scheduling=SchedulingConfig(args.max_slots or 0, args.max_batch_tokens),
        timeouts=Timeouts(
            dist_init_timeout=args.dist_init_timeout,
            gate_timeout=args.gate_timeout,
            heartbeat_interval=args.heartbeat_interval,
            coordinator_grace=args.coordinator_grace,
        ),
        log=LogConfig(args.log_level, args.log_format),
    )
