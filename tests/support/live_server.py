"""A real ``phalanx serve`` process on 127.0.0.1 (free port) for the server, eval-mc and bench tests."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
_ADDRESS = re.compile(r"phalanx serving .* on (http://\S+)")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextmanager
def live_server(model_dir: Path, log_path: Path, *extra: str, startup_s: float = 120.0) -> Iterator[str]:
    """Start the server at TP 2 on CPU; yield its base URL (no /v1); stop it afterwards."""
    argv = [
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--tp",
        "2",
        "--served-model-name",
        MODEL_NAME,
        *extra,
    ]
    with serve_process([*argv, "--max-slots", "8", "--kv-pages", "128"], log_path, startup_s) as served:
        yield served.url


@dataclass
class Served:
    url: str  # the base URL (no /v1)
    printed: list[str]  # the lines the server printed so far
    process: subprocess.Popen[str]


def _terminate_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextmanager
def serve_process(
    args: list[str],
    log_path: Path,
    startup_s: float = 120.0,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> Iterator[Served]:
    """Run ``phalanx serve ARGS --port 0``. ``new_session`` gives the server and its ranks a process
    group of their own, which a test may signal as a terminal's Ctrl-C would. The server is sent
    SIGTERM when the test process dies, so a test run killed from outside (a timeout) leaves no
    server holding the GPU's memory."""
    argv = [sys.executable, "-m", "phalanx.tools", "serve", *args, "--port", "0"]
    log = log_path.open("w")
    process = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        start_new_session=new_session,
        preexec_fn=_terminate_with_parent if sys.platform == "linux" else None,
    )
    found: list[str] = []
    printed: list[str] = []
    ready = threading.Event()

    def read_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            printed.append(line.rstrip("\n"))
            match = _ADDRESS.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    try:
        deadline = time.monotonic() + startup_s
        while not ready.wait(0.2):
            if process.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(
                    f"server did not start (exit {process.poll()}):\n{log_path.read_text()[-4000:]}"
                )
        httpx.get(found[0] + "/health", timeout=10).raise_for_status()
        deadline = time.monotonic() + 5.0  # the curl line follows the address
        while len(printed) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        yield Served(found[0], printed, process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
        log.close()


def metric(base_url: str, name: str) -> float:
    """The value of an unlabelled metric from /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if match is None:
        raise KeyError(f"metric {name} not in /metrics")
    return float(match.group(1))


def wait_for_metric(base_url: str, name: str, value: float, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := metric(base_url, name)) != value:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} stayed {seen}, expected {value} within {timeout_s} s")
        time.sleep(0.05)


LONG_REQUEST = {"prompt": [1, 2, 3], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


class InFlight:
    """One long request on a thread of its own: what came back, and when its first token did."""

    def __init__(self, url: str, stream: bool) -> None:
        self.lines: list[str] = []
        self.status: int | None = None
        self.first_token = threading.Event()
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, stream), daemon=True)
        self._thread.start()

    def _run(self, url: str, stream: bool) -> None:
        try:
            with httpx.stream(
                "POST", url + "/v1/completions", json={**LONG_REQUEST, "stream": stream}, timeout=60
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first_token.set()
        finally:
            self.first_token.set()
            self.ended.set()


def rank_pids(server_pid: int) -> list[int]:
    """The server's spawned ranks, in rank order (read from their process titles)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    ranks = {}
    for pid in children:
        title = re.match(rb"phalanx rank (\d+)/", Path(f"/proc/{pid}/cmdline").read_bytes())
        if title is not None:
            ranks[int(title.group(1))] = int(pid)
    return [ranks[rank] for rank in sorted(ranks)]
