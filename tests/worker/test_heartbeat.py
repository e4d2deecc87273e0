"""A rank's heartbeat thread leaves the process when its coordinator is gone, including a
coordinator that was gone before the heartbeat socket ever connected, and stays while one listens.
Each rank here is a subprocess: leaving is ``os._exit``."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import zmq

from phalanx.worker.heartbeat import EXIT_ORPHANED

REPO = Path(__file__).resolve().parents[2]
RANK = """
import sys, time
from phalanx.worker.heartbeat import HeartbeatThread
thread = HeartbeatThread(sys.argv[1], b"rank-0/heartbeat", {}, rank=0, epoch=1, interval_s=0.05, coordinator_grace_s=float(sys.argv[2]))
thread.start()
time.sleep(float(sys.argv[3]))
print("still here", flush=True)
"""


def _rank(address: str, grace_s: float, lives_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", RANK, address, str(grace_s), str(lives_s)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, time.monotonic() - started


def test_a_rank_whose_coordinator_was_gone_before_its_heartbeat_connected_leaves() -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done, took = _rank(f"tcp://127.0.0.1:{port}", grace_s=0.5, lives_s=20)
    assert done.returncode == EXIT_ORPHANED, (done.returncode, done.stdout, done.stderr)
    assert "still here" not in done.stdout
    assert "coordinator unreachable; exiting" in done.stderr + done.stdout
    assert took < 15, f"the rank lingered {took:.1f} s"


def test_a_rank_whose_coordinator_listens_stays() -> None:
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        done, _ = _rank(f"tcp://127.0.0.1:{port}", grace_s=0.5, lives_s=2)
    finally:
        router.close(linger=0)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert "still here" in done.stdout
