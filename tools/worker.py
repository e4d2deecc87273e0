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

from phalanx.tools.launch_options import (
    DEVICE_HELP,
    add_log_arguments,
    add_max_slots_argument,
    memory_fraction,
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
        default=os.environ.get("PHALANX_COORDINATOR"),
        help="the coordinator's tcp:// address (default: $PHALANX_COORDINATOR)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help=DEVICE_HELP)
    parser.add_argument(
        "--dtype", default="", help="torch dtype name (default: float32 on cpu, bfloat16 on cuda)"
    )
    parser.add_argument("--kv-pages", type=int, default=0, help="KV pages cap (0 on cuda: as many as fit)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    add_max_slots_argument(parser)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=memory_fraction,
        default=0.9,
        help="fraction of the GPU's memory this rank may use",
    )
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens of one prefill step")
    parser.add_argument("--dist-init-timeout", type=float, default=60.0, help="startup watchdog, seconds")
    parser.add_argument("--gate-timeout", type=float, default=600.0, help="wait for Go/Cancel, seconds")
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between heartbeats")
    parser.add_argument(
        "--coordinator-grace",
        type=float,
        default=10.0,
        help="exit after this many seconds without a connection to the coordinator",
    )
    parser.add_argument("--cuda-graph", action="store_true", help="decode from CUDA graphs")
    add_log_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from phalanx.protocol.auth import key_from_secret, shared_secret_from_env
    from phalanx.protocol.launch import WorkerConfig, WorkerLimits
    from phalanx.worker.main import run_worker

    # A rank started by torchrun or SLURM dies of SIGTERM, as those launchers expect (they follow
    # it with SIGKILL): unwinding one mid-collective could hang its exit.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not args.coordinator:
        print("phalanx worker: give --coordinator or set PHALANX_COORDINATOR", file=sys.stderr)
        return 2
    if args.device == "cpu" and (args.kv_pages <= 0 or args.max_slots is None):
        print("phalanx worker: on cpu give --kv-pages and --max-slots", file=sys.stderr)
        return 2
    try:
        key = key_from_secret(shared_secret_from_env())
    except ValueError as exc:
        print(f"phalanx worker: {exc}", file=sys.stderr)
        return 2
    config = WorkerConfig(
        model_dir=args.model,
        rank=_env_int("RANK", "SLURM_PROCID"),
        world_size=_env_int("WORLD_SIZE", "SLURM_NTASKS"),
        coordinator=args.coordinator,
        limits=WorkerLimits(
            args.kv_pages,
            args.page_size,
            args.max_slots or 0,
            args.max_batch_tokens,
            args.gpu_memory_utilization,
        ),
        device=args.device,
        local_rank=_env_int("LOCAL_RANK", "SLURM_LOCALID", default=0),
        dtype=args.dtype,
        dist_init_timeout=args.dist_init_timeout,
        gate_timeout=args.gate_timeout,
        heartbeat_interval=args.heartbeat_interval,
        coordinator_grace=args.coordinator_grace,
        cuda_graph=args.cuda_graph,
        log_level=args.log_level,
        log_format=args.log_format,
        auth_key=key.hex(),
    )
    return run_worker(config)
