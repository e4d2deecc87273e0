"""One rank's checks and command loop, in process, with the real tiny model and real sockets."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest
import torch

from phalanx.models.qwen35 import PrefillBatch, Qwen35Model
from phalanx.protocol import PROTOCOL_VERSION, decode_reply, encode
from phalanx.protocol.messages import (
    FED_TOKEN,
    Ack,
    Decode,
    DecodeDone,
    DecodeRow,
    DropAck,
    DropRequest,
    Envelope,
    Expectation,
    Failed,
    Ping,
    Prefill,
    PrefillChunk,
    PrefillDone,
    Refused,
    Shutdown,
    SlotMove,
    Unified,
    UnifiedDone,
)
from phalanx.protocol.packing import pack_ids
from phalanx.protocol.transport import CoordinatorSocket, RankSocket, RuntimeDir
from phalanx.worker.commands import StepRunner
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.loop import EXIT_OK, EXIT_POISONED, CommandLoop
from phalanx.worker.pending_steps import PendingDecode

PAGE = 4
MAX_SLOTS = 3
KV_PAGES = 16


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Qwen35Model:
    return Qwen35Model.load(tiny_model_dir, rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture
def runner(model: Qwen35Model) -> StepRunner:
    model.allocate_cache(KV_PAGES + 1, PAGE, 2 * MAX_SLOTS)
    return StepRunner(model, torch.device("cpu"), 0, PAGE, KV_PAGES, MAX_SLOTS, 64)


def _chunk(
    request_id: int, tokens: list[int], start: int, pages: list[int], last: bool = True
) -> PrefillChunk:
    return PrefillChunk(request_id, pack_ids(tokens), start, pack_ids(pages), last)


def _row(request_id: int, slot: int, position: int, pages: list[int], token: int = 3) -> DecodeRow:
    return DecodeRow(request_id, slot, token, position, pack_ids(pages))


def test_phase_and_position_checks(runner: StepRunner) -> None:
    with pytest.raises(WorkerStateError, match="^decode request 5 has no worker state$"):
        runner.decode([_row(5, 0, 0, [0])])
    assert runner.prefill([_chunk(1, [4, 5, 6], 0, [0], last=False)]).results == []
    with pytest.raises(WorkerStateError, match="^request 1 is not ready for decode$"):
        runner.decode([_row(1, 0, 3, [0])])
    with pytest.raises(
        WorkerStateError, match="^prefill chunk for request 1 starts at 2 but 3 tokens are cached$"
    ):
        runner.prefill([_chunk(1, [7], 2, [0])])
    (result,) = runner.prefill([_chunk(1, [7, 8], 3, [0, 1])]).results
    assert result.request_id == 1
    with pytest.raises(WorkerStateError, match="^request 1 is already in prefilled state$"):
        runner.prefill([_chunk(1, [9], 5, [0, 1])])
    with pytest.raises(
        WorkerStateError, match="^decode row of request 1 is at position 4 but 5 tokens are cached$"
    ):
        runner.decode([_row(1, 0, 4, [0, 1])])
    with pytest.raises(
        WorkerStateError, match="^page table of request 2 has 1 pages; 2 are needed for 5 tokens$"
    ):
        runner.prefill([_chunk(2, [1, 2, 3, 4, 5], 0, [2])])


def test_slot_admission_moves_and_drops(runner: StepRunner) -> None:
    runner.prefill([_chunk(1, [4, 5], 0, [0]), _chunk(2, [6], 0, [1]), _chunk(3, [7, 8, 9], 0, [2])])
    assert [state.staging_slot for state in runner.requests.requests.values()] == [3, 4, 5]
    runner.decode([_row(1, 0, 2, [0]), _row(2, 1, 1, [1])])
    with pytest.raises(
        WorkerStateError, match="^decode slot 1 still owned by request 2 at admission of request 3$"
    ):
        runner.decode([_row(3, 1, 3, [2])])
    with pytest.raises(
        WorkerStateError, match="^decode row of request 1 carries slot 2 but the request lives in slot 0$"
    ):
        runner.decode([_row(1, 2, 3, [0])])
    with pytest.raises(WorkerStateError, match="^drop of absent request 9 carries a slot compaction$"):
        runner.drop(DropRequest(9, Expectation.MUST_EXIST, SlotMove(2, 1, 0)))
    with pytest.raises(
        WorkerStateError, match="^request 2 lives in slot 1 but the scheduler dropped it from slot 0$"
    ):
        runner.drop(DropRequest(2, Expectation.MUST_EXIST, SlotMove(3, 1, 0)))
    with pytest.raises(
        WorkerStateError, match="^request 1 lives in slot 0 but the scheduler moved it from slot 1$"
    ):
        runner.drop(DropRequest(3, Expectation.MUST_EXIST, SlotMove(1, 1, 2)))
    # Drop request 1 (slot 0); request 2 moves 1 -> 0; request 3 never took a slot.
    assert runner.drop(DropRequest(1, Expectation.MUST_EXIST, SlotMove(2, 1, 0))) is True
    assert runner.slots.owners == [2, None, None]
    assert runner.requests.requests[2].decode_slot == 0
    assert runner.drop(DropRequest(1, Expectation.MUST_BE_ABSENT)) is False
    assert runner.drop(DropRequest(3, Expectation.MUST_EXIST)) is True
    assert runner.drop(DropRequest(2, Expectation.MUST_EXIST)) is True
    assert runner.slots.owners == [None, None, None] and len(runner.requests) == 0


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
        peer.send(Prefill([_chunk(1, [4, 5], 0, [0])]), seq=3)
        done = peer.reply()
        assert done.seq == 3 and isinstance(done.body, PrefillDone)
        peer.send(Decode([_row(1, 0, 2, [0], token=done.body.results[0].token)]), seq=4)
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
        peer.send(Prefill([_chunk(1, [4, 5], 0, [0])]), seq=2)  # nothing of request 1 was staged
        assert isinstance(peer.reply().body, PrefillDone)
        peer.send(Shutdown(), seq=3)
        assert peer.reply().body == Ack()
    finally:
        peer.close()
    assert peer.exit_code == EXIT_OK


def test_state_mismatch_poisons_and_exits(runner: StepRunner) -> None:
    peer = _Coordinator(runner)
    try:
        peer.send(Decode([_row(7, 0, 0, [0])]), seq=1)
        reply = peer.reply()
        assert isinstance(reply.body, Failed)
        assert reply.body.kind == "state" and reply.body.phase == "decode"
        assert reply.body.message == "decode request 7 has no worker state"
    finally:
        peer.close()
    assert peer.exit_code == EXIT_POISONED
    assert peer.loop.poison_reason == "decode request 7 has no worker state"


def _prefilled(model: Qwen35Model, prompts: list[list[int]]) -> tuple[StepRunner, list[int]]:
    """A fresh rank state with ``prompts`` prefilled (request i + 1 in pages 2i, 2i + 1)."""
    model.allocate_cache(KV_PAGES + 1, PAGE, 2 * MAX_SLOTS)
    runner = StepRunner(model, torch.device("cpu"), 0, PAGE, KV_PAGES, MAX_SLOTS, 64)
    chunks = [_chunk(i + 1, p, 0, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
    results = runner.prefill(chunks).results
    return runner, [r.token for r in results]


def test_fed_rows_decode_the_tokens_sampled_in_the_step_before(model: Qwen35Model) -> None:
    prompts = [[4, 5], [6, 7, 8]]

    def rows(tokens: list[int], step: int) -> list[DecodeRow]:
        return [
            _row(i + 1, i, len(p) + step, [2 * i, 2 * i + 1], token=t)
            for i, (p, t) in enumerate(zip(prompts, tokens, strict=True))
        ]

    explicit, tokens = _prefilled(model, prompts)
    told = []
    for step in range(3):
        tokens = [r.token for r in explicit.decode(rows(tokens, step)).results()]
        told.append(tokens)
    fed, first = _prefilled(model, prompts)
    steps = [fed.decode(rows(first, 0))]
    for step in (1, 2):
        steps.append(fed.decode(rows([FED_TOKEN] * 2, step)))
    assert [[r.token for r in s.results()] for s in steps] == told


def test_a_unified_steps_fed_rows_decode_the_tokens_of_the_decode_before(model: Qwen35Model) -> None:
    """A pipelined Unified: request 2's prompt beside request 1's row fed from the Decode before;
    the same tokens as with request 1's token told."""
    explicit, (token,) = _prefilled(model, [[4, 5]])
    second = explicit.decode([_row(1, 0, 2, [0, 1], token=token)]).results()[0].token
    told = explicit.unified([_chunk(2, [6, 7], 0, [2, 3])], [_row(1, 0, 3, [0, 1], token=second)]).reply()
    fed, (token,) = _prefilled(model, [[4, 5]])
    fed.decode([_row(1, 0, 2, [0, 1], token=token)])
    reply = fed.unified([_chunk(2, [6, 7], 0, [2, 3])], [_row(1, 0, 3, [0, 1], token=FED_TOKEN)]).reply()
    assert reply == told and len(reply.prefill) == 1 and len(reply.decode) == 1


