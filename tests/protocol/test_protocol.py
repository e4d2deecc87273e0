"""The wire contract: round trips, packed ids, and frames that must be rejected."""

from __future__ import annotations

import msgspec
import pytest

from phalanx.protocol import PROTOCOL_VERSION, ProtocolError, decode_envelope, decode_reply, encode
from phalanx.protocol.codec import pack_ids, unpack_list
from phalanx.protocol.messages import (
    Decode,
    DecodeDone,
    DecodeRow,
    DropRequest,
    Envelope,
    Expectation,
    Prefill,
    PrefillChunk,
    ReplyEnvelope,
    RequestRejected,
    SamplingParams,
    SlotMove,
    TokenResult,
    UnifiedDone,
)


def _envelope(body, epoch: int = 7, seq: int = 3) -> Envelope:
    return Envelope(proto=PROTOCOL_VERSION, epoch=epoch, seq=seq, body=body)


def test_commands_round_trip() -> None:
    chunk = PrefillChunk(1, pack_ids([5, 6, 7]), 0, pack_ids([0]), True, SamplingParams(logprobs=2))
    row = DecodeRow(2, 0, 9, 3, pack_ids([1, 4]), SamplingParams(temperature=0.5, seed=1))
    for body in (
        Prefill([chunk]),
        Decode([row]),
        DropRequest(3, Expectation.MUST_EXIST, SlotMove(4, 1, 0)),
    ):
        assert decode_envelope(encode(_envelope(body)), epoch=7).body == body


def test_token_ids_travel_packed() -> None:
    tokens = list(range(1000))
    frame = encode(_envelope(Prefill([PrefillChunk(1, pack_ids(tokens), 0, pack_ids([0]), True)])))
    # 4 bytes per id plus a small fixed overhead, not one msgpack object per token.
    assert len(frame) < 4 * len(tokens) + 100
    body = decode_envelope(frame).body
    assert unpack_list(body.chunks[0].tokens) == tokens


def test_reply_round_trip() -> None:
    reply = ReplyEnvelope(PROTOCOL_VERSION, 7, 1, 3, DecodeDone([TokenResult(2, 11, -0.5, [11], [-0.5])]))
    assert decode_reply(encode(reply), epoch=7) == reply
    rejected = UnifiedDone([], [TokenResult(2, 11)], [], [RequestRejected(4, "grammar does not compile: x")])
    reply = ReplyEnvelope(PROTOCOL_VERSION, 7, 0, 3, rejected)
    assert decode_reply(encode(reply), epoch=7) == reply


def test_undecodable_frame_is_rejected() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_envelope(b"\xc1\x00garbage")
    assert info.value.reason == ProtocolError.UNDECODABLE


def test_unknown_tag_is_rejected() -> None:
    frame = msgspec.msgpack.encode(
        {"proto": PROTOCOL_VERSION, "epoch": 1, "seq": 1, "body": {"op": "rm -rf"}}
    )
    with pytest.raises(ProtocolError) as info:
        decode_envelope(frame)
    assert info.value.reason == ProtocolError.UNKNOWN_TAG


def test_wrong_version_is_rejected() -> None:
    frame = encode(Envelope(proto=PROTOCOL_VERSION + 1, epoch=1, seq=1, body=Decode([])))
    with pytest.raises(ProtocolError, match="protocol version") as info:
        decode_envelope(frame)
    assert info.value.reason == ProtocolError.WRONG_VERSION


def test_foreign_epoch_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="epoch 8, expected 7") as info:
        decode_reply(encode(ReplyEnvelope(PROTOCOL_VERSION, 8, 0, 1, DecodeDone([]))), epoch=7)
    assert info.value.reason == ProtocolError.FOREIGN_EPOCH


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (SamplingParams(top_k=2**63), "Expected `int` <= 2147483647"),
        (SamplingParams(top_k=2**64), "can't serialize ints"),
        (SamplingParams(seed=2**63), "Expected `int` <= 9223372036854775807"),
        (SamplingParams(temperature=float("nan")), "Expected `float` >= 0.0"),
        (SamplingParams(temperature=3.0), "Expected `float` <= 2.0"),
        (SamplingParams(top_p=0.0), "Expected `float` > 0.0"),
        (SamplingParams(logprobs=21), "Expected `int` <= 20"),
    ],
)
def test_encode_refuses_a_command_that_does_not_fit_the_wire(sampling: SamplingParams, message: str) -> None:
    row = DecodeRow(request_id=1, slot=0, token=5, position=3, page_ids=pack_ids([0]), sampling=sampling)
    with pytest.raises(ProtocolError) as caught:
        encode(_envelope(Decode([row])))
    assert caught.value.reason == ProtocolError.OUT_OF_RANGE
    assert message in caught.value.detail


def test_a_frame_outside_the_wire_limits_is_rejected_as_out_of_range() -> None:
    # a frame some other encoder built: the rank's decoder refuses it, never computes with it
    row = [1, 0, 5, 3, pack_ids([0]), [0.5, 2**40]]
    body = {"op": "decode", "rows": [row]}
    frame = msgspec.msgpack.encode({"proto": PROTOCOL_VERSION, "epoch": 7, "seq": 3, "body": body})
    with pytest.raises(ProtocolError) as caught:
        decode_envelope(frame)
    assert caught.value.reason == ProtocolError.OUT_OF_RANGE
