"""One rank's command loop, in process, with the real tiny model and real sockets."""

from __future__ import annotations

import threading

import msgspec

from phalanx.models.qwen35 import Qwen35Model
from phalanx.protocol import PROTOCOL_VERSION, decode_reply, encode
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import (
    FED_TOKEN,
    Ack,
    Decode,
    DecodeDone,
    DropAck,
    DropRequest,
    Envelope,
    Expectation,
    Failed,
    Ping,
    Prefill,
    PrefillDone,
    Refused,
    Shutdown,
    Unified,
    UnifiedDone,
)
from phalanx.protocol.transport import CoordinatorSocket, RankSocket, RuntimeDir
from phalanx.worker.commands import StepRunner
from phalanx.worker.loop import EXIT_OK, EXIT_POISONED, CommandLoop
from phalanx.worker.pending_steps import PendingDecode
from tests.support.step_runner import (
    decode_row,
    prefill_chunk,
    prefilled_runner,
)


class _Coordinator:
    """Real sockets around a CommandLoop running in a thread."""

    def __init__(self, runner: StepRunner, epoch: int = 5) -> None:
        self.runtime = RuntimeDir()
        self.sock = CoordinatorSocket(self.runtime.ipc_address())
        self.rank_sock = RankSocket(self.sock.address, b"rank-0")
        # The coordinator's ROUTER refuses to route to a peer it has not heard from yet (as the
        # launcher's ranks announce themselves with Ready): let the rank speak first.
        self.rank_sock.send(b"hello")
        if self.sock.recv(10.0) is None:
            raise RuntimeError("the rank socket never reached the coordinator socket")
        self.loop = CommandLoop(self.rank_sock, 0, epoch, runner)
        self.epoch = epoch
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        self.exit_code = self.loop.run()

    def send(self, body, seq: int, epoch: int | None = None) -> None:
        self.sock.send(b"rank-0", encode(Envelope(PROTOCOL_VERSION, epoch or self.epoch, seq, body)))

    def reply(self, timeout: float = 10.0):
        received = self.sock.recv(timeout)
        return None if received is None else decode_reply(received[1], epoch=self.epoch)

    def close(self) -> None:
        self.thread.join(10)
        if self.thread.is_alive():  # closing a socket under a running loop would abort libzmq
            raise RuntimeError("the command loop did not exit within 10 s")
        self.rank_sock.close(linger_ms=0)
        self.sock.close()
        self.runtime.remove()


def test_loop_rejects_bad_frames_and_serves(runner: StepRunner) -> None:
    peer = _Coordinator(runner)
    try:
        peer.sock.send(b"rank-0", b"\x00garbage")
        peer.send(Ping(), seq=1, epoch=99)  # foreign epoch
        peer.send(Ping(), seq=2)
        assert peer.reply().body == Ack()
        peer.send(Ping(), seq=2)  # stale seq: dropped, no reply
        assert peer.reply(0.3) is None
        peer.send(Prefill([prefill_chunk(1, [4, 5], 0, [0])]), seq=3)
        done = peer.reply()
        assert done.seq == 3 and isinstance(done.body, PrefillDone)
        peer.send(Decode([decode_row(1, 0, 2, [0], token=done.body.results[0].token)]), seq=4)
        assert isinstance(peer.reply().body, DecodeDone)
        peer.send(DropRequest(1, Expectation.MUST_EXIST), seq=5)
        assert peer.reply().body == DropAck(True)
        peer.send(Shutdown(), seq=6)
        assert peer.reply().body == Ack()
    finally:
        peer.close()
    assert peer.loop.rejected_frames == 3
    assert peer.exit_code == EXIT_OK


def test_a_command_outside_the_wire_limits_is_refused_and_the_rank_serves_on(runner: StepRunner) -> None:
    peer = _Coordinator(runner)
    try:
        # what another encoder could send: top_k 2^40 in a prefill of request 1
        chunk = [1, pack_ids([4, 5]), 0, pack_ids([0]), True, [0.5, 2**40]]
        body = {"op": "prefill", "chunks": [chunk]}
        frame = msgspec.msgpack.encode(
            {"proto": PROTOCOL_VERSION, "epoch": peer.epoch, "seq": 1, "body": body}
        )
        peer.sock.send(b"rank-0", frame)
        refused = peer.reply()
        assert refused.seq == 1 and isinstance(refused.body, Refused)
        assert (
            "command seq 1 not executed: command frame: Expected `int` <= 2147483647" in refused.body.message
        )
        peer.send(Prefill([prefill_chunk(1, [4, 5], 0, [0])]), seq=2)  # nothing of request 1 was staged
        assert isinstance(peer.reply().body, PrefillDone)
        peer.send(Shutdown(), seq=3)
        assert peer.reply().body == Ack()
    finally:
        peer.close()
    assert peer.exit_code == EXIT_OK


