"""The executor: one call per step, from the scheduler's thread.

Each call checks the command structurally (StepRejected, no poison), sends one envelope with the
next seq to every rank, collects exactly ``world_size`` replies within the step timeout and
validates them. A decode or a prefill may be split in two (``send_decode``, then ``collect_decode``)
so that the next step is on its way before this one's result is read (pipelined decode): replies
that arrive for a step still in flight are kept for its collection. The first Failed reply, a dead
rank, a timeout or an invalid reply set poisons the executor: every rank is killed and reaped,
and every later call raises ExecutorPoisoned with the first reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import structlog

from phalanx.executor import checks, responses
from phalanx.executor.collect import RankFailed, StepCollection
from phalanx.executor.config import ExecutorConfig
from phalanx.executor.errors import ExecutorError, ResponseError
from phalanx.executor.link import DispatchError, RankLink
from phalanx.executor.logs import bind
from phalanx.executor.model_info import ModelInfo
from phalanx.executor.poison import Poison
from phalanx.protocol import PROTOCOL_VERSION, encode
from phalanx.protocol.messages import (
    Capacity,
    Command,
    Decode,
    DecodeDone,
    DecodeRow,
    DropRequest,
    Envelope,
    Expectation,
    Ping,
    Precapture,
    PrecapturePhase,
    Prefill,
    PrefillChunk,
    PrefillDone,
    ReplyEnvelope,
    Shutdown,
    SlotMove,
    Unified,
    UnifiedDone,
)
from phalanx.protocol.transport import RuntimeDir

log = structlog.get_logger("phalanx.executor")

T = TypeVar("T")

# How long a failed send waits for the Failed reply of a step in flight before naming the send.
DISPATCH_GRACE_S = 0.5


def _timed_out(message: str) -> bool:
    """Whether a rank's failure is a collective's timeout (gloo: "Timed out", NCCL: "timeout")."""
    text = message.lower()
    return "timed out" in text or "timeout" in text


@dataclass(frozen=True)
class InFlight:
    """A command sent to every rank whose replies are not collected yet."""

    op: str
    seq: int
    timeout: float
    deadline: float


class Executor:
    def __init__(
        self,
        config: ExecutorConfig,
        link: RankLink,
        epoch: int,
        capacity: Capacity,
        model_info: ModelInfo,
        runtime_dir: RuntimeDir | None,
        first_seq: int,
    ) -> None:
        self.config = config
        self.epoch = epoch
        self.capacity = capacity
        self.model_info = model_info
        self.world_size = len(link.ranks)
        self._link = link
        self._runtime_dir = runtime_dir
        self._seq = first_seq
        self._poison = Poison()
        self._closed = False
        self._clean_shutdown = False
        self._interrupted: str | None = None  # set from another thread: the waiting step fails
        self._collections: dict[int, StepCollection] = {}  # seq -> replies of a step in flight

    @property
    def poison_reason(self) -> str | None:
        return self._poison.reason

    @property
    def rejected_frames(self) -> int:
        """Frames the coordinator dropped: undecodable, unauthenticated, foreign, from no rank."""
        return self._link.rejected_frames

    @property
    def address(self) -> str:
        return self._link.sock.address

    @property
    def rank_exit_codes(self) -> list[int | None]:
        """Exit code of each spawned rank (None while running, or for a rank not spawned here)."""
        return [rank.exitcode for rank in self._link.ranks]

    @property
    def rank_pids(self) -> list[int | None]:
        return [rank.process.pid if rank.process is not None else None for rank in self._link.ranks]

    # -- the public calls -----------------------------------------------------------------------

    def ping(self) -> None:
        replies = self._step("ping", Ping())
        self._validated(lambda: responses.validate_acks("ping", replies, self.world_size))

    def prefill(self, chunks: list[PrefillChunk]) -> PrefillDone:
        return self.collect_prefill(self.send_prefill(chunks))

    def send_prefill(self, chunks: list[PrefillChunk]) -> InFlight:
        """Send a prefill without waiting for it (the request's first decode may follow it,
        fed from ``feed_slot``); ``collect_prefill`` reads its result."""
        self._poison.ensure_healthy()
        checks.check_prefill(chunks, self.capacity, self.model_info.vocab_size)
        return self._send("prefill", Prefill(chunks))

    def collect_prefill(self, step: InFlight) -> PrefillDone:
        replies = self._collect(step)
        return self._validated(lambda: responses.validate_prefill(replies, self.world_size))

    def decode(self, rows: list[DecodeRow]) -> DecodeDone:
        return self.collect_decode(self.send_decode(rows))

    def send_decode(self, rows: list[DecodeRow]) -> InFlight:
        """Send a decode step without waiting for it; ``collect_decode`` reads its result."""
        self._poison.ensure_healthy()
        checks.check_decode(rows, self.capacity, self.model_info.vocab_size)
        return self._send("decode", Decode(rows))

    def collect_decode(self, step: InFlight) -> DecodeDone:
        replies = self._collect(step)
        return self._validated(lambda: responses.validate_decode(replies, self.world_size))

    def unified(self, chunks: list[PrefillChunk], rows: list[DecodeRow]) -> UnifiedDone:
        return self.collect_unified(self.send_unified(chunks, rows))

    def send_unified(self, chunks: list[PrefillChunk], rows: list[DecodeRow]) -> InFlight:
        """Send a unified step without waiting for it (its decode rows may be FED from the step
        before); ``collect_unified`` reads its result."""
        self._poison.ensure_healthy()
        checks.check_unified(chunks, rows, self.capacity, self.model_info.vocab_size)
        return self._send("unified", Unified(chunks, rows))

    def collect_unified(self, step: InFlight) -> UnifiedDone:
        replies = self._collect(step)
        return self._validated(lambda: responses.validate_unified(replies, self.world_size))

    def drop(self, request_id: int, expectation: Expectation, move: SlotMove | None = None) -> None:
        self._poison.ensure_healthy()
        command = DropRequest(request_id, expectation, move)
        checks.check_drop(command, self.capacity)
        replies = self._step(responses.DROP_OP, command)
        self._validated(lambda: responses.validate_drop(expectation, replies, self.world_size))

    def precapture(self, phase: PrecapturePhase, timeout: float | None = None) -> None:
        replies = self._step("precapture", Precapture(phase), timeout)
        self._validated(lambda: responses.validate_acks("precapture", replies, self.world_size))

    def interrupt(self, reason: str) -> None:
        """Make the step waiting for replies fail at once (within one poll slice), naming the
        ranks that did not answer; callable from any thread."""
        self._interrupted = reason

    def shutdown(self) -> bool:
        """Shutdown to every rank, a bounded join, then kill; idempotent. True when every rank
        acknowledged the Shutdown."""
        if self._closed:
            return self._clean_shutdown
        self._closed = True
        grace = self.config.shutdown_timeout
        if self._poison.reason is None:
            started = time.monotonic()
            try:
                self._step("shutdown", Shutdown(), timeout=grace)
                self._clean_shutdown = True
            except ExecutorError as exc:
                log.warning("shutdown was not acknowledged by every rank", error=str(exc))
            grace = max(0.0, grace - (time.monotonic() - started))
        self._link.stop_all(grace)
        self._link.sock.close()
        if self._link.trace is not None:
            self._link.trace.close()
        if self._runtime_dir is not None:
            self._runtime_dir.remove()
        log.info("executor shut down")
        return self._clean_shutdown

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.shutdown()

    # -- the machinery --------------------------------------------------------------------------

    def _fail(self, reason: str) -> NoReturn:
        error = self._poison.set(reason)
        self._link.kill_all(error.reason, self.epoch)
        raise error

    def _validated(self, validate: Callable[[], T]) -> T:
        try:
            return validate()
        except ResponseError as exc:
            self._fail(str(exc))

    def _step(self, op: str, body: Command, timeout: float | None = None) -> list[ReplyEnvelope]:
        return self._collect(self._send(op, body, timeout))

    def _send(self, op: str, body: Command, timeout: float | None = None) -> InFlight:
        self._poison.ensure_healthy()
        if self._closed and op != "shutdown":
            raise ExecutorError(f"{op} called after shutdown")
        self._seq += 1
        seq = self._seq
        bind(self.epoch, seq)
        timeout = self.config.step_timeout if timeout is None else timeout
        self._collections[seq] = StepCollection(op, seq, self.world_size)
        try:
            self._link.broadcast(encode(Envelope(PROTOCOL_VERSION, self.epoch, seq, body)))
        except DispatchError as exc:
            reason = self._failure_already_sent(DISPATCH_GRACE_S)
            self._fail(reason or f"failed to dispatch {op} to rank {exc.rank}: {exc.error}")
        return InFlight(op, seq, timeout, time.monotonic() + timeout)

    def _failure_already_sent(self, grace_s: float) -> str | None:
        """The Failed reply of a step still in flight, if one arrives within ``grace_s``: a rank
        that fails a pipelined step answers Failed and exits, so the next step's send can find it
        gone before its reply is read, and the reply names the cause."""
        deadline = time.monotonic() + grace_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                for _identity, reply in self._link.wait(remaining, self.epoch):
                    collection = self._collections.get(reply.seq)
                    if collection is not None:
                        collection.offer(reply)
            except RankFailed as exc:
                return str(exc)
        return None

    def _collect(self, step: InFlight) -> list[ReplyEnvelope]:
        """Exactly ``world_size`` replies to ``step``; replies to other steps in flight are kept."""
        self._poison.ensure_healthy()
        op, collection = step.op, self._collections[step.seq]
        bind(self.epoch, step.seq)
        while not collection.done:
            if self._interrupted is not None:
                self._fail(f"{self._interrupted} while {op} waited for ranks {collection.missing_ranks()}")
            remaining = step.deadline - time.monotonic()
            if remaining <= 0:
                self._fail(
                    f"{op} did not complete within {step.timeout:g} s: no reply from ranks {collection.missing_ranks()}"
                )
            try:
                for _identity, reply in self._link.wait(remaining, self.epoch):
                    self._collections.get(reply.seq, collection).offer(reply)
            except RankFailed as exc:
                killed = self._link.killed_peer(exc.rank)
                if killed is not None:
                    self._fail(f"{killed.death(0.0)} during {op}")
                silent = [rank for rank in collection.missing_ranks() if rank != exc.rank]
                if silent and _timed_out(exc.message):  # it waited for them in a collective
                    self._fail(
                        f"{op}: ranks {silent} did not answer (rank {exc.rank} timed out waiting for them:"
                        f" {exc.message})"
                    )
                self._fail(str(exc))
            if not collection.done:
                # A rank that already answered may leave (Shutdown); only a silent one is dead.
                dead = self._link.first_death(among=collection.missing_ranks())
                if dead is not None:
                    self._fail(f"{dead.death(self._link.heartbeat_timeout)} during {op}")
        del self._collections[step.seq]
        return collection.replies
