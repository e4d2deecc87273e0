"""Reply validation, collection and poison, with no processes: every contract text exactly."""

from __future__ import annotations

import re

import pytest

from phalanx.executor.errors import ExecutorPoisoned, ReplyError
from phalanx.executor.poison import Poison
from phalanx.executor.replies import (
    RankFailed,
    StepCollection,
    validate,
    validate_acks,
    validate_decode,
    validate_drop,
    validate_prefill,
    validate_unified,
)
from phalanx.protocol import PROTOCOL_VERSION
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import (
    NO_TOKEN,
    Ack,
    Decode,
    DecodeDone,
    DecodeRow,
    DropAck,
    DropRequest,
    Expectation,
    Failed,
    Heartbeat,
    Ping,
    Prefill,
    PrefillChunk,
    PrefillDone,
    PromptLogprobs,
    ReplyEnvelope,
    RequestRejected,
    TokenResult,
    Unified,
    UnifiedDone,
)


def _reply(rank: int, body, seq: int = 5) -> ReplyEnvelope:
    return ReplyEnvelope(PROTOCOL_VERSION, 1, rank, seq, body)


def _rows(*request_ids: int) -> Decode:
    return Decode([DecodeRow(rid, slot, 1, 3, pack_ids([0])) for slot, rid in enumerate(request_ids)])


def _chunk(request_id: int, last: bool = True, prompt_logprobs: int | None = None) -> PrefillChunk:
    next_token = NO_TOKEN if last else 7
    return PrefillChunk(
        request_id,
        pack_ids([4, 5, 6]),
        0,
        pack_ids([0]),
        last,
        prompt_logprobs=prompt_logprobs,
        next_token=next_token,
    )


NO_ROWS = Decode([])
NO_CHUNKS = Prefill([])


def _raises(text: str):
    return pytest.raises(ReplyError, match=f"^{re.escape(text)}$")


def test_expected_count() -> None:
    with _raises("decode expected 2 replies, got 1"):
        validate_decode(NO_ROWS, [_reply(0, DecodeDone([]))], 2)


def test_out_of_range_rank() -> None:
    with _raises("prefill returned out-of-range rank 2 for world size 2"):
        validate_prefill(NO_CHUNKS, [_reply(0, PrefillDone([])), _reply(2, Ack())], 2)


def test_duplicate_rank() -> None:
    with _raises("ping returned duplicate rank 1"):
        validate_acks("ping", [_reply(1, Ack()), _reply(1, Ack())], 2)


def test_primary_must_be_the_typed_result() -> None:
    with _raises("decode rank 0 returned acknowledgement instead of primary decode reply"):
        validate_decode(NO_ROWS, [_reply(0, Ack()), _reply(1, Ack())], 2)
    with _raises("unified rank 0 returned decode result instead of primary unified reply"):
        validate_unified(Unified([], []), [_reply(1, Ack()), _reply(0, DecodeDone([]))], 2)


def test_non_primary_must_acknowledge() -> None:
    with _raises("prefill non-primary rank 1 returned prefill result instead of acknowledgement"):
        validate_prefill(NO_CHUNKS, [_reply(0, PrefillDone([])), _reply(1, PrefillDone([]))], 2)


def test_valid_sets_pass_in_any_order() -> None:
    done = DecodeDone([TokenResult(2, 5), TokenResult(1, 4)])
    assert validate(_rows(1, 2), [_reply(1, Ack()), _reply(0, done), _reply(2, Ack())], 3) is done
    unified = UnifiedDone([], [])
    assert validate_unified(Unified([], []), [_reply(0, unified)], 1) is unified
    assert validate(Ping(), [_reply(1, Ack()), _reply(0, Ack())], 2) == Ack()
    validate_acks("ping", [_reply(1, Ack()), _reply(0, Ack())], 2)


