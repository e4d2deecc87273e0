"""The spawn target for ranks the coordinator starts itself. Imports nothing heavy at module level,
so the coordinator can name it without importing torch."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def _exit_when_orphaned(parent_pid: int) -> None:
    """A rank whose coordinator died (even by SIGKILL) must not linger: it exits on its own."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(4)


def _deliver_last_frames(timeout_s: float = 2.0) -> None:
    """Let ZeroMQ send what is queued (a final Failed or Ack) before ``os._exit`` skips it;
    bounded, since a socket left open would make the context wait forever."""
    import zmq

    closer = threading.Thread(target=zmq.Context.instance().term, daemon=True)
    closer.start()
    closer.join(timeout_s)


def spawn_main(config_json: bytes) -> None:
    """Run one rank and leave with its exit code, skipping interpreter teardown: a peer wedged
    in a collective must not be able to hang our exit.

    A spawned rank ignores SIGINT. Ctrl-C in a terminal reaches the whole process group, and the
    coordinator, which owns the ranks' lifecycle, answers it with Shutdown to every rank (or kills
    them); a rank that died of the signal first would turn an orderly stop into a dead-rank failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    from worker.config import decode_config
    from worker.main import run_worker

    code = run_worker(decode_config(config_json))
    _deliver_last_frames()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
