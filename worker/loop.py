"""The rank's command loop: receive, decode, check, execute, reply; poison on the first failure.

Frames that fail decoding (undecodable, unknown tag, wrong version, foreign epoch) and stale
sequence numbers are dropped, counted and logged, never executed. A command that fails after it
started poisons the rank: the first reason is kept, a ``Failed`` reply goes out, the loop exits
and the process exits non-zero. The dispatch table maps each command type to a handler; other
components (the graph runner) register theirs with :meth:`CommandLoop.register`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import structlog

from protocol import PROTOCOL_VERSION, ProtocolError, decode_envelope, encode
from protocol.messages import (
    Ack,
    Cancel,
    Decode,
    DecodeDone,
    DropAck,
    DropRequest,
    Failed,
    Ping,
    Precapture,
    Prefill,
    PrefillDone,
    Reply,
    ReplyEnvelope,
    Shutdown,
    Unified,
    UnifiedDone,
)
from protocol.transport import RankSocket
from worker.commands import StepRunner
from worker.errors import WorkerStateError
from worker.faults import fault_point
from worker.logs import bind_seq

log = structlog.get_logger("phalanx.worker")

OP_NAMES: dict[type, str] = {
    Ping: "ping",
    Prefill: "prefill",
    Decode: "decode",
    Unified: "unified",
    DropRequest: "drop request",
    Precapture: "precapture",
    Shutdown: "shutdown",
}

EXIT_OK = 0
EXIT_POISONED = 1
EXIT_CANCELLED = 3


class CommandLoop:
    def __init__(self, sock: RankSocket, rank: int, epoch: int, runner: StepRunner) -> None:
        self.sock = sock
        self.rank = rank
        self.epoch = epoch
        self.runner = runner
        self.last_seq = 0
        self.rejected_frames = 0
        self.poison_reason: str | None = None
        self.handlers: dict[type, Callable[[Any], Reply]] = {
            Ping: self._ping,
            Prefill: self._prefill,
            Decode: self._decode,
            Unified: self._unified,
            DropRequest: self._drop,
            Precapture: self._precapture,
            Shutdown: lambda _command: Ack(),
        }

    def register(self, command_type: type, handler: Callable[[Any], Reply]) -> None:
        self.handlers[command_type] = handler

    # -- handlers -------------------------------------------------------------------------------

    def _ping(self, _command: Ping) -> Reply:
        fault_point("ping", self.rank)
        return Ack()

    def _prefill(self, command: Prefill) -> Reply:
        results = self.runner.prefill(command.chunks)
        return Ack() if results is None else PrefillDone(results)

    def _decode(self, command: Decode) -> Reply:
        results = self.runner.decode(command.rows)
        return Ack() if results is None else DecodeDone(results)

    def _unified(self, command: Unified) -> Reply:
        results = self.runner.unified(command.prefill, command.decode)
        return Ack() if results is None else UnifiedDone(*results)

    def _drop(self, command: DropRequest) -> Reply:
        return DropAck(self.runner.drop(command))

    def _precapture(self, _command: Precapture) -> Reply:
        raise RuntimeError("precapture is not supported in eager mode")

    # -- the loop -------------------------------------------------------------------------------

    def _reply(self, seq: int, body: Reply) -> None:
        self.sock.send(encode(ReplyEnvelope(PROTOCOL_VERSION, self.epoch, self.rank, seq, body)))

    def _poison(self, seq: int, op: str, exc: BaseException) -> None:
        kind = "state" if isinstance(exc, WorkerStateError) else "execution"
        reason = f"{type(exc).__name__}: {exc}" if kind == "execution" else str(exc)
        if self.poison_reason is None:
            self.poison_reason = reason
        log.error("worker poisoned", op=op, kind=kind, reason=self.poison_reason)
        failed = Failed(kind, self.poison_reason, op, traceback.format_exc())
        self._reply(seq, failed)

    def run(self) -> int:
        while True:
            try:
                envelope = decode_envelope(self.sock.recv(None), epoch=self.epoch)
            except ProtocolError as exc:
                self.rejected_frames += 1
                log.warning(
                    "frame rejected", reason=exc.reason, detail=exc.detail, rejected=self.rejected_frames
                )
                continue
            if isinstance(envelope.body, Cancel):
                # The coordinator gave up on this replica (poison elsewhere): leave without a reply.
                log.warning("cancelled by the coordinator", reason=envelope.body.reason)
                return EXIT_CANCELLED
            if envelope.seq <= self.last_seq:
                self.rejected_frames += 1
                log.warning("stale command rejected", command_seq=envelope.seq, last_seq=self.last_seq)
                continue
            self.last_seq = envelope.seq
            bind_seq(envelope.seq)
            command = envelope.body
            op = OP_NAMES.get(type(command), type(command).__name__.lower())
            handler = self.handlers.get(type(command))
            try:
                if handler is None:
                    raise WorkerStateError(f"{op} is not a command after startup")
                reply = handler(command)
            except Exception as exc:
                self._poison(envelope.seq, op, exc)
                return EXIT_POISONED
            self._reply(envelope.seq, reply)
            if isinstance(command, Shutdown):
                log.info("shutdown")
                return EXIT_OK
