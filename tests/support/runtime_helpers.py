"""Shared pieces of the runtime tests: a small launch config, a plan driver, an in-process reference."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from phalanx.executor.launcher import ExecutorConfig
from phalanx.executor.runtime import Executor
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import DecodeRow, PrefillChunk, SamplingParams, TokenResult

PAGE = 4
PAGES_PER_REQUEST = 4  # 16 positions per request
LOGPROBS = SamplingParams(logprobs=3)


REPO = Path(__file__).resolve().parents[2]


def rank_pids(executor: Executor) -> list[int | None]:
    """Each rank's pid (None for a rank not spawned here: torchrun's, watched through heartbeats)."""
    return [rank.process.pid if rank.process is not None else None for rank in executor._link.ranks]


def rank_exit_codes(executor: Executor) -> list[int | None]:
    """Each spawned rank's exit code (None while it runs, or for a rank not spawned here)."""
    return [rank.exitcode for rank in executor._link.ranks]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_attached_rank(
    rank: int,
    model_dir: Path,
    coordinator: str,
    master_port: int,
    world_size: int = 2,
    *extra: str,
    secret: str | None = None,
    log: Path | None = None,
) -> subprocess.Popen:
    """``phalanx worker`` as torchrun starts it; ``secret``: its PHALANX_SECRET (default: ours);
    ``log``: where its output goes (default: ours)."""
    env = dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
    )
    env.pop("PHALANX_TEST_FAULT", None)
    if secret is not None:
        env["PHALANX_SECRET"] = secret
    command = [
        sys.executable,
        "-m",
        "phalanx.tools",
        "worker",
        "--model",
        str(model_dir),
        "--coordinator",
        coordinator,
    ]
    command += ["--device", "cpu", "--kv-pages", "32", "--page-size", "4", "--max-slots", "4"]
    command += ["--max-batch-tokens", "128", "--heartbeat-interval", "0.3", "--log-level", "warning"]
    out = None if log is None else log.open("w")
    try:
        return subprocess.Popen([*command, *extra], env=env, cwd=REPO, stdout=out, stderr=out)
    finally:
        if out is not None:
            out.close()


def alive(pid: int) -> bool:
    """Whether a process with this pid still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def small_config(model_dir: Path, tp: int, **overrides) -> ExecutorConfig:
    options = dict(
        model_dir=str(model_dir),
        tp=tp,
        max_slots=4,
        kv_pages=32,
        page_size=PAGE,
        max_batch_tokens=128,
        step_timeout=60.0,
        startup_timeout=90.0,
        dist_init_timeout=60.0,
        log_level="warning",
    )
    options.update(overrides)
    return ExecutorConfig(**options)


def pages_of(request_index: int) -> list[int]:
    base = request_index * PAGES_PER_REQUEST
    return list(range(base, base + PAGES_PER_REQUEST))


def chunk(request_id: int, index: int, tokens: list[int], start: int, last: bool) -> PrefillChunk:
    return PrefillChunk(request_id, pack_ids(tokens), start, pack_ids(pages_of(index)), last, LOGPROBS)


def row(request_id: int, index: int, slot: int, token: int, position: int) -> DecodeRow:
    return DecodeRow(request_id, slot, token, position, pack_ids(pages_of(index)), LOGPROBS)


def reference_generation(model_dir: Path, prompt: list[int], steps: int) -> list[TokenResult]:
    """Greedy generation of one request alone, in process, at TP 1."""
    from phalanx.models.qwen35 import DecodeBatch, PrefillBatch, Qwen35Model
    from phalanx.worker.sampling import draw_tokens

    model = Qwen35Model.load(model_dir, rank=0, world_size=1, device=torch.device("cpu"))
    model.allocate_cache(PAGES_PER_REQUEST + 1, PAGE, 1)
    pages = list(range(PAGES_PER_REQUEST))
    logits = model.prefill(PrefillBatch.build([(prompt, 0, 0, pages)]))
    position = len(prompt)
    results = []
    for _ in range(steps):
        (drawn,) = draw_tokens(logits, [LOGPROBS], [position]).to_host()
        results.append(TokenResult(0, *drawn))
        logits = model.decode(DecodeBatch.build([(drawn.token, position, 0, pages)]))
        position += 1
    return results
