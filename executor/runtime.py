"""The executor: one pair of calls per step, ``send(command)`` and ``collect(in_flight)``.

``send`` checks the command structurally (StepRejected, no poison) and sends one envelope with the
next seq to every rank; ``collect`` waits for exactly ``world_size`` replies within the step
timeout and validates them against the command (executor.replies). Several steps may be in
flight (pipelined decode: the next step is on its way before this one's reply is read); replies
that arrive for a step still in flight are kept for its collection. The first Failed reply, a
dead rank, a timeout or an invalid reply set poisons the executor: every rank is killed and
reaped, and every later call raises ExecutorPoisoned with the first reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NoReturn

import structlog

from phalanx.executor import checks, replies
from phalanx.executor.config import ExecutorConfig
from phalanx.executor.errors import ExecutorError, ReplyError
from phalanx.executor.link import DispatchError, RankLink
from phalanx.executor.logs import bind
from phalanx.executor.model_info import ModelInfo
from phalanx.executor.poison import Poison
from phalanx.executor.replies import RankFailed, StepCollection
from phalanx.protocol import PROTOCOL_VERSION, encode
from phalanx.protocol.messages import Capacity, Command, Envelope, ReplyEnvelope, Shutdown
from phalanx.protocol.transport import RuntimeDir

log = structlog.get_logger("phalanx.executor")

# How long a failed send waits for the Failed reply of a step in flight before naming the send.
DISPATCH_GRACE_S = 0.5


def _timed_out(message: str) -> bool:
    """Whether a rank's failure is a collective's timeout (gloo: "Timed out", NCCL: "timeout")."""
    text = message.lower()
    return "timed out" in text or "timeout" in text


@dataclass(frozen=True)
class InFlight:
    """A command sent to every rank whose replies are not collected yet."""

    command: Command
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

    # -- the public calls -----------------------------------------------------------------------

    def send(self, command: Command, timeout: float | None = None) -> InFlight:
        """Check ``command`` and send it to every rank without waiting for it; ``collect`` reads
        its reply. ``timeout``: the step's deadline in seconds (default: the step timeout)."""
        self._poison.ensure_healthy()
        checks.check_command(command, self.capacity, self.model_info.vocab_size)
        return self._send(command, timeout)

    def collect(self, step: InFlight) -> replies.StepReply:
        """Rank 0's reply to ``step``, once every rank answered and the replies agree with its
        command; anything else poisons."""
        collected = self._collect(step)
        try:
            return replies.validate(step.command, collected, self.world_size)
        except ReplyError as exc:
            self._fail(str(exc))

    def call(self, command: Command, timeout: float | None = None) -> replies.StepReply:
        """``send`` then ``collect``: one step with nothing else in flight behind it."""
        return self.collect(self.send(command, timeout))

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
                self.call(Shutdown(), timeout=grace)
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

    def _send(self, command: Command, timeout: float | None) -> InFlight:
        op = replies.command_name(command)
        if self._closed and not isinstance(command, Shutdown):
            raise ExecutorError(f"{op} called after shutdown")
        self._seq += 1
        seq = self._seq
        bind(self.epoch, seq)
        timeout = self.config.step_timeout if timeout is None else timeout
        self._collections[seq] = StepCollection(op, seq, self.world_size)
        try:
            self._link.broadcast(encode(Envelope(PROTOCOL_VERSION, self.epoch, seq, command)))
        except DispatchError as exc:
            reason = self._failure_already_sent(DISPATCH_GRACE_S)
            self._fail(reason or f"failed to dispatch {op} to rank {exc.rank}: {exc.error}")
        return InFlight(command, seq, timeout, time.monotonic() + timeout)

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
        op, collection = replies.command_name(step.command), self._collections[step.seq]
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
