"""``phalanx replay show|stats|diff`` over synthetic traces; ``run`` over traces real ranks answered."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from phalanx.engine.engine import EngineConfig, FinishEvent, GenerationParams, launch
from phalanx.protocol import (
    FED_TOKEN,
    PROTOCOL_VERSION,
    Ack,
    Capacity,
    Decode,
    DecodeDone,
    DecodeRow,
    DropAck,
    DropRequest,
    Envelope,
    Expectation,
    Failed,
    Go,
    Prefill,
    PrefillChunk,
    PrefillDone,
    Ready,
    ReplyEnvelope,
    RequestRejected,
    SlotMove,
    StateSnapshot,
    TokenResult,
    UnifiedDone,
    encode,
    pack_ids,
)
from phalanx.protocol import trace as trace_module
from phalanx.protocol.trace import open_trace, read_trace
from phalanx.scheduler.requests import Request
from phalanx.scheduler.scheduler import Scheduler
from phalanx.tools.cli import main as phalanx
from phalanx.tools.replay.run import replay_config
from phalanx.tools.replay.show import describe_body

EPOCH = 9
CAP = Capacity(kv_pages=8, page_size=4, max_slots=2, max_batch_tokens=64)


def _cmd(seq: int, body: object) -> bytes:
    return encode(Envelope(PROTOCOL_VERSION, EPOCH, seq, body))


def _reply(rank: int, seq: int, body: object) -> bytes:
    return encode(ReplyEnvelope(PROTOCOL_VERSION, EPOCH, rank, seq, body))


def _record(path: Path, second_token: int = 8, pid: int = 100) -> Path:
    """Startup, one prefill, two decode steps and a drop, at TP = 2."""
    with open_trace(path, epoch=EPOCH, world_size=2, meta={"tp": 2}) as w:
        for rank in (0, 1):
            w.received(_reply(rank, 0, Ready(CAP, "cpu", pid + rank, "host")))
        w.sent(_cmd(0, Go(CAP, "tcp://127.0.0.1:1", "gloo")))
        chunk = PrefillChunk(3, pack_ids([1, 2, 3]), 0, pack_ids([0]), True)
        w.sent(_cmd(1, Prefill([chunk])))
        w.received(_reply(1, 1, Ack()))
        w.received(_reply(0, 1, PrefillDone([TokenResult(3, 7)])))
        for seq, (token, out) in enumerate([(7, second_token), (second_token, 9)], start=2):
            w.sent(_cmd(seq, Decode([DecodeRow(3, 0, token, seq + 1, pack_ids([0]))])))
            w.received(_reply(0, seq, DecodeDone([TokenResult(3, out, -0.5)])))
            w.received(_reply(1, seq, Ack()))
        w.sent(_cmd(4, DropRequest(3, Expectation.MUST_EXIST, SlotMove(4, 1, 0))))
        w.received(_reply(0, 4, DropAck(True)))
        w.received(_reply(1, 4, DropAck(True)))
    return path


def test_show_prints_one_line_per_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _record(tmp_path / "a.trace")
    assert phalanx(["replay", "show", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(read_trace(path).entries) == 15
    assert "recv <-0   seq=0     ready cpu pid=100@host kv_pages=8 slots=2" in lines[0]
    assert "send ->all seq=1     prefill 1 chunks: r3[0:3]pages=1+last" in lines[3]
    assert "recv <-0   seq=2     decode_done r3->8(-0.500)" in lines[7]
    assert lines[12].endswith("seq=4     drop r3 must_exist move r4 s1->s0")


def test_show_filters_by_seq_and_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _record(tmp_path / "a.trace")
    assert phalanx(["replay", "show", str(path), "--seq", "2:3", "--rank", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[3:6] for line in lines] == [
        ["->all", "seq=2", "decode"],
        ["<-1", "seq=2", "ack"],
        ["->all", "seq=3", "decode"],
        ["<-1", "seq=3", "ack"],
    ]


def test_stats_counts_and_latency(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _record(tmp_path / "a.trace")
    assert phalanx(["replay", "stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "trace epoch=9 world_size=2 messages=15" in out
    assert "commands  decode=2 drop=1 go=1 prefill=1" in out
    assert "replies rank 0   decode_done=2 drop_ack=1 prefill_done=1 ready=1" in out
    assert "replies rank 1   ack=3 drop_ack=1 ready=1" in out
    assert "  decode     rank 0   n=2 " in out and "  decode     rank 1   n=2 " in out
    assert "  prefill    n=1 " in out
    assert "incomplete steps=0" in out and "undecodable frames=0 torn_bytes=0" in out


def test_stats_decode_cadence_shows_when_the_ranks_waited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pipelined decode steps sent 4 ms ahead of the previous reply, then one sent 5 ms after it:
    the lead's low tail shows the wait; the prefill before them is not part of the cadence."""
    # (ms, seq, what): startup and a prefill, then decode steps 2..6
    events = [(-9, 0, "ready"), (-8, 0, "go"), (-7, 1, "prefill"), (-4, 1, "prefill_done")]
    events += [(0, 2, "send"), (1, 3, "send"), (5, 2, "reply"), (6, 4, "send"), (10, 3, "reply")]
    events += [(11, 5, "send"), (15, 4, "reply"), (20, 5, "reply"), (25, 6, "send"), (30, 6, "reply")]
    clock = iter(ms * 1_000_000 for ms, _, _ in events)
    monkeypatch.setattr(trace_module, "time", SimpleNamespace(time=lambda: 0.0, time_ns=lambda: next(clock)))
    row = DecodeRow(3, 0, FED_TOKEN, 4, pack_ids([0]))
    frames = {
        "ready": lambda seq: _reply(0, seq, Ready(CAP, "cpu", 1, "host")),
        "go": lambda seq: _cmd(seq, Go(CAP, "tcp://127.0.0.1:1", "gloo")),
        "prefill": lambda seq: _cmd(seq, Prefill([PrefillChunk(3, pack_ids([1]), 0, pack_ids([0]), True)])),
        "prefill_done": lambda seq: _reply(0, seq, PrefillDone([TokenResult(3, 7)])),
        "send": lambda seq: _cmd(seq, Decode([row])),
        "reply": lambda seq: _reply(0, seq, DecodeDone([TokenResult(3, 1)])),
    }
    path = tmp_path / "a.trace"
    with open_trace(path, epoch=EPOCH, world_size=1) as w:
        for _, seq, what in events:
            if what in ("go", "prefill", "send"):
                w.sent(frames[what](seq))
            else:
                w.received(frames[what](seq))
    assert phalanx(["replay", "stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "decode cadence (back-to-back decode steps):" in out
    assert "  send interval  n=4      p50=    5.000ms" in out  # 1, 5, 5, 14
    assert "  reply interval n=4      p50=    5.000ms" in out  # 5, 5, 5, 10
    assert "  lead (sent before the previous step's reply) n=4      p50=    4.000ms" in out
    assert "min=   -5.000ms" in out


def test_stats_reports_an_unanswered_step_and_torn_tail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _record(tmp_path / "a.trace")
    with path.open("ab") as f:
        f.write(b"\x10\x00\x00\x00abc")
    trace = read_trace(path)
    assert trace.torn_bytes == 7
    path2 = tmp_path / "b.trace"
    with open_trace(path2, epoch=EPOCH, world_size=2) as w:
        w.sent(_cmd(1, Decode([])))
        w.received(_reply(1, 1, Failed("execution", "boom", "decode")))
        w.received(b"\x01\x02", rank=0)
    assert phalanx(["replay", "stats", str(path2)]) == 0
    out = capsys.readouterr().out
    assert "incomplete steps=1 (first seq 1)" in out and "undecodable frames=1" in out
    assert phalanx(["replay", "show", str(path2)]) == 0
    out = capsys.readouterr().out
    assert "failed execution in decode: boom" in out and "undecodable 2 bytes: protocol error" in out


def test_diff_agrees_ignoring_pids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _record(tmp_path / "a.trace", pid=100)
    b = _record(tmp_path / "b.trace", pid=555)
    assert phalanx(["replay", "diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out.strip() == "the traces agree"


def test_diff_names_the_first_divergence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _record(tmp_path / "a.trace")
    b = _record(tmp_path / "b.trace", second_token=6)
    assert phalanx(["replay", "diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "first divergence at step 2 (seq 2 in A, seq 2 in B): rank 0 replied differently"
    assert out[1] == "  A: decode_done r3->8(-0.500)"
    assert out[2] == "  B: decode_done r3->6(-0.500)"


def test_diff_reports_a_shorter_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _record(tmp_path / "a.trace")
    b = tmp_path / "b.trace"
    b.write_bytes(a.read_bytes())
    full = read_trace(a)
    with open_trace(b, epoch=EPOCH, world_size=2, meta={"tp": 2}) as w:
        for e in full.entries[:12]:
            (w.sent if e.direction.value == "send" else w.received)(e.frame, e.rank)
    assert phalanx(["replay", "diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "first divergence at step 4: only A continues (5 steps in A, 4 in B)"
    assert out[1] == "  A: drop r3 must_exist move r4 s1->s0"


def test_unreadable_trace_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"nope")
    assert phalanx(["replay", "show", str(bad)]) == 2
    assert "is not a phalanx trace" in capsys.readouterr().err
    assert phalanx(["replay", "stats", str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------------------------------------
# replay run: a real recording (phalanx generate --record) replayed on fresh ranks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", ["0", "1.0"])  # greedy; sampled, with no seed given
def test_generate_record_then_replay_run_matches(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], temperature: str
) -> None:
    recorded, replayed = tmp_path / "generate.trace", tmp_path / "replay.trace"
    argv = ["generate", "--model", str(tiny_model_dir), "--tp", "2", "--prompt-ids", "5,6,7,8"]
    argv += ["--max-tokens", "5", "--ignore-eos", "--kv-pages", "16", "--json", "--record", str(recorded)]
    argv += ["--temperature", temperature]
    assert phalanx(argv) == 0
    generated = json.loads(capsys.readouterr().out)["token_ids"]
    trace = read_trace(recorded)
    assert trace.header.world_size == 2 and trace.header.meta["tp"] == 2
    primary = [
        e.message.body for e in trace.replies() if e.rank == 0 and e.op in ("prefill_done", "decode_done")
    ]
    assert [t.token for body in primary for t in body.results] == generated
    _assert_the_whole_startup_is_shown(recorded, capsys)

    argv = [
        "replay",
        "run",
        str(recorded),
        "--model",
        str(tiny_model_dir),
        "--tp",
        "2",
        "--record",
        str(replayed),
    ]
    assert phalanx(argv) == 0
    assert (
        "replayed 6 commands at tp=2: every reply matches" in capsys.readouterr().out
    )  # prefill, 4 decodes, drop
    assert phalanx(["replay", "diff", str(recorded), str(replayed)]) == 0


def test_a_pipelined_scheduler_run_replays_reply_for_reply(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unified steps, fed rows, a prefill feeding its slot, prompt logprobs, a cancellation and
    drops with compaction, as the scheduler sends them: a fresh launch answers every one alike."""
    recorded = tmp_path / "scheduler.trace"
    config = EngineConfig(
        model_dir=tiny_model_dir,
        tp=2,
        kv_pages=32,
        page_size=4,
        max_slots=4,
        max_batch_tokens=16,
        record=str(recorded),
    )
    executor = launch(config)
    events: list[object] = []
    try:
        scheduler = Scheduler(executor, (), pipeline=True)
        for request_id in range(1, 5):
            params = GenerationParams(
                max_tokens=3 + 2 * request_id,
                temperature=0.7 * (request_id % 2),
                prompt_logprobs=1 if request_id == 2 else None,
            )
            prompt = list(range(request_id, 4 * request_id + 3))
            scheduler.add(Request(request_id, prompt, params, events.append))
        for tick in itertools.count():
            if not scheduler.has_work():
                break
            scheduler.step()
            if tick == 4:
                scheduler.cancel(3)
    finally:
        executor.shutdown()
    reasons = [event.reason for event in events if isinstance(event, FinishEvent)]
    assert sorted(reasons) == ["cancelled", "length", "length", "length"]
    sent = read_trace(recorded).sends()
    assert {"prefill", "unified", "decode", "drop"} <= {entry.op for entry in sent}
    rows = [row for e in sent if isinstance(e.message.body, Decode) for row in e.message.body.rows]
    assert any(row.token == FED_TOKEN for row in rows)
    capsys.readouterr()
    argv = ["replay", "run", str(recorded), "--model", str(tiny_model_dir), "--tp", "2"]
    assert phalanx(argv) == 0
    assert "every reply matches" in capsys.readouterr().out


def _assert_the_whole_startup_is_shown(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank's handshake in order (its Hello, our Challenge to it, its Ready echoing the
    nonce), then Go to every rank."""
    assert phalanx(["replay", "show", str(trace), "--seq", "0:0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ops = [(line.split()[3], line.split()[5]) for line in lines]
    for rank in ("0", "1"):
        hello, challenge, ready = (
            ops.index((f"{arrow}{rank}", op))
            for arrow, op in (("<-", "hello"), ("->", "challenge"), ("<-", "ready"))
        )
        assert hello < challenge < ready, lines
        nonce = lines[challenge].split("nonce=")[1]
        assert len(nonce) == 32, lines[challenge]
    assert ops[-1] == ("->all", "go"), lines
    assert sum(op == "challenge" for _peer, op in ops) == 2


def test_fresh_ranks_keep_as_many_snapshot_slots_as_the_recorded_ones(tmp_path: Path) -> None:
    """The trace's restores and saves name the recorded ranks' snapshot slots."""
    args = argparse.Namespace(model="m", tp=2, device="cpu", step_timeout=60.0, record=None)
    configs = []
    for slots in (5, 0):
        path = tmp_path / f"snapshots-{slots}.trace"
        with open_trace(path, epoch=EPOCH, world_size=2, meta={"tp": 2}) as w:
            w.sent(
                _cmd(0, Go(msgspec.structs.replace(CAP, snapshot_slots=slots), "tcp://127.0.0.1:1", "gloo"))
            )
        configs.append(replay_config(read_trace(path), args))
    given, off = configs
    assert (given.kv_pages, given.max_slots, given.prefix_cache, given.prefix_snapshots) == (8, 2, True, 5)
    assert (off.prefix_cache, off.prefix_snapshots) == (False, 0)


def test_replay_comparison_reports_a_changed_token_and_a_lost_failure() -> None:
    from phalanx.tools.replay.run import Outcome, compare

    same = [TokenResult(3, 7, -0.25)]
    assert compare(Outcome(results=same), Outcome(results=[TokenResult(3, 7, -0.25 + 1e-6)])) is None
    assert compare(Outcome(results=same), Outcome(results=[TokenResult(3, 6, -0.25)])) == (
        "recorded r3->7(-0.250), replayed r3->6(-0.250)"
    )
    assert compare(Outcome(results=same), Outcome(results=[TokenResult(3, 7, -0.5)])) is not None
    assert compare(Outcome(failure="boom (decode)"), Outcome(results=same)) == (
        "recorded boom (decode), replayed success"
    )
    assert compare(Outcome(), Outcome(failure="x")) is None  # the recording ends before this step
    assert compare(Outcome(results=[], rejected=[3]), Outcome(results=same)) == (
        "recorded rejected requests [3], replayed []"
    )


def test_show_names_a_fed_token() -> None:
    rows = [DecodeRow(3, 0, FED_TOKEN, 9, b""), DecodeRow(4, 1, 17, 2, b"")]
    assert "r3@s0:tok=fed,pos=9" in describe_body(Decode(rows))
    assert "r4@s1:tok=17,pos=2" in describe_body(Decode(rows))


def test_show_names_a_rejected_request_and_why() -> None:
    body = UnifiedDone([], [TokenResult(4, 9)], [], [RequestRejected(3, "grammar does not compile: x")])
    assert describe_body(body) == " | r4->9 r3 rejected: grammar does not compile: x"


def test_show_names_the_slot_a_prefill_chunk_feeds() -> None:
    body = Prefill([PrefillChunk(3, pack_ids([1, 2]), 0, pack_ids([0]), True, feed_slot=1)])
    assert describe_body(body) == "1 chunks: r3[0:2]pages=1+last->s1"


def test_show_names_the_snapshots_a_prefill_chunk_restores_and_saves() -> None:
    saves = [StateSnapshot(2, -5, 16), StateSnapshot(0, 9, 24)]
    chunk = PrefillChunk(3, pack_ids([1] * 20), 8, pack_ids([0, 1, 2, 3, 4, 5, 6]), True)
    body = Prefill([msgspec.structs.replace(chunk, restore=StateSnapshot(1, 4, 8), save=saves)])
    assert describe_body(body) == "1 chunks: r3[8:28]pages=7+last<snap1#4>snap2#-5@16>snap0#9@24"
