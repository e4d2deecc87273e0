"""``phalanx serve`` stops in order on Ctrl-C (SIGINT to its whole process group, as a terminal
sends it) and on SIGTERM to the server alone (as a service manager sends it): Shutdown reaches
every rank, the replica is shut down, and the server exits 0 without a traceback. ``phalanx
generate`` interrupted mid-generation does the same and exits 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_server import REPO, serve_process


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_serve_shuts_the_replica_down_in_order_when_stopped(
    tiny_model_dir: Path, tmp_path: Path, stop: str
) -> None:
    log_path = tmp_path / "serve.log"
    args = ["--model", str(tiny_model_dir), "--tp", "2", "--kv-pages", "64"]
    with serve_process(args, log_path, new_session=True) as served:
        if stop == "SIGINT":  # the server and both ranks receive it
            os.killpg(served.process.pid, signal.SIGINT)
        else:
            served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60) == 0
    log = log_path.read_text()
    assert f"phalanx serve: stopped by {stop}; shutting the replica down" in log
    assert log.count("event='shutdown'") == 2, log[-3000:]  # each rank answered Shutdown
    assert "event='executor shut down'" in log
    assert "Traceback" not in log and "poisoned" not in log, log[-3000:]


def test_generate_interrupted_shuts_the_replica_down_and_exits_130(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "generate.log"
    argv = [sys.executable, "-m", "tools", "generate", "--model", str(tiny_model_dir), "--tp", "2"]
    argv += ["--prompt-ids", "1,2,3", "--max-tokens", "2000", "--ignore-eos"]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while "event='executor serving'" not in log_path.read_text():  # generating now
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(60) == 130
    text = log_path.read_text()
    assert "phalanx generate: interrupted" in text
    assert text.count("event='shutdown'") == 2 and "event='executor shut down'" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
