"""A hung rank is named within the step timeout: collectives time out before the step does, so
the rank left waiting for the hung one fails in time, and the coordinator poisons the replica
(``/health`` 503) with the name of the rank that did not answer, not of the one that waited."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests.support.live_server import InFlight, rank_pids, serve_process


def test_a_stopped_rank_is_named_within_the_step_timeout(tiny_model_dir: Path, tmp_path: Path) -> None:
    hung = 1  # rank 0 waits for it in a collective, times out, and must not be taken for the culprit
    args = ["--model", str(tiny_model_dir), "--tp", "2", "--kv-pages", "128", "--step-timeout", "8"]
    with serve_process(args, tmp_path / "serve.log") as served:
        request = InFlight(served.url, stream=True)
        assert request.first_token.wait(30)
        os.kill(rank_pids(served.process.pid)[hung], signal.SIGSTOP)
        stopped = time.monotonic()
        while (health := httpx.get(served.url + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() - stopped < 15, "the hang was not noticed within the step timeout"
            time.sleep(0.1)
        took = time.monotonic() - stopped
        assert health.status_code == 503
        reason = health.json()["reason"]
        assert f"ranks [{hung}] did not answer (rank {1 - hung} timed out waiting for them" in reason
        assert took < 8.0, f"named after {took:.1f} s"  # within the step timeout
        assert request.ended.wait(10)
        assert request.lines[-1] == "data: [DONE]" and f"ranks [{hung}] did not answer" in request.lines[-2]