def test_a_token_reply_holds_one_token_per_row_and_last_chunk() -> None:
    with _raises("invalid decode reply: returned unknown or non-final request id 3"):
        validate(_rows(1), [_reply(0, DecodeDone([TokenResult(3, 1)]))], 1)
    with _raises("invalid decode reply: returned duplicate request id 1"):
        validate(_rows(1), [_reply(0, DecodeDone([TokenResult(1, 1), TokenResult(1, 1)]))], 1)
    with _raises("invalid prefill reply: is missing final request id 2"):
        validate(Prefill([_chunk(1), _chunk(2)]), [_reply(0, PrefillDone([TokenResult(1, 1)]))], 1)
    with _raises("invalid prefill reply: returned unknown or non-final request id 1"):
        validate(Prefill([_chunk(1, last=False)]), [_reply(0, PrefillDone([TokenResult(1, 1)]))], 1)
    with _raises("invalid unified reply: is missing final request id 1"):
        validate(Unified([_chunk(2)], _rows(1).rows), [_reply(0, UnifiedDone([TokenResult(2, 1)], []))], 1)


def test_a_prefill_reply_holds_the_prompt_logprobs_each_chunk_asked_for() -> None:
    command = Prefill([_chunk(1, last=False, prompt_logprobs=0), _chunk(2)])
    span = PromptLogprobs(1, 1, [-0.5, -0.25, -1.0], [1, 2, 3])
    assert validate(command, [_reply(0, PrefillDone([TokenResult(2, 9)], [span]))], 1).prompt_logprobs == [
        span
    ]
    with _raises("invalid prefill reply: 0 prompt logprob spans for 1 chunks that asked"):
        validate(command, [_reply(0, PrefillDone([TokenResult(2, 9)]))], 1)
    short = PromptLogprobs(1, 1, [-0.5], [1])
    with _raises(
        "invalid prefill reply: prompt logprobs of request 1 from 1 (1) answer chunk of request 1 from 1 (3)"
    ):
        validate(command, [_reply(0, PrefillDone([TokenResult(2, 9)], [short]))], 1)


def test_a_rejected_request_is_one_of_the_command_named_once_with_no_token_or_logprobs() -> None:
    command = Unified([_chunk(2, prompt_logprobs=0), _chunk(3, last=False)], _rows(1).rows)
    rejected = [RequestRejected(2, "prompt token id 600 is outside the vocabulary [0, 512) (position 1)")]
    done = UnifiedDone([], [TokenResult(1, 4)], [], rejected)
    assert validate(command, [_reply(0, done)], 1) is done
    assert validate(_rows(1, 2), [_reply(0, DecodeDone([TokenResult(2, 4)], [RequestRejected(1, "x")]))], 1)
    with _raises("invalid prefill reply: rejected request id 4 is not in the command"):
        validate(
            Prefill([_chunk(1)]),
            [_reply(0, PrefillDone([TokenResult(1, 1)], [], [RequestRejected(4, "x")]))],
            1,
        )
    with _raises("invalid decode reply: rejected request id 1 twice"):
        validate(_rows(1), [_reply(0, DecodeDone([], [RequestRejected(1, "x"), RequestRejected(1, "y")]))], 1)
    with _raises("invalid decode reply: returned unknown or non-final request id 1"):
        validate(_rows(1), [_reply(0, DecodeDone([TokenResult(1, 1)], [RequestRejected(1, "x")]))], 1)
    with _raises("invalid unified reply: 1 prompt logprob spans for 0 chunks that asked"):
        validate(
            command,
            [_reply(0, UnifiedDone([], [TokenResult(1, 4)], [PromptLogprobs(2, 1, [], [])], rejected))],
            1,
        )


def test_drop_expectations() -> None:
    agree = [_reply(0, DropAck(True)), _reply(1, DropAck(True))]
    exists, absent = DropRequest(1, Expectation.MUST_EXIST), DropRequest(1, Expectation.MUST_BE_ABSENT)
    assert validate_drop(exists, agree, 2) == DropAck(True)
    with _raises("drop request expected MustBeAbsent, got rank existence [True, True]"):
        validate_drop(absent, agree, 2)
    mixed = [_reply(1, DropAck(False)), _reply(0, DropAck(True))]
    with _raises("drop request expected MustExist, got rank existence [True, False]"):
        validate_drop(exists, mixed, 2)
    with _raises("drop request rank 0 returned acknowledgement instead of drop acknowledgement"):
        validate(exists, [_reply(0, Ack())], 1)


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
