"""Sockets and addresses: ipc in a private directory, tcp on a chosen interface, framing seam."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.protocol import ProtocolError
from phalanx.protocol.transport import (
    CoordinatorSocket,
    Framer,
    RankSocket,
    RuntimeDir,
    sweep_dead_runtime_dirs,
    tcp_address,
)


def _round_trip(address: str, framer: Framer | None = None) -> str:
    """Bind at ``address``, exchange one frame each way; returns the bound address."""
    coordinator = CoordinatorSocket(address, framer)
    rank = RankSocket(coordinator.address, b"rank-0", framer)
    try:
        rank.send(b"hello")
        received = coordinator.recv(5.0)
        assert received == (b"rank-0", b"hello")
        coordinator.send(b"rank-0", b"world")
        assert rank.recv(5.0) == b"world"
        assert rank.recv(0.05) is None
        return coordinator.address
    finally:
        rank.close(linger_ms=0)
        coordinator.close()


def test_ipc_in_private_directory_removed_on_exit() -> None:
    runtime = RuntimeDir()
    mode = stat.S_IMODE(os.stat(runtime.path).st_mode)
    assert mode == 0o700
    _round_trip(runtime.ipc_address())
    runtime.remove()
    assert not os.path.exists(runtime.path)


def test_tcp_binds_a_free_port_on_the_given_interface() -> None:
    address = _round_trip(tcp_address("127.0.0.1", 0))
    assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")


class _Tagged(Framer):
    """A framer that adds a marker frame, standing in for an authenticating one."""

    def seal(self, payload: bytes) -> list[bytes]:
        return [b"tag", payload]

    def open(self, frames: list[bytes], peer: bytes = b"") -> bytes:
        if frames[:1] != [b"tag"]:
            raise ProtocolError(ProtocolError.UNAUTHENTICATED, "missing tag")
        return frames[1]


def test_every_frame_passes_through_the_framer() -> None:
    runtime = RuntimeDir()
    _round_trip(runtime.ipc_address(), _Tagged())
    coordinator = CoordinatorSocket(runtime.ipc_address("other"), _Tagged())
    plain = RankSocket(coordinator.address, b"rank-1")
    try:
        plain.send(b"untagged")
        assert coordinator.socket.poll(5000)
        with pytest.raises(ProtocolError, match="missing tag"):
            coordinator.recv_ready()
    finally:
        plain.close(linger_ms=0)
        coordinator.close()
        runtime.remove()


def test_runtime_dirs_of_dead_owners_are_swept(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for name, pid in [("phalanx-dead", gone.pid), ("phalanx-live", os.getpid()), ("other-dead", gone.pid)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "owner.pid").write_text(str(pid))
        (tmp_path / name / "control.sock").write_text("")
    (tmp_path / "phalanx-unowned").mkdir()  # an older layout, or not ours: left alone
    assert sweep_dead_runtime_dirs(str(tmp_path)) == [str(tmp_path / "phalanx-dead")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-dead", "phalanx-live", "phalanx-unowned"]
