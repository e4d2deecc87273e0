"""The control plane of a replica whose ranks were spawned on this host: it listens on loopback
alone (the ranks rendezvous through a file in the private runtime directory, not rank 0's
TCPStore, which listens on every interface), and a flood of forged frames at the coordinator's
control socket is dropped, counted exactly in ``/metrics`` (``phalanx_rejected_frames_total``) and
logged at a bounded rate: ten lines in full, then a summary at most once a second."""

from __future__ import annotations

import ipaddress
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from phalanx.protocol import PROTOCOL_VERSION, encode
from phalanx.protocol.messages import Ack, ReplyEnvelope
from tests.support.live_server import Served, metric, rank_pids, serve_process

FORGED = 10_000


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    log_path = tmp_path_factory.mktemp("control") / "serve.log"
    args = ["--model", str(tiny_model_dir), "--tp", "2", "--kv-pages", "64", "--log-format", "json"]
    with serve_process(args, log_path) as server:
        yield server, log_path


_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # /proc writes 32-bit words
    return ipaddress.IPv6Address(words)


def _listening(pids: list[int]) -> list[str]:
    """Every TCP address the processes listen on, as ``address:port``."""
    inodes = set().union(*(_socket_inodes(pid) for pid in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in inodes:
                host, port = local.split(":")
                found.append(f"{_address(host)}:{int(port, 16)}")
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_a_local_replica_listens_on_loopback_only(served: tuple[Served, Path]) -> None:
    server, _ = served
    pids = [server.process.pid, *rank_pids(server.process.pid)]
    assert len(pids) == 3
    listening = _listening(pids)
    assert len(listening) >= 1  # the HTTP port at least
    assert all(_loopback(address) for address in listening), listening


def test_forged_frames_are_counted_and_logged_at_a_bounded_rate(served: tuple[Served, Path]) -> None:
    server, log_path = served
    address = re.search(r'"address":"(ipc://[^"]+)"', log_path.read_text()).group(1)
    forger = zmq.Context.instance().socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(address)
    answer = encode(ReplyEnvelope(PROTOCOL_VERSION, 1, 0, 1, Ack()))  # rank 0's, from nobody
    for index in range(FORGED):
        forger.send(answer if index % 2 else b"\x00garbage")
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    deadline = time.monotonic() + 60
    while metric(server.url, "phalanx_rejected_frames_total") < FORGED:  # each step reads the socket
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert time.monotonic() < deadline
    assert metric(server.url, "phalanx_rejected_frames_total") == FORGED
    forger.close()  # open until then: a closed peer's unread frames are discarded
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(server.url, "phalanx_engine_poisoned") == 0
    log = log_path.read_text()
    assert log.count('"event":"reply frame rejected"') == 10
    assert 1 <= log.count('"event":"reply frame rejected (summary)"') <= 10, log[-3000:]
