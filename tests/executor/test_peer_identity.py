"""Ranks are known by their signed handshake, not by the identity their socket claims: over the
attach port (TCP, ranks started as torchrun starts them) a peer that connects as ``rank-1`` gets
no command, a hello replayed from an earlier launch is refused, a second claim of a bound rank is
refused and logged once, and a rank with another secret fails on both sides within seconds."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zmq

from phalanx.executor.errors import ExecutorPoisoned, StartupError
from phalanx.executor.launcher import launch_executor
from phalanx.executor.runtime import Executor
from phalanx.protocol import PROTOCOL_VERSION, ProtocolError, decode_envelope, encode
from phalanx.protocol.auth import key_from_secret, rank_authenticator, rank_curve_options
from phalanx.protocol.messages import Capacity, Decode, Heartbeat, Hello, Ping, Prefill, Ready, ReplyEnvelope
from tests.support.runtime_helpers import chunk, free_port, row, small_config, start_attached_rank

SECRET = "peer-identity-test-shared-secret"
PROMPT = [9, 99, 199, 299]


def _rank(rank: int, model_dir: Path, address: str, master_port: int, log: Path) -> subprocess.Popen:
    extra = ("--log-level", "info", "--log-format", "json")
    return start_attached_rank(rank, model_dir, address, master_port, 2, *extra, log=log)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def _curve_peer(address: str, identity: bytes) -> zmq.Socket:
    """A DEALER that holds the shared secret, so it completes the encrypted (CURVE) handshake."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    for option, value in rank_curve_options(key_from_secret(SECRET.encode())).items():
        sock.setsockopt(option, value)
    sock.connect(address)
    return sock


def _intruder(address: str) -> zmq.Socket:
    """A peer that claims rank 1's old, fixed socket identity and replays the handshake rank 1
    sent in an earlier launch (same shared secret, so it completes the encrypted handshake; that
    launch's epoch and challenge)."""
    sock = _curve_peer(address, b"rank-1")
    earlier = rank_authenticator(key_from_secret(SECRET.encode()), 1)
    ready = Ready(Capacity(32, 4, 4, 128), "cpu", 1, "elsewhere", nonce=b"an earlier launch")
    sock.send(earlier.sign(encode(ReplyEnvelope(PROTOCOL_VERSION, 0, 1, 0, Hello()))))
    sock.send(earlier.sign(encode(ReplyEnvelope(PROTOCOL_VERSION, 12345, 1, 0, ready))))
    sock.send(earlier.sign(encode(ReplyEnvelope(PROTOCOL_VERSION, 0, 1, 0, ready))))
    return sock


def _received(sock: zmq.Socket) -> list[str]:
    """What the intruder was sent, by message name (it holds the secret's key to read it)."""
    reader = rank_authenticator(key_from_secret(SECRET.encode()), 1)
    names = []
    while sock.poll(200):
        envelope = decode_envelope(reader.verify(sock.recv()))
        names.append(type(envelope.body).__name__)
    return names


