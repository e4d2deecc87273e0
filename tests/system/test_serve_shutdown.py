"""``phalanx serve`` stopped with requests in flight: every open stream gets an error event and
``[DONE]``, a non-streaming request an OpenAI-shaped 503, and the server exits 0 within seconds
without a traceback. With its ranks hung it kills them after ``--shutdown-grace`` and exits 1,
naming them. A coordinator killed outright leaves no ipc socket behind."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from phalanx.protocol.transport import RuntimeDir
from tests.support.live_server import InFlight, rank_pids, serve_process, wait_for_metric


def _args(model_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--tp", "2", "--kv-pages", "128", "--log-format", "json", *extra]


@pytest.mark.parametrize(("stop", "stream"), [("SIGINT", True), ("SIGTERM", False)])
def test_a_stop_ends_every_open_request_at_once(
    tiny_model_dir: Path, tmp_path: Path, stop: str, stream: bool
) -> None:
    log_path = tmp_path / "serve.log"
    with serve_process(_args(tiny_model_dir), log_path, new_session=True) as served:
        request = InFlight(served.url, stream)
        if stream:
            assert request.first_token.wait(30)
        else:
            wait_for_metric(served.url, "phalanx_requests_running", 1.0)
        sent = time.monotonic()
        os.killpg(served.process.pid, signal.Signals[stop])  # as a terminal or systemd sends it
        assert served.process.wait(30) == 0
        took = time.monotonic() - sent
        assert request.ended.wait(10)
    reason = f"the server is shutting down ({stop})"
    if stream:
        assert request.lines[-1] == "data: [DONE]", request.lines[-3:]
        assert json.loads(request.lines[-2].removeprefix("data: ")) == {
            "error": {"message": reason, "type": "server_error", "param": None, "code": None}
        }
    else:
        assert request.status == 503
        assert json.loads(request.lines[0])["error"]["message"] == reason
    log = log_path.read_text()
    assert "Traceback" not in log and "poisoned" not in log, log[-3000:]
    assert log.count('"event":"shutdown"') == 2, log[-3000:]  # every rank stopped in order
    assert took < 5.0, f"the stop took {took:.1f} s"


def test_a_stop_with_hung_ranks_kills_them_after_the_grace(tiny_model_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with serve_process(_args(tiny_model_dir, "--shutdown-grace", "2"), log_path) as served:
        request = InFlight(served.url, stream=True)
        assert request.first_token.wait(30)
        ranks = rank_pids(served.process.pid)
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        sent = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(30) == 1
        took = time.monotonic() - sent
    assert request.lines[-1] == "data: [DONE]"
    log = log_path.read_text()
    said = re.search(r"the shutdown grace of 2 s ran out while (\w+) waited for ranks \[0, 1\]", log)
    assert said is not None, log[-3000:]
    assert "phalanx serve: the replica did not shut down cleanly" in log
    assert "Traceback" not in log, log[-3000:]
    assert took < 10.0, f"the stop took {took:.1f} s"


def test_a_killed_coordinator_leaves_no_ipc_socket(tiny_model_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with serve_process(_args(tiny_model_dir), log_path) as served:
        found = re.search(r'"address":"ipc://([^"]+)"', log_path.read_text())
        assert found is not None
        socket_path = Path(found.group(1))
        assert socket_path.exists()
        served.process.kill()
        served.process.wait()
        deadline = time.monotonic() + 10
        while socket_path.parent.exists():  # the orphaned ranks remove it
            assert time.monotonic() < deadline, f"{socket_path} is still there"
            time.sleep(0.1)


def test_the_next_start_sweeps_what_a_killed_replica_left(tiny_model_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    with serve_process(_args(tiny_model_dir), log_path, new_session=True) as served:
        socket_path = Path(re.search(r'"address":"ipc://([^"]+)"', log_path.read_text()).group(1))
        os.killpg(served.process.pid, signal.SIGKILL)  # coordinator and ranks alike: nobody cleans up
        served.process.wait()
    time.sleep(0.5)
    assert socket_path.exists()
    RuntimeDir().remove()  # what the next launch does first
    assert not socket_path.parent.exists()
