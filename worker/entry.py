"""The spawn target for ranks the coordinator starts itself. Imports nothing heavy at module level,
so the coordinator can name it without importing torch."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time

# How long a spawned rank outlives a SIGTERM, so that its coordinator can still stop it in order.
# It covers the server's drain (5 s for open connections) and its Shutdown to every rank.
SIGTERM_GRACE_S = 10.0


def _exit_when_orphaned(parent_pid: int, coordinator: str) -> None:
    """A rank whose coordinator died (even by SIGKILL) must not linger: it exits on its own, and
    removes the coordinator's private directory (its ipc socket, the rendezvous file), which
    nobody else would."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            runtime_dir = os.path.dirname(coordinator.removeprefix("ipc://"))
            if coordinator.startswith("ipc://") and os.path.basename(runtime_dir).startswith("phalanx-"):
                shutil.rmtree(runtime_dir, ignore_errors=True)  # the other ranks race to do the same
            os._exit(4)


def _leave_after_sigterm(grace_s: float, rank: int | None = None) -> None:
    """On SIGTERM, exit ``grace_s`` later (code 143) unless the rank has left by then.

    A service manager stopping a unit (systemd's default ``KillMode=control-group``) sends SIGTERM
    to every process of it at once. A rank that died of it then would turn the coordinator's
    orderly stop, which the same signal started, into a dead-rank failure. The signal is noticed
    at the C level (``set_wakeup_fd``) by a thread of its own, so the exit does not depend on the
    main thread getting back to Python: a rank stuck in a call still leaves."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)  # the wake-up byte does the work

    def leave() -> None:
        while signal.SIGTERM not in os.read(read_fd, 64):
            pass
        import structlog

        # This thread has no bound log context, so it names the rank itself.
        structlog.get_logger("phalanx.worker").warning(
            "SIGTERM: leaving unless the coordinator stops this rank first",
            rank=rank,
            grace_s=grace_s,
            pid=os.getpid(),
        )
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=leave, name="sigterm-grace", daemon=True).start()


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
    them); a rank that died of the signal first would turn an orderly stop into a dead-rank failure.
    For the same reason it outlives a SIGTERM by ``SIGTERM_GRACE_S``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from phalanx.protocol.launch import decode_config

    config = decode_config(config_json)
    _leave_after_sigterm(SIGTERM_GRACE_S, config.rank)
    orphan_watch = threading.Thread(
        target=_exit_when_orphaned, args=(os.getppid(), config.coordinator), daemon=True
    )
    orphan_watch.start()
    from phalanx.worker.main import run_worker

    code = run_worker(config)
    _deliver_last_frames()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
