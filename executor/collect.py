"""One step's reply collection: exactly ``world_size`` replies carrying the step's seq.

Replies with another seq are stale (a late answer to an earlier step) and are rejected, never
counted. The first ``Failed`` ends the collection at once: a failed rank can leave its peers
blocked in a collective, so waiting for them would only burn the step timeout.
"""

from __future__ import annotations

import structlog

from phalanx.protocol.messages import Failed, Heartbeat, Refused, ReplyEnvelope

log = structlog.get_logger("phalanx.executor")


class RankFailed(Exception):
    """A rank answered ``Failed`` (or ``Refused``: it executed nothing); the text is the poison
    reason."""

    def __init__(self, op: str, rank: int, failed: Failed | Refused) -> None:
        if isinstance(failed, Refused):
            text = f"rank {rank} refused {op}, a command outside the wire limits: {failed.message}"
        else:
            text = f"rank {rank} failed during {op} ({failed.phase}): {failed.message}"
        super().__init__(text)
        self.rank = rank
        self.message = failed.message


class StepCollection:
    def __init__(self, op: str, seq: int, world_size: int) -> None:
        self.op = op
        self.seq = seq
        self.world_size = world_size
        self.replies: list[ReplyEnvelope] = []
        self.rejected = 0

    @property
    def done(self) -> bool:
        return len(self.replies) >= self.world_size

    def offer(self, reply: ReplyEnvelope) -> None:
        """Count ``reply`` if it belongs to this step; raise RankFailed on a Failed reply."""
        if isinstance(reply.body, Heartbeat):
            return
        if reply.seq != self.seq:
            self.rejected += 1
            log.warning(
                "stale reply rejected", op=self.op, reply_rank=reply.rank, reply_seq=reply.seq, seq=self.seq
            )
            return
        if isinstance(reply.body, Failed | Refused):
            raise RankFailed(self.op, reply.rank, reply.body)
        self.replies.append(reply)

    def missing_ranks(self) -> list[int]:
        answered = {reply.rank for reply in self.replies}
        return [rank for rank in range(self.world_size) if rank not in answered]