def test_a_fed_row_needs_a_decode_of_its_request_in_the_command_before(model: Qwen35Model) -> None:
    runner, (token_1, token_2) = _prefilled(model, [[4, 5], [6]])
    text = "^decode row of request {} feeds the token sampled by the previous command, which did not decode the request in slot {}$"
    with pytest.raises(WorkerStateError, match=text.format(1, 0)):
        runner.decode([_row(1, 0, 2, [0, 1], token=FED_TOKEN)])  # the command before was a prefill
    runner, (token_1, token_2) = _prefilled(model, [[4, 5], [6]])
    runner.decode([_row(1, 0, 2, [0, 1], token=token_1)]).results()
    with pytest.raises(WorkerStateError, match=text.format(2, 1)):
        runner.decode([_row(1, 0, 3, [0, 1], token=FED_TOKEN), _row(2, 1, 1, [2, 3], token=FED_TOKEN)])
    runner, (token_1, token_2) = _prefilled(model, [[4, 5], [6]])
    runner.decode([_row(1, 0, 2, [0, 1], token=token_1), _row(2, 1, 1, [2, 3], token=token_2)]).results()
    assert runner.drop(DropRequest(2, Expectation.MUST_EXIST)) is True
    with pytest.raises(WorkerStateError, match=text.format(1, 0)):
        runner.decode([_row(1, 0, 3, [0, 1], token=FED_TOKEN)])  # a drop came between


