"""Rank processes for the multi-rank benches (and the GPU tests that reuse them): spawned with
torch.multiprocessing, one device each, joined in one process group, stopped as a whole when one
fails or they overrun their time."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# NVLink multicast stays off in every rank (it can take a shared host's GPUs out of service).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RANK_RUN_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(
    fn: Callable[..., None], world_size: int, args: tuple, timeout_s: float = RANK_RUN_TIMEOUT_S
) -> None:
    """Run ``fn(rank, world_size, init_method, *args)`` in ``world_size`` spawned processes.

    Raises (every rank stopped) when a rank fails or exits badly, or when they are not all done
    within ``timeout_s``: a wedged collective must not hang the caller.
    """
    import torch.multiprocessing as mp

    for name, value in CHILD_ENV.items():
        os.environ.setdefault(name, value)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.start_processes(
        fn, args=(world_size, init_method, *args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(10.0)
            raise TimeoutError(
                f"{world_size} ranks of {getattr(fn, '__name__', fn)} did not finish within {timeout_s:g} s; "
                "every rank was killed"
            )


def init_rank(rank: int, world_size: int, init_method: str, device_kind: str) -> torch.device:
    """Bind this rank's device and, above TP 1, join the process group (NCCL on CUDA, else gloo)."""
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    elif device_kind == "cpu":
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    else:
        raise ValueError(f"rank {rank}: unknown device {device_kind!r} (cuda or cpu)")
    if world_size > 1:
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            device_id=device if device.type == "cuda" else None,
        )
    return device


def host_barrier() -> Callable[[], None]:
    """A barrier that touches no CUDA stream (a gloo group), like the coordinator's replies."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda: None
    group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return lambda: dist.barrier(group=group)


def finish_rank() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
