"""The rank's command loop: receive, decode, check, execute, reply; poison on the first failure.

Frames that fail decoding (undecodable, unknown tag, wrong version, foreign epoch) and stale
sequence numbers are dropped, counted and logged, never executed; a command of this launch with a
value outside the wire limits is not executed either, and is answered Refused. A command that fails after it
started poisons the rank: the first reason is kept, a ``Failed`` reply goes out, the loop exits
and the process exits non-zero. The dispatch table maps each command type to a handler; other
components (the graph runner) register theirs with :meth:`CommandLoop.register`.

Rank 0's Decode reply waits for the step's tokens without blocking the loop: while they are on
their way, the loop also watches the socket. When the next command arrives first and is a Decode,
it is launched before the earlier reply is sent, so the GPU has the next step queued while the
coordinator reads the last one (pipelined decode, ``protocol.messages``); any other command runs
only after the earlier reply is out. Replies leave in seq order.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import structlog

from phalanx.protocol import PROTOCOL_VERSION, ProtocolError, decode_envelope, encode
from phalanx.protocol.codec import envelope_header
from phalanx.protocol.messages import (
    COMMAND_NAMES,
    Ack,
    Cancel,
    Decode,
    DropAck,
    DropRequest,
    Failed,
    Ping,
    Precapture,
    Prefill,
    Refused,
    Reply,
    ReplyEnvelope,
    Shutdown,
    Unified,
)
from phalanx.protocol.rejections import RejectionLog
from phalanx.protocol.transport import RankSocket
from phalanx.worker.commands import StepRunner
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.faults import fault_point
from phalanx.worker.logs import bind_seq
from phalanx.worker.pending_steps import PendingStep

log = structlog.get_logger("phalanx.worker")

EXIT_OK = 0
EXIT_POISONED = 1
EXIT_CANCELLED = 3


class _Poisoned(Exception):
    """The loop poisoned the rank (and replied Failed); it exits with EXIT_POISONED."""


class CommandLoop:
    def __init__(self, sock: RankSocket, rank: int, epoch: int, runner: StepRunner) -> None:
        self.sock = sock
        self.rank = rank
        self.epoch = epoch
        self.runner = runner
        self.last_seq = 0
        self.rejections = RejectionLog(log, "frame rejected")
        self.stale_commands = 0
        self.poison_reason: str | None = None
        self._pending: tuple[int, PendingStep] | None = None  # rank 0: a step not yet answered
        self.handlers: dict[type, Callable[[Any], Reply | PendingStep]] = {
            Ping: self._ping,
            Prefill: self._prefill,
            Decode: self._decode,
            Unified: self._unified,
            DropRequest: self._drop,
            Precapture: self._precapture,
            Shutdown: lambda _command: Ack(),
        }

    @property
    def rejected_frames(self) -> int:
        return self.rejections.total + self.stale_commands

    def register(self, command_type: type, handler: Callable[[Any], Reply | PendingStep]) -> None:
        self.handlers[command_type] = handler

    # -- handlers -------------------------------------------------------------------------------

    def _ping(self, _command: Ping) -> Reply:
        fault_point("ping", self.rank)
        return Ack()

    def _prefill(self, command: Prefill) -> Reply:
        done = self.runner.prefill(command.chunks)
        return Ack() if done is None else done

    def _decode(self, command: Decode) -> Reply | PendingStep:
        step = self.runner.decode(command.rows)
        return Ack() if step is None else step

    def _unified(self, command: Unified) -> Reply | PendingStep:
        step = self.runner.unified(command.prefill, command.decode)
        return Ack() if step is None else step

    def _drop(self, command: DropRequest) -> Reply:
        return DropAck(self.runner.drop(command))

    def _precapture(self, _command: Precapture) -> Reply:
        raise RuntimeError("precapture is not supported in eager mode")

    # -- the loop -------------------------------------------------------------------------------

    def _reply(self, seq: int, body: Reply) -> None:
        self.sock.send(encode(ReplyEnvelope(PROTOCOL_VERSION, self.epoch, self.rank, seq, body)))

    def _refuse(self, frame: bytes, detail: str) -> None:
        """Answer a command of this launch that carries a value outside the wire limits with
        Refused (in seq order, after any pending reply), so the coordinator learns at once rather
        than at its step deadline; nothing of it runs, so this rank stays as it was."""
        header = envelope_header(frame)
        if header is None or header[1] != self.epoch or header[2] <= self.last_seq:
            return
        self._flush()
        self.last_seq = header[2]
        self._reply(header[2], Refused(f"command seq {header[2]} not executed: {detail}"))

    def _poison(self, seq: int, op: str, exc: BaseException) -> None:
        kind = "state" if isinstance(exc, WorkerStateError) else "execution"
        reason = f"{type(exc).__name__}: {exc}" if kind == "execution" else str(exc)
        if self.poison_reason is None:
            self.poison_reason = reason
        log.error("worker poisoned", op=op, kind=kind, reason=self.poison_reason)
        failed = Failed(kind, self.poison_reason, op, traceback.format_exc())
        self._reply(seq, failed)

    def _flush(self) -> None:
        """Send the pending step's reply (waiting for its tokens); poisons on failure."""
        if self._pending is None:
            return
        seq, step = self._pending
        self._pending = None
        try:
            reply = step.reply()
        except Exception as exc:
            self._poison(seq, step.op, exc)
            raise _Poisoned from exc
        self._reply(seq, reply)

    def _next_frame(self) -> bytes:
        """The next frame; while a step's reply is pending, it goes out as soon as its tokens are
        on the host, unless a frame arrives first."""
        while self._pending is not None:
            try:
                ready = self._pending[1].ready()
            except Exception:
                ready = True  # the reply's wait raises it again, and poisons
            if ready:
                self._flush()
            elif self.sock.has_message():
                break
        return self.sock.recv(None)

    def _execute(self, seq: int, op: str, command: Any) -> None:
        handler = self.handlers.get(type(command))
        try:
            if handler is None:
                raise WorkerStateError(f"{op} is not a command after startup")
            if not isinstance(command, (Decode, Unified)):
                self._flush()  # the earlier reply first: this command may depend on it
            reply = handler(command)
        except _Poisoned:
            raise
        except Exception as exc:
            self._flush()
            self._poison(seq, op, exc)
            raise _Poisoned from exc
        self._flush()  # a step launched behind the pending one: now its reply can wait
        if isinstance(reply, PendingStep):
            self._pending = (seq, reply)
        else:
            self._reply(seq, reply)

    def run(self) -> int:
        while True:
            frame = b""
            try:
                # The framer's checks (authentication) raise ProtocolError at the receive.
                frame = self._next_frame()
                envelope = decode_envelope(frame, epoch=self.epoch)
            except _Poisoned:
                return EXIT_POISONED
            except ProtocolError as exc:
                if exc.reason == ProtocolError.OUT_OF_RANGE:
                    self._refuse(frame, exc.detail)
                self.rejections.record(exc.reason, detail=exc.detail)
                continue
            if isinstance(envelope.body, Cancel):
                # The coordinator gave up on this replica (poison elsewhere): leave without a reply.
                log.warning("cancelled by the coordinator", reason=envelope.body.reason)
                return EXIT_CANCELLED
            if envelope.seq <= self.last_seq:
                self.stale_commands += 1
                log.warning("stale command rejected", command_seq=envelope.seq, last_seq=self.last_seq)
                continue
            self.last_seq = envelope.seq
            bind_seq(envelope.seq)
            command = envelope.body
            op = COMMAND_NAMES.get(type(command), type(command).__name__.lower())
            try:
                self._execute(envelope.seq, op, command)
            except _Poisoned:
                return EXIT_POISONED
            if isinstance(command, Shutdown):
                log.info("shutdown")
                return EXIT_OK
