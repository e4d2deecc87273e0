"""``phalanx serve`` stops in order on Ctrl-C (SIGINT to its whole process group, as a terminal
sends it) and on SIGTERM, to the server alone or to every process of it (as a service manager
sends it): Shutdown reaches every rank, the replica is shut down, and the server exits 0 without a
traceback. ``phalanx generate`` interrupted mid-generation does the same and exits 130 (SIGINT)
or 143 (SIGTERM). A spawned rank outlives a SIGTERM by a grace period, then leaves on its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.live_server import REPO, serve_process


@pytest.mark.parametrize(("stop", "to_group"), [("SIGINT", True), ("SIGTERM", False), ("SIGTERM", True)])
def test_serve_shuts_the_replica_down_in_order_when_stopped(
    tiny_model_dir: Path, tmp_path: Path, stop: str, to_group: bool
) -> None:
    log_path = tmp_path / "serve.log"
    args = ["--model", str(tiny_model_dir), "--tp", "2", "--kv-pages", "64", "--log-format", "json"]
    with serve_process(args, log_path, new_session=True) as served:
        # A request served first: the stop then finds connections and a scheduler that has run.
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
        assert httpx.post(served.url + "/v1/completions", json=body, timeout=60).status_code == 200
        if to_group:  # the server and both ranks receive it (a terminal, systemd's default)
            os.killpg(served.process.pid, signal.Signals[stop])
        else:
            served.process.send_signal(signal.Signals[stop])
        assert served.process.wait(60) == 0
    log = log_path.read_text()
    assert f"phalanx serve: stopped by {stop}; shutting the replica down" in log
    if stop == "SIGTERM" and to_group:  # each rank waited for the coordinator's Shutdown
        warned = [line for line in log.splitlines() if "SIGTERM: leaving unless the coordinator" in line]
        assert sorted(json.loads(line)["rank"] for line in warned) == [0, 1], log[-3000:]
    assert log.count('"event":"shutdown"') == 2, log[-3000:]  # each rank answered Shutdown
    assert '"event":"executor shut down"' in log
    assert "Traceback" not in log and "poisoned" not in log, log[-3000:]


def _stop_generate_at(model_dir: Path, log_path: Path, event: str, max_tokens: int, stop: str) -> str:
    """Runs ``phalanx generate`` at TP 2 in a session of its own, sends ``stop`` to the whole
    session once ``event`` is logged, and returns the log once it has exited with the shell's
    code for the signal (130 or 143)."""
    argv = [sys.executable, "-m", "phalanx.tools", "generate", "--model", str(model_dir), "--tp", "2"]
    argv += ["--prompt-ids", "1,2,3", "--max-tokens", str(max_tokens), "--ignore-eos"]
    argv += ["--verbose", "--log-format", "json"]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while f'"event":"{event}"' not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.01)
        os.killpg(process.pid, signal.Signals[stop])
        assert process.wait(60) == {"SIGINT": 130, "SIGTERM": 143}[stop]
    deadline = time.monotonic() + 10
    while True:  # no rank outlives its coordinator's stop
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a rank was still running 10 s after generate exited"
        time.sleep(0.05)
    text = log_path.read_text()
    said = "phalanx generate: interrupted" if stop == "SIGINT" else "phalanx generate: stopped by SIGTERM"
    assert said in text and "Traceback" not in text, text[-3000:]
    return text


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_generate_stopped_shuts_the_replica_down(tiny_model_dir: Path, tmp_path: Path, stop: str) -> None:
    text = _stop_generate_at(tiny_model_dir, tmp_path / "generate.log", "executor serving", 2000, stop)
    assert text.count('"event":"shutdown"') == 2 and '"event":"executor shut down"' in text, text[-3000:]


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_generate_stopped_during_startup_stops_its_ranks(
    tiny_model_dir: Path, tmp_path: Path, stop: str
) -> None:
    # A rank has loaded its weights; the startup gate is not open yet.
    text = _stop_generate_at(tiny_model_dir, tmp_path / "generate.log", "model loaded", 4, stop)
    assert '"event":"startup stopped"' in text and "startup failed" not in text, text[-3000:]


_RANK_STUCK_IN_A_CALL = """
import os, sys
from phalanx.worker.entry import _leave_after_sigterm
_leave_after_sigterm(float(sys.argv[1]))
print("ready", flush=True)
read_fd, _ = os.pipe()
os.read(read_fd, 1)  # blocks for good: the main thread never finishes this call
"""


def test_a_rank_stuck_in_a_call_still_leaves_after_the_sigterm_grace() -> None:
    grace_s = 1.5
    process = subprocess.Popen(
        [sys.executable, "-c", _RANK_STUCK_IN_A_CALL, str(grace_s)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.5)
        assert process.poll() is None  # the grace: the coordinator may still stop it in order
        assert process.wait(20) == 128 + signal.SIGTERM
        assert time.monotonic() - sent >= grace_s - 0.1
        said = process.stdout.read() + process.stderr.read()  # unconfigured structlog prints to stdout
        assert "SIGTERM: leaving unless the coordinator stops this rank first" in said, said
    finally:
        process.kill()
        process.wait()


_LEAVES_WITHOUT_SHUTDOWN = """
import sys
from phalanx.engine.engine import Engine, EngineConfig
config = EngineConfig(model_dir=sys.argv[1], tp=2, kv_pages=64, log_format="json")
engine = Engine.start(config)
print("started", flush=True)
sys.exit(0)  # no shutdown: as when a signal lands before the caller's ``with`` takes the engine
"""


def test_an_engine_left_without_shutdown_is_shut_down_at_exit(tiny_model_dir: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _LEAVES_WITHOUT_SHUTDOWN, str(tiny_model_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0 and "started" in text, text[-3000:]
    assert text.count('"event":"shutdown"') == 2 and '"event":"executor shut down"' in text, text[-3000:]
    assert "SIGTERM: leaving" not in text, text[-3000:]  # nobody waited out the ranks' grace
    assert time.monotonic() - started < 60
