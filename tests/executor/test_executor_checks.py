"""Structural checks before dispatch (StepRejected, no poison) and model info without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from msgspec.structs import replace

from phalanx.executor.checks import check_decode, check_drop, check_prefill, check_unified
from phalanx.executor.errors import StepRejected
from phalanx.executor.model_info import read_model_info
from phalanx.protocol.codec import pack_ids
from phalanx.protocol.messages import (
    NO_FEED,
    Capacity,
    DecodeRow,
    DropRequest,
    Expectation,
    PrefillChunk,
    SlotMove,
    StateSnapshot,
)

CAPACITY = Capacity(kv_pages=8, page_size=4, max_slots=2, max_batch_tokens=10)
VOCAB = 100


def _chunk(
    request_id: int,
    tokens: list[int],
    start: int = 0,
    pages: list[int] | None = None,
    last: bool = True,
    feed_slot: int = NO_FEED,
) -> PrefillChunk:
    return PrefillChunk(
        request_id,
        pack_ids(tokens),
        start,
        pack_ids(pages if pages is not None else [0, 1]),
        last,
        feed_slot=feed_slot,
    )


def _row(
    request_id: int, slot: int = 0, token: int = 1, position: int = 3, pages: list[int] | None = None
) -> DecodeRow:
    return DecodeRow(request_id, slot, token, position, pack_ids(pages if pages is not None else [0]))


@pytest.mark.parametrize(
    ("chunks", "text"),
    [
        ([], "prefill has no chunks"),
        ([_chunk(0, [1])], "prefill request id 0 is invalid"),
        ([_chunk(1, [])], "prefill chunk for request 1 is empty"),
        ([_chunk(1, [1]), _chunk(1, [2])], "duplicate request id 1 in one prefill command"),
        ([_chunk(1, [100])], "token ids outside 0..99"),
        ([_chunk(1, [1, 2, 3, 4, 5], pages=[0])], "has 1 pages; 2 are needed for 5 tokens"),
        ([_chunk(1, [1], pages=[9])], "page ids outside 0..8"),
        ([_chunk(1, [1] * 6), _chunk(2, [1] * 5)], "prefill has 11 tokens, exceeding max_batch_tokens 10"),
        ([_chunk(1, [1], feed_slot=2)], "^prefill chunk for request 1 feeds slot 2 outside 0..1$"),
        (
            [_chunk(1, [1], last=False, feed_slot=0)],
            "^prefill chunk for request 1 feeds slot 0 but is not its prompt's last chunk$",
        ),
        (
            [_chunk(1, [1], feed_slot=1), _chunk(2, [1], feed_slot=1)],
            "^prefill has two chunks feeding slot 1$",
        ),
        (
            [replace(_chunk(1, [1], last=False), prompt_logprobs=1)],
            "^prefill chunk for request 1 has next_token -1 but last=False$",
        ),
        (
            [replace(_chunk(1, [1], last=False), prompt_logprobs=21, next_token=3)],
            r"^prefill chunk for request 1 asks for 21 prompt top logprobs \(0..20\)$",
        ),
        (
            [replace(_chunk(1, [1]), next_token=100)],
            "^prefill chunk for request 1 has next_token 100 outside 0..99$",
        ),
        (
            [replace(_chunk(1, [1], last=False), grammar="start: /a/")],
            "^prefill chunk for request 1 carries a grammar but is not its prompt's last chunk$",
        ),
    ],
)
def test_prefill_rejections(chunks: list[PrefillChunk], text: str) -> None:
    with pytest.raises(StepRejected, match=text):
        check_prefill(chunks, CAPACITY, VOCAB)


SNAPSHOT_CAPACITY = replace(CAPACITY, snapshot_slots=3)


@pytest.mark.parametrize(
    ("chunk", "text"),
    [
        (
            replace(_chunk(1, [1]), save=[StateSnapshot(3, 7, 1)]),
            "^prefill chunk for request 1 names snapshot slot 3; the ranks keep 3$",
        ),
        (
            replace(_chunk(1, [1], start=4), restore=StateSnapshot(0, 7, 8)),
            r"^prefill chunk for request 1 starts at 4 but restores a snapshot at position 8 \(a page boundary past 0\)$",
        ),
        (
            replace(_chunk(1, [1], start=2), restore=StateSnapshot(0, 7, 2)),
            "starts at 2 but restores a snapshot at position 2",
        ),
        (
            replace(_chunk(1, [1, 2, 3]), save=[StateSnapshot(0, 7, 2), StateSnapshot(1, 8, 2)]),
            r"^prefill chunk for request 1 saves snapshots at positions \[2, 2\], not ascending inside \(0, 3\]$",
        ),
        (replace(_chunk(1, [1, 2]), save=[StateSnapshot(0, 7, 3)]), r"positions \[3\], not ascending inside"),
        (
            replace(_chunk(1, [1, 2], start=2), save=[StateSnapshot(0, 7, 2)]),
            r"positions \[2\], not ascending",
        ),
        (
            replace(_chunk(1, [1, 2]), save=[StateSnapshot(0, 7, 2)], prompt_logprobs=0),
            "^prefill chunk for request 1 saves snapshots and asks for prompt logprobs$",
        ),
    ],
)
def test_snapshot_rejections(chunk: PrefillChunk, text: str) -> None:
    with pytest.raises(StepRejected, match=text):
        check_prefill([chunk], SNAPSHOT_CAPACITY, VOCAB)


def test_snapshots_that_fit_pass_and_a_slot_saved_twice_is_rejected() -> None:
    restored = replace(_chunk(1, [1, 2], start=4, pages=[0, 1]), restore=StateSnapshot(2, 7, 4))
    saving = replace(_chunk(2, [1, 2, 3, 4]), save=[StateSnapshot(2, 9, 2), StateSnapshot(0, 8, 4)])
    check_prefill([restored, saving], SNAPSHOT_CAPACITY, VOCAB)  # restores run before saves
    twice = replace(_chunk(3, [1, 2]), save=[StateSnapshot(0, 5, 2)])
    with pytest.raises(StepRejected, match="^prefill saves snapshot slot 0 twice$"):
        check_prefill([saving, twice], SNAPSHOT_CAPACITY, VOCAB)
    with pytest.raises(StepRejected, match="names snapshot slot 0; the ranks keep 0"):
        check_prefill([twice], CAPACITY, VOCAB)


@pytest.mark.parametrize(
    ("rows", "text"),
    [
        ([], "decode has no rows"),
        ([_row(1, 0), _row(2, 1), _row(3, 1)], "decode has 3 rows, exceeding max_slots 2"),
        ([_row(1, 2)], "slot 2 outside 0..1"),
        ([_row(1, 0), _row(2, 0)], "decode has two rows in slot 0"),
        ([_row(1, token=-2)], r"token -2 outside 0..99 \(or FED_TOKEN -1\)"),
        ([_row(1, position=4)], "has 1 pages; 2 are needed for 5 tokens"),
    ],
)
def test_decode_rejections(rows: list[DecodeRow], text: str) -> None:
    with pytest.raises(StepRejected, match=text):
        check_decode(rows, CAPACITY, VOCAB)


def test_unified_and_drop_rejections() -> None:
    check_unified([_chunk(1, [1])], [_row(2)], CAPACITY, VOCAB)
    with pytest.raises(StepRejected, match="needs both"):
        check_unified([_chunk(1, [1])], [], CAPACITY, VOCAB)
    with pytest.raises(StepRejected, match="unified request 1 appears in both prefill and decode"):
        check_unified([_chunk(1, [1])], [_row(1)], CAPACITY, VOCAB)
    with pytest.raises(
        StepRejected,
        match="^unified chunk for request 1 feeds slot 1: only a prefill may feed a decode slot$",
    ):
        check_unified([_chunk(1, [1], feed_slot=1)], [_row(2)], CAPACITY, VOCAB)
    check_prefill([_chunk(1, [1], feed_slot=0), _chunk(2, [1], feed_slot=1)], CAPACITY, VOCAB)
    check_drop(DropRequest(1, Expectation.MUST_EXIST, SlotMove(2, 1, 0)), CAPACITY)
    with pytest.raises(StepRejected, match="is a no-op"):
        check_drop(DropRequest(1, Expectation.MUST_EXIST, SlotMove(2, 1, 1)), CAPACITY)
    with pytest.raises(StepRejected, match="slot 5 outside 0..1"):
        check_drop(DropRequest(1, Expectation.MUST_EXIST, SlotMove(2, 5, 0)), CAPACITY)


def test_model_info_reads_text_config_first_without_torch(tmp_path: Path) -> None:
    config = {
        "text_config": {"vocab_size": 248320, "max_position_embeddings": 262144, "eos_token_id": 248044}
    }
    config |= {"eos_token_id": 248046, "model_type": "qwen3_5"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    code = (
        "import sys; from executor.model_info import read_model_info; "
        f"info = read_model_info({str(tmp_path)!r}); "
        "print(info.vocab_size, info.max_position_embeddings, list(info.eos_token_ids), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["248320", "262144", "[248046,", "248044]", "False"]
    assert read_model_info(tmp_path).eos_token_ids == (248046, 248044)
