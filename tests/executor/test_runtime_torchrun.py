"""Ranks started separately, as torchrun would start them (``phalanx worker`` with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), join a coordinator over TCP and serve; a
rank that dies is noticed through its missing heartbeats, and the survivor is told to leave."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.executor.errors import ExecutorPoisoned
from phalanx.executor.launcher import launch_executor
from phalanx.protocol.messages import Decode, DropRequest, Expectation, Ping, Prefill
from tests.support.runtime_helpers import (
    chunk,
    free_port,
    rank_pids,
    reference_generation,
    row,
    small_config,
    start_attached_rank,
)

REPO = Path(__file__).resolve().parents[2]
PROMPT = [9, 99, 199, 299]


def test_torchrun_style_ranks_join_over_tcp_and_serve(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_SECRET", "torchrun-test-shared-secret")  # tcp frames are authenticated
    port = free_port()
    coordinator = f"tcp://127.0.0.1:{port}"
    master_port = free_port()
    ranks = [start_attached_rank(rank, tiny_model_dir, coordinator, master_port) for rank in range(2)]
    ex = None
    try:
        ex = launch_executor(small_config(tiny_model_dir, 2, transport="tcp", attach=True, port=port))
        assert rank_pids(ex) == [None, None]  # not ours to kill: watched through heartbeats
        want = reference_generation(tiny_model_dir, PROMPT, 2)
        (first,) = ex.call(Prefill([chunk(1, 0, PROMPT, 0, True)])).results
        (second,) = ex.call(Decode([row(1, 0, 0, first.token, len(PROMPT))])).results
        assert [first.token, second.token] == [r.token for r in want]
        assert second.logprob == pytest.approx(want[1].logprob, abs=1e-4)
        ex.call(DropRequest(1, Expectation.MUST_EXIST))

        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].wait(10)
        killed_at = time.monotonic()
        with pytest.raises(ExecutorPoisoned, match="rank 1"):
            while True:  # an idle executor notices at its next call
                ex.call(Ping())
                time.sleep(0.1)
        assert time.monotonic() - killed_at < 2.5
        # The survivor was told to leave (Cancel) and exits non-zero on its own.
        assert ranks[0].wait(10) == 3
    finally:
        if ex is not None:
            ex.shutdown()
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(10)


COORDINATOR = """
import sys, time
from phalanx.executor.launcher import launch_executor
from tests.support.runtime_helpers import small_config
launch_executor(small_config(sys.argv[1], 1, transport="tcp", attach=True, port=int(sys.argv[2])))
print("serving", flush=True)
time.sleep(600)
"""


def test_attached_rank_leaves_when_its_coordinator_dies(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_SECRET", "torchrun-test-shared-secret")
    port = free_port()
    rank = start_attached_rank(
        0, tiny_model_dir, f"tcp://127.0.0.1:{port}", free_port(), 1, "--coordinator-grace", "1"
    )
    coordinator = subprocess.Popen(
        [sys.executable, "-c", COORDINATOR, str(tiny_model_dir), str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert coordinator.stdout is not None
        assert coordinator.stdout.readline().strip() == "serving"
        coordinator.kill()
        coordinator.wait(10)
        killed_at = time.monotonic()
        assert rank.wait(15) == 4  # EXIT_ORPHANED: it did not linger waiting for commands
        assert time.monotonic() - killed_at < 5.0
    finally:
        for process in (coordinator, rank):
            if process.poll() is None:
                process.kill()
                process.wait(10)


def test_generate_attach_serves_through_ranks_started_elsewhere(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`phalanx generate --attach` spawns nothing: the torchrun-started ranks do the work, and the
    tokens equal the in-process reference."""
    monkeypatch.setenv("PHALANX_SECRET", "torchrun-test-shared-secret")
    port, master_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    ranks = [start_attached_rank(rank, tiny_model_dir, address, master_port) for rank in range(2)]
    try:
        command = [sys.executable, "-m", "phalanx.tools", "generate", "--model", str(tiny_model_dir)]
        command += ["--tp", "2", "--attach", address, "--prompt-ids", ",".join(map(str, PROMPT))]
        command += ["--max-tokens", "3", "--ignore-eos", "--json"]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        want = [r.token for r in reference_generation(tiny_model_dir, PROMPT, 3)]
        assert json.loads(done.stdout.strip().splitlines()[-1])["token_ids"] == want
        assert [rank.wait(15) for rank in ranks] == [0, 0]  # shut down by the coordinator
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(10)