def test_a_prefill_feeds_the_first_decode_from_the_slot_its_last_chunk_names(model: Qwen35Model) -> None:
    prompts = [[4, 5], [6, 7, 8]]
    explicit, first = _prefilled(model, prompts)
    rows = [
        _row(i + 1, i, len(p), [2 * i, 2 * i + 1], token=t)
        for i, (p, t) in enumerate(zip(prompts, first, strict=True))
    ]
    told = [r.token for r in explicit.decode(rows).results()]
    model.allocate_cache(KV_PAGES + 1, PAGE, 2 * MAX_SLOTS)
    fed = StepRunner(model, torch.device("cpu"), 0, PAGE, KV_PAGES, MAX_SLOTS, 64)
    chunks = [
        PrefillChunk(i + 1, pack_ids(p), 0, pack_ids([2 * i, 2 * i + 1]), True, feed_slot=i)
        for i, p in enumerate(prompts)
    ]
    assert [r.token for r in fed.prefill(chunks).results] == first
    assert fed.fed_tokens[:2].tolist() == first
    fed_rows = [_row(i + 1, i, len(p), [2 * i, 2 * i + 1], token=FED_TOKEN) for i, p in enumerate(prompts)]
    assert [r.token for r in fed.decode(fed_rows).results()] == told