def _wait_logged(log: Path, event: str) -> None:
    deadline = time.monotonic() + 60
    while f'"event":"{event}"' not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def test_an_intruder_gets_no_command_and_a_second_claim_is_refused(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PHALANX_SECRET", SECRET)
    port, master_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    config = small_config(tiny_model_dir, 2, transport="tcp", attach=True, port=port)
    launched: list[Executor] = []
    coordinator = threading.Thread(target=lambda: launched.append(launch_executor(config)), daemon=True)
    coordinator.start()
    intruder = _intruder(address)
    # rank 1 started twice (a launch line run twice): the first Ready binds, the second is refused
    logs = [tmp_path / "rank1.log", tmp_path / "rank1-again.log"]
    ranks = [_rank(1, tiny_model_dir, address, master_port, log) for log in logs]
    try:
        for log in logs:
            _wait_logged(log, "ready")
        ranks.append(_rank(0, tiny_model_dir, address, master_port, tmp_path / "rank0.log"))
        coordinator.join(60)
        (ex,) = launched
        try:
            (first,) = ex.call(Prefill([chunk(1, 0, PROMPT, 0, True)])).results
            ex.call(Decode([row(1, 0, 0, first.token, len(PROMPT))]))
            assert ex.poison_reason is None
            assert _received(intruder) == ["Challenge"]  # its hello's answer, and nothing after it
        finally:
            ex.shutdown()
    finally:
        intruder.close()
        _stop(ranks)
    log = capfd.readouterr().err
    assert "reply has epoch 12345" in log  # the Ready of an earlier launch
    assert log.count("ready refused: it does not answer this connection's challenge (a replayed hello)") == 1
    assert log.count("a second claim of a bound rank refused") == 1, log[-3000:]


def test_a_wrong_secret_fails_on_both_sides_within_seconds(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_SECRET", SECRET)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    rank_log = tmp_path / "rank0.log"
    rank = start_attached_rank(
        0, tiny_model_dir, address, free_port(), 1, secret="another-secret-of-16-bytes", log=rank_log
    )
    started = time.monotonic()
    try:
        with pytest.raises(StartupError) as failed:
            launch_executor(small_config(tiny_model_dir, 1, transport="tcp", attach=True, port=port))
        assert time.monotonic() - started < 10
        assert "PHALANX_SECRET differs between the coordinator and that rank" in str(failed.value)
        assert rank.wait(10) == 1
        assert time.monotonic() - started < 10
    finally:
        _stop([rank])
    said = rank_log.read_text()
    assert "PHALANX_SECRET differs between the coordinator and this rank" in said, said[-3000:]


def test_a_replayed_frame_on_its_own_connection_keeps_the_genuine_counters() -> None:
    from phalanx.protocol.auth import COORDINATOR, FrameAuthenticator, new_key

    key = new_key()
    coordinator = FrameAuthenticator(key, COORDINATOR, accept=[0])
    frame = rank_authenticator(key, 0).sign(b"hello")
    assert coordinator.verify(frame, peer=b"intruder") == b"hello"
    assert coordinator.verify(frame, peer=b"rank") == b"hello"  # the genuine rank is not locked out
    with pytest.raises(ProtocolError, match="already accepted"):
        coordinator.verify(frame, peer=b"rank")


def _forge_heartbeats(address: str, rank: int, epoch: int, stop: threading.Event) -> None:
    """Beat for ``rank`` every 0.1 s from a connection of our own, signed with the shared secret."""
    forger = _curve_peer(address, b"forger")
    signer = rank_authenticator(key_from_secret(SECRET.encode()), rank)
    while not stop.wait(0.1):
        forger.send(signer.sign(encode(ReplyEnvelope(PROTOCOL_VERSION, epoch, rank, 0, Heartbeat(0.0)))))
    forger.close()


def test_forged_heartbeats_do_not_keep_a_stopped_rank_alive(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer holding the secret beats for rank 1 from its own connection while rank 1 is
    stopped: the replica is poisoned naming rank 1 all the same, the forged beats are counted,
    and rank 0's genuine heartbeats kept it alive through the idle seconds before."""
    monkeypatch.setenv("PHALANX_SECRET", SECRET)
    port, master_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    ranks = [start_attached_rank(rank, tiny_model_dir, address, master_port) for rank in range(2)]
    stop_forging = threading.Event()
    ex = None
    try:
        ex = launch_executor(small_config(tiny_model_dir, 2, transport="tcp", attach=True, port=port))
        forging = threading.Thread(target=_forge_heartbeats, args=(address, 1, ex.epoch, stop_forging))
        forging.start()
        time.sleep(3.0)  # longer than the heartbeat timeout: only genuine heartbeats carry it
        ex.call(Ping())
        ranks[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(ExecutorPoisoned, match="rank 1 sent no heartbeat"):
            while True:  # an idle executor notices at its next call
                ex.call(Ping())
                time.sleep(0.1)
        assert time.monotonic() - stopped_at < 5.0
        assert ex.rejected_frames > 0
    finally:
        stop_forging.set()
        if ex is not None:
            ex.shutdown()
        ranks[1].send_signal(signal.SIGCONT)
        _stop(ranks)
