"""A replica whose ranks were spawned on this host listens on loopback alone: its rendezvous is a
file in the private runtime directory, not rank 0's TCPStore (which listens on every interface)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from live_server import rank_pids, serve_process

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


def test_a_local_replica_listens_on_loopback_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_model_dir), "--tp", "2", "--kv-pages", "64"]
    with serve_process(args, tmp_path / "serve.log") as served:
        pids = [served.process.pid, *rank_pids(served.process.pid)]
        assert len(pids) == 3
        listening = _listening(pids)
    assert len(listening) >= 1  # the HTTP port at least
    assert all(_loopback(address) for address in listening), listening