def test_a_prefill_feeds_only_a_free_slot_from_a_last_chunk(model: Qwen35Model) -> None:
    runner, (token_1, _) = _prefilled(model, [[4, 5], [6]])
    runner.decode([_row(1, 0, 2, [0, 1], token=token_1)]).results()
    where = "^prefill chunk for request 3 feeds slot {}"
    cases = [
        (
            PrefillChunk(3, pack_ids([9]), 0, pack_ids([4]), False, feed_slot=1),
            " but is not its prompt's last chunk$",
        ),
        (PrefillChunk(3, pack_ids([9]), 0, pack_ids([4]), True, feed_slot=0), ", which request 1 holds$"),
        (
            PrefillChunk(3, pack_ids([9]), 0, pack_ids([4]), True, feed_slot=3),
            " outside the worker slot map of 3$",
        ),
    ]
    for chunk, end in cases:
        with pytest.raises(WorkerStateError, match=where.format(chunk.feed_slot) + end):
            runner.prefill([chunk])
        runner.requests.remove(3)  # the refused chunk began the request's state: forget it
    with pytest.raises(
        WorkerStateError,
        match="^unified chunk for request 3 feeds slot 1: only a prefill may feed a decode slot$",
    ):
        runner.unified([PrefillChunk(3, pack_ids([9]), 0, pack_ids([4]), True, feed_slot=1)], [])


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
    runner, (token,) = _prefilled(model, [[4, 5]])
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
        peer.send(Decode([_row(1, 0, 2, [0, 1], token=token)]), seq=1)
        assert peer.reply(0.3) is None  # its tokens have not landed, and nothing else came
        peer.send(Decode([_row(1, 0, 3, [0, 1], token=FED_TOKEN)]), seq=2)
        first = peer.reply()
        assert first.seq == 1 and isinstance(first.body, DecodeDone)
        assert log == [("launch", 1), ("launch", 2), ("reply", 1)]
        peer.send(Ping(), seq=3)  # not a decode: step 2's reply goes out first
        second, ping = peer.reply(), peer.reply()
        assert (second.seq, ping.seq, ping.body) == (2, 3, Ack())
        peer.send(Decode([_row(1, 0, 4, [0, 1], token=second.body.results[0].token)]), seq=4)
        assert peer.reply(0.3) is None
        land.set()  # its tokens land: answered without another command
        assert peer.reply().seq == 4
        peer.send(Shutdown(), seq=5)
        assert peer.reply().body == Ack()
    finally:
        peer.close()
    assert peer.exit_code == EXIT_OK


def test_loop_launches_a_unified_step_before_it_answers_the_decode_ahead(model: Qwen35Model) -> None:
    runner, (token,) = _prefilled(model, [[4, 5]])
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
        peer.send(Decode([_row(1, 0, 2, [0, 1], token=token)]), seq=1)
        assert peer.reply(0.3) is None  # its tokens have not landed, and nothing else came
        peer.send(Unified([_chunk(2, [6, 7], 0, [2, 3])], [_row(1, 0, 3, [0, 1], token=FED_TOKEN)]), seq=2)
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


def test_prompt_logprobs_of_a_chunked_prompt_match_the_full_logits(model: Qwen35Model) -> None:
    prompt = [4, 5, 6, 7, 8, 9, 10]
    model.allocate_cache(KV_PAGES + 1, PAGE, 2 * MAX_SLOTS)
    full = model.prefill(PrefillBatch.build([(prompt, 0, MAX_SLOTS, [0, 1])]), all_logits=True)
    reference = torch.log_softmax(full, dim=-1)
    runner = StepRunner(model, torch.device("cpu"), 0, PAGE, KV_PAGES, MAX_SLOTS, 64)
    first = PrefillChunk(1, pack_ids(prompt[:3]), 0, pack_ids([0]), False, prompt_logprobs=2, next_token=7)
    second = PrefillChunk(1, pack_ids(prompt[3:]), 3, pack_ids([0, 1]), True, prompt_logprobs=2)
    head, tail = runner.prefill([first]).prompt_logprobs, runner.prefill([second]).prompt_logprobs
    assert [(p.request_id, p.start, len(p.logprobs)) for p in (*head, *tail)] == [(1, 1, 3), (1, 4, 3)]
    scored = [*head[0].logprobs, *tail[0].logprobs]
    expected = [reference[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert scored == pytest.approx(expected, abs=1e-5)
    ranks = [int((reference[i] > reference[i, prompt[i + 1]]).sum()) + 1 for i in range(len(prompt) - 1)]
    assert [*head[0].ranks, *tail[0].ranks] == ranks
    top = reference.topk(2, dim=-1)
    assert [*head[0].top_ids, *tail[0].top_ids] == top.indices[:-1].tolist()
    top_logprobs = [value for row in (*head[0].top_logprobs, *tail[0].top_logprobs) for value in row]
    assert top_logprobs == pytest.approx(top.values[:-1].flatten().tolist(), abs=1e-5)


def test_a_prompt_logprobs_chunk_with_a_wrong_next_token_is_refused(runner: StepRunner) -> None:
    chunk = PrefillChunk(1, pack_ids([4, 5]), 0, pack_ids([0]), True, prompt_logprobs=0, next_token=7)
    with pytest.raises(
        WorkerStateError, match="^prefill chunk for request 1: next_token 7 does not match last=True$"
    ):
        runner.prefill([chunk])
