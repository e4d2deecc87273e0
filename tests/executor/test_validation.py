"""Reply-set validation, collection and poison, with no processes: every contract text exactly."""

from __future__ import annotations

import re

import pytest

from phalanx.executor.collect import RankFailed, StepCollection
from phalanx.executor.errors import ExecutorPoisoned, ResponseError
from phalanx.executor.poison import Poison
from phalanx.executor.responses import (
    validate_acks,
    validate_decode,
    validate_drop,
    validate_prefill,
    validate_unified,
)
from phalanx.protocol import PROTOCOL_VERSION
from phalanx.protocol.messages import (
    Ack,
    DecodeDone,
    DropAck,
    Expectation,
    Failed,
    Heartbeat,
    PrefillDone,
    ReplyEnvelope,
    UnifiedDone,
)


def _reply(rank: int, body, seq: int = 5) -> ReplyEnvelope:
    return ReplyEnvelope(PROTOCOL_VERSION, 1, rank, seq, body)


def _raises(text: str):
    return pytest.raises(ResponseError, match=f"^{re.escape(text)}$")


def test_expected_count() -> None:
    with _raises("decode expected 2 responses, got 1"):
        validate_decode([_reply(0, DecodeDone([]))], 2)


def test_out_of_range_rank() -> None:
    with _raises("prefill returned out-of-range rank 2 for world size 2"):
        validate_prefill([_reply(0, PrefillDone([])), _reply(2, Ack())], 2)


def test_duplicate_rank() -> None:
    with _raises("ping returned duplicate rank 1"):
        validate_acks("ping", [_reply(1, Ack()), _reply(1, Ack())], 2)


def test_primary_must_be_the_typed_result() -> None:
    with _raises("decode rank 0 returned acknowledgement instead of primary decode result"):
        validate_decode([_reply(0, Ack()), _reply(1, Ack())], 2)
    with _raises("unified rank 0 returned decode result instead of primary unified result"):
        validate_unified([_reply(1, Ack()), _reply(0, DecodeDone([]))], 2)


def test_non_primary_must_acknowledge() -> None:
    with _raises("prefill non-primary rank 1 returned prefill result instead of acknowledgement"):
        validate_prefill([_reply(0, PrefillDone([])), _reply(1, PrefillDone([]))], 2)


def test_valid_sets_pass_in_any_order() -> None:
    done = DecodeDone([])
    assert validate_decode([_reply(1, Ack()), _reply(0, done), _reply(2, Ack())], 3) is done
    unified = UnifiedDone([], [])
    assert validate_unified([_reply(0, unified)], 1) is unified
    validate_acks("ping", [_reply(1, Ack()), _reply(0, Ack())], 2)


def test_drop_expectations() -> None:
    agree = [_reply(0, DropAck(True)), _reply(1, DropAck(True))]
    validate_drop(Expectation.MUST_EXIST, agree, 2)
    with _raises("drop request expected MustBeAbsent, got rank existence [True, True]"):
        validate_drop(Expectation.MUST_BE_ABSENT, agree, 2)
    mixed = [_reply(1, DropAck(False)), _reply(0, DropAck(True))]
    with _raises("drop request expected MustExist, got rank existence [True, False]"):
        validate_drop(Expectation.MUST_EXIST, mixed, 2)
    with _raises("drop request rank 0 returned acknowledgement instead of drop acknowledgement"):
        validate_drop(Expectation.MUST_EXIST, [_reply(0, Ack())], 1)


def test_collection_rejects_stale_seq_and_ignores_heartbeats() -> None:
    collection = StepCollection("decode", seq=5, world_size=2)
    collection.offer(_reply(1, Ack(), seq=4))
    collection.offer(_reply(1, Heartbeat(0.0), seq=0))
    assert collection.rejected == 1
    assert not collection.done
    collection.offer(_reply(1, Ack()))
    assert collection.missing_ranks() == [0]
    collection.offer(_reply(0, DecodeDone([])))
    assert collection.done


def test_first_failed_reply_ends_collection() -> None:
    collection = StepCollection("decode", seq=5, world_size=4)
    with pytest.raises(RankFailed, match=r"^rank 2 failed during decode \(decode\): boom$") as info:
        collection.offer(_reply(2, Failed("execution", "boom", "decode")))
    assert info.value.rank == 2


def test_poison_keeps_the_first_reason() -> None:
    poison = Poison()
    poison.ensure_healthy()
    first = poison.set("first")
    second = poison.set("second")
    assert str(first) == str(second) == "executor is poisoned: first"
    with pytest.raises(ExecutorPoisoned, match="^executor is poisoned: first$"):
        poison.ensure_healthy()