def test_state_mismatch_poisons_and_exits(runner: StepRunner) -> None:
    peer = _Coordinator(runner)
    try:
        peer.send(Decode([decode_row(7, 0, 0, [0])]), seq=1)
        reply = peer.reply()
        assert isinstance(reply.body, Failed)
        assert reply.body.kind == "state" and reply.body.phase == "decode"
        assert reply.body.message == "decode request 7 has no worker state"
    finally:
        peer.close()
    assert peer.exit_code == EXIT_POISONED
    assert peer.loop.poison_reason == "decode request 7 has no worker state"


class _HeldStep(PendingDecode):
    """A real decode step whose tokens count as 'not on the host yet' until ``land`` is set."""

    def __init__(
        self, step: PendingDecode, seq: int, log: list[tuple[str, int]], land: threading.Event
    ) -> None:
        self.__dict__.update(step.__dict__)
        self._seq, self._log, self._land = seq, log, land

    def ready(self) -> bool:
        return self._land.is_set()

    def results(self):
        self._log.append(("reply", self._seq))
        return super().results()


def test_loop_launches_the_next_decode_before_it_answers_the_last(model: Qwen35Model) -> None:
    runner, (token,) = prefilled_runner(model, [[4, 5]])
    log: list[tuple[str, int]] = []
    land = threading.Event()
    peer = _Coordinator(runner)
    seqs = iter(range(1, 100))

    def held_decode(command: Decode) -> PendingDecode:
        seq = next(seqs)
        log.append(("launch", seq))
        return _HeldStep(runner.decode(command.rows), seq, log, land)

    peer.loop.register(Decode, held_decode)
    try:
        peer.send(Decode([decode_row(1, 0, 2, [0, 1], token=token)]), seq=1)
        assert peer.reply(0.3) is None  # its tokens have not landed, and nothing else came
        peer.send(Decode([decode_row(1, 0, 3, [0, 1], token=FED_TOKEN)]), seq=2)
        first = peer.reply()
        assert first.seq == 1 and isinstance(first.body, DecodeDone)
        assert log == [("launch", 1), ("launch", 2), ("reply", 1)]
        peer.send(Ping(), seq=3)  # not a decode: step 2's reply goes out first
        second, ping = peer.reply(), peer.reply()
        assert (second.seq, ping.seq, ping.body) == (2, 3, Ack())
        peer.send(Decode([decode_row(1, 0, 4, [0, 1], token=second.body.results[0].token)]), seq=4)
        assert peer.reply(0.3) is None
        land.set()  # its tokens land: answered without another command
        assert peer.reply().seq == 4
        peer.send(Shutdown(), seq=5)
        assert peer.reply().body == Ack()
    finally:
        peer.close()
    assert peer.exit_code == EXIT_OK


def test_loop_launches_a_unified_step_before_it_answers_the_decode_ahead(model: Qwen35Model) -> None:
    runner, (token,) = prefilled_runner(model, [[4, 5]])
    log: list[tuple[str, int]] = []
    land = threading.Event()
    peer = _Coordinator(runner)

    def held_decode(command: Decode) -> PendingDecode:
        log.append(("launch", 1))
        return _HeldStep(runner.decode(command.rows), 1, log, land)

    def logged_unified(command: Unified):
        log.append(("launch", 2))
        return runner.unified(command.prefill, command.decode)

    peer.loop.register(Decode, held_decode)
    peer.loop.register(Unified, logged_unified)
    try:
        peer.send(Decode([decode_row(1, 0, 2, [0, 1], token=token)]), seq=1)
        assert peer.reply(0.3) is None  # its tokens have not landed, and nothing else came
        peer.send(
            Unified([prefill_chunk(2, [6, 7], 0, [2, 3])], [decode_row(1, 0, 3, [0, 1], token=FED_TOKEN)]),
            seq=2,
        )
        first, second = peer.reply(), peer.reply()
        assert log == [("launch", 1), ("launch", 2), ("reply", 1)]
        assert (first.seq, second.seq) == (1, 2) and isinstance(first.body, DecodeDone)
        assert (
            isinstance(second.body, UnifiedDone) and len(second.body.prefill) == len(second.body.decode) == 1
        )
        peer.send(Shutdown(), seq=3)
        assert peer.reply().body == Ack()
    finally:
        peer.close()
    assert peer.exit_code == EXIT_OK
