"""The TCP control plane is encrypted (ZeroMQ CURVE, keys derived from PHALANX_SECRET): a rank
that holds the secret serves, a prompt's token ids never cross the wire in the clear, and a peer
that connects without CURVE gets nothing while none of its frames arrive."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from phalanx.executor.launcher import launch_executor
from phalanx.protocol import PROTOCOL_VERSION, encode
from phalanx.protocol.auth import key_from_secret, rank_authenticator
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import Ack, Ping, Prefill, ReplyEnvelope
from tests.support.runtime_helpers import chunk, free_port, small_config, start_attached_rank

SECRET = "curve-test-shared-secret-value"
PROMPT = [401, 313, 509, 211, 499, 307]  # their packed bytes are what a sniffer would look for


class Tap:
    """A TCP relay between a rank and the coordinator that keeps every byte it forwards."""

    def __init__(self, upstream_port: int) -> None:
        self.captured = bytearray()
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        peer_of: dict[socket.socket, socket.socket] = {}
        while not self._stop.is_set():
            for key, _mask in selector.select(0.1):
                sock = key.fileobj
                if sock is self._listener:
                    near, _ = self._listener.accept()
                    far = socket.create_connection(self._upstream)
                    peer_of.update({near: far, far: near})
                    selector.register(near, selectors.EVENT_READ)
                    selector.register(far, selectors.EVENT_READ)
                elif sock in peer_of:  # not closed with its pair earlier in this round
                    self._forward(sock, peer_of, selector)

    def _forward(
        self,
        sock: socket.socket,
        peer_of: dict[socket.socket, socket.socket],
        selector: selectors.BaseSelector,
    ) -> None:
        try:
            data = sock.recv(1 << 16)
            if data:
                self.captured += data
                peer_of[sock].sendall(data)
                return
        except OSError:
            pass
        other = peer_of.pop(sock)  # one side closed (or failed): close the pair
        del peer_of[other]
        for end in (sock, other):
            selector.unregister(end)
            end.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


def test_an_encrypted_replica_serves_and_a_peer_without_curve_gets_nothing(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_SECRET", SECRET)
    port = free_port()
    tap = Tap(port)
    rank = start_attached_rank(0, tiny_model_dir, f"tcp://127.0.0.1:{tap.port}", free_port(), 1)
    plain = zmq.Context.instance().socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    ex = None
    try:
        ex = launch_executor(small_config(tiny_model_dir, 1, transport="tcp", attach=True, port=port))
        (first,) = ex.call(Prefill([chunk(1, 0, PROMPT, 0, True)])).results
        assert first.token >= 0 and ex.poison_reason is None
        assert len(tap.captured) > 1000  # the startup and the prefill went through the tap ...
        assert pack_ids(PROMPT) not in tap.captured  # ... but not the prompt in the clear
        assert b"prefill" not in tap.captured and b"ready" not in tap.captured

        # A peer that holds the secret (it signs) but speaks no CURVE: nothing reaches either side.
        signer = rank_authenticator(key_from_secret(SECRET.encode()), 0)
        plain.connect(ex.address)
        before = ex.rejected_frames
        for _ in range(5):
            plain.send(signer.sign(encode(ReplyEnvelope(PROTOCOL_VERSION, ex.epoch, 0, 2, Ack()))))
        deadline = time.monotonic() + 10
        while ex.rejected_frames == before:  # each failed handshake is counted
            assert time.monotonic() < deadline
            ex.call(Ping())
        assert ex._link.rejections.by_reason.keys() == {"unauthenticated"}  # no frame got in
        assert not plain.poll(500)
        ex.call(Ping())
        assert ex.poison_reason is None
    finally:
        plain.close()
        if ex is not None:
            ex.shutdown()
        if rank.poll() is None:
            rank.kill()
        rank.wait(10)
        tap.close()
