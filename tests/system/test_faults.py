"""Every injected fault, driven through the real launcher, real rank processes and real sockets.

Each test asserts the exact error (rank, phase, text), how long detection took, and that no rank
process and no ipc directory is left. The engine-level test also checks that every open request
got exactly one error and that the server's ``/health`` turns 503.

Commands are counted per rank from 1, and the startup gate's Ping is command 1 (reply 1); so a
test's first prefill is command 2.
"""

from __future__ import annotations

import multiprocessing
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from phalanx.engine.engine import Engine, EngineConfig, ErrorEvent, GenerationParams
from phalanx.executor.errors import ExecutorPoisoned, StartupError
from phalanx.executor.launcher import ExecutorConfig, launch_executor
from phalanx.executor.runtime import Executor
from phalanx.protocol import (
    Decode,
    DecodeRow,
    DropRequest,
    Expectation,
    Ping,
    Prefill,
    PrefillChunk,
    SlotMove,
    pack_ids,
)
from phalanx.protocol.messages import FED_TOKEN
from phalanx.protocol.trace import Direction, read_trace
from phalanx.server.app import create_app
from phalanx.worker import faults
from tests.support.runtime_helpers import alive, rank_pids

LIMITS = {"kv_pages": 8, "page_size": 16, "max_slots": 4, "max_batch_tokens": 64}
PROMPT = [1, 2, 3]
DEAD_RANK_DETECTION_S = 2.0


@contextmanager
def faulty_executor(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, spec: str, **overrides: object
) -> Iterator[Executor]:
    """Launch with ``spec`` injected; on exit shut down and check nothing is left behind."""
    monkeypatch.setenv(faults.ENV, spec)
    config = {"tp": 1, "step_timeout": 10.0, **LIMITS, **overrides}
    ex = launch_executor(ExecutorConfig(model_dir=str(model_dir), **config))
    monkeypatch.delenv(faults.ENV)
    pids = [pid for pid in rank_pids(ex) if pid is not None]
    ipc_dir = Path(ex.address.removeprefix("ipc://")).parent
    try:
        yield ex
    finally:
        ex.shutdown()
    assert [pid for pid in pids if alive(pid)] == []
    assert not ipc_dir.exists()


def _prefill(ex: Executor, *request_ids: int) -> dict[int, int]:
    chunks = [PrefillChunk(rid, pack_ids(PROMPT), 0, pack_ids([rid - 1]), True) for rid in request_ids]
    return {result.request_id: result.token for result in ex.call(Prefill(chunks)).results}


def _decode(ex: Executor, tokens: dict[int, int], position: int) -> dict[int, int]:
    rows = [
        DecodeRow(rid, slot, token, position, pack_ids([rid - 1]))
        for slot, (rid, token) in enumerate(tokens.items())
    ]
    return {result.request_id: result.token for result in ex.call(Decode(rows)).results}


def _poisoned(call, *args: object) -> tuple[str, float]:
    """Run a call that must poison; return the reason and how long it took."""
    started = time.monotonic()
    with pytest.raises(ExecutorPoisoned) as info:
        call(*args)
    return info.value.reason, time.monotonic() - started


# ---------------------------------------------------------------------------------------------
# Crashes
# ---------------------------------------------------------------------------------------------


def _recorded_engine(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, fault: str, trace_path: Path
) -> Engine:
    """An engine at TP 2 whose ranks carry ``fault``, its protocol recorded to ``trace_path``."""
    monkeypatch.setenv(faults.ENV, fault)
    engine = Engine.start(
        EngineConfig(
            model_dir=model_dir,
            tp=2,
            step_timeout=10.0,
            record=str(trace_path),
            **LIMITS,
        )
    )
    monkeypatch.delenv(faults.ENV)
    return engine


def _read_until_error(stream, seen: list) -> None:
    """Append the stream's events to ``seen`` up to and including its ErrorEvent."""
    while not seen or not isinstance(seen[-1], ErrorEvent):
        seen.append(stream.next_event(timeout=10))


def test_sigkill_mid_decode_fails_every_open_request_once_and_health_turns_503(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    trace_path = tmp_path / "killed.trace"
    engine = _recorded_engine(tiny_model_dir, monkeypatch, "1:decode#2:kill", trace_path)
    ipc_dir = Path(engine._executor.address.removeprefix("ipc://")).parent
    pids = list(rank_pids(engine._executor))
    client = TestClient(create_app(engine, tiny_model_dir))
    assert client.get("/health").status_code == 200
    params = GenerationParams(max_tokens=8, ignore_eos=True)
    streams = [engine.submit(PROMPT[: 1 + i], params) for i in range(3)]
    events = [[], [], []]
    for stream, seen in zip(streams, events, strict=True):
        _read_until_error(stream, seen)
    failed_at = time.time_ns()
    reason = "rank 1 exited with code -9 during decode"
    for seen in events:
        errors = [e for e in seen if isinstance(e, ErrorEvent)]
        assert errors == [ErrorEvent(f"engine is poisoned: {reason}")]
        assert streams[0].finished
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "poisoned", "reason": reason}
    with pytest.raises(RuntimeError, match="engine is poisoned: rank 1 exited"):
        engine.submit(PROMPT, params)
    engine.shutdown()

    last_send = [e for e in read_trace(trace_path).entries if e.direction is Direction.SEND][-1]
    assert last_send.op == "decode"
    assert (failed_at - last_send.time_ns) / 1e9 <= DEAD_RANK_DETECTION_S
    assert [pid for pid in pids if alive(pid)] == []
    assert not ipc_dir.exists()


def test_a_failing_pipelined_unified_step_fails_every_open_request_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A request that arrives while another decodes goes out in a Unified behind the decode in
    flight; rank 0 failing there answers that decode first, then poisons, and both requests end
    with exactly one error."""
    trace_path = tmp_path / "unified.trace"
    engine = _recorded_engine(tiny_model_dir, monkeypatch, "0:unified#1:raise", trace_path)
    try:
        params = GenerationParams(max_tokens=40, ignore_eos=True)
        running = engine.submit(PROMPT, params)
        seen_running = [running.next_event(timeout=10) for _ in range(3)]  # the pipeline runs
        arriving = engine.submit(PROMPT[:2], params)
        seen_arriving: list = []
        for stream, seen in ((running, seen_running), (arriving, seen_arriving)):
            _read_until_error(stream, seen)
        reason = (
            "rank 0 failed during unified (unified): InjectedFault: injected fault at unified #1 on rank 0"
        )
        for seen in (seen_running, seen_arriving):
            assert [e for e in seen if isinstance(e, ErrorEvent)] == [
                ErrorEvent(f"engine is poisoned: {reason}")
            ]
        assert running.finished and arriving.finished
    finally:
        engine.shutdown()
    # Sent before the decode ahead was read: its decode row feeds what the ranks sampled.
    unified = next(
        e for e in read_trace(trace_path).entries if e.direction is Direction.SEND and e.op == "unified"
    )
    assert [row.token for row in unified.message.body.decode] == [FED_TOKEN]


def test_exception_at_command_n_poisons_at_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with faulty_executor(tiny_model_dir, monkeypatch, "0:command#3:raise") as ex:
        tokens = _prefill(ex, 1)
        reason, took = _poisoned(_decode, ex, tokens, len(PROMPT))
        assert reason == (
            "rank 0 failed during decode (decode): InjectedFault: injected fault at command #3 on rank 0"
        )
        assert took <= DEAD_RANK_DETECTION_S
        with pytest.raises(ExecutorPoisoned, match="^executor is poisoned: rank 0 failed during decode"):
            ex.call(Ping())


# ---------------------------------------------------------------------------------------------
# Silence: a hang, a slow reply, replies that are lost on the way
# ---------------------------------------------------------------------------------------------


def test_hang_poisons_at_the_step_timeout(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with faulty_executor(tiny_model_dir, monkeypatch, "0:prefill:hang", step_timeout=1.0) as ex:
        reason, took = _poisoned(_prefill, ex, 1)
        assert reason == "prefill did not complete within 1 s: no reply from ranks [0]"
        assert 1.0 <= took <= 1.0 + 1.0


def test_slow_reply_is_waited_for_then_ack_instead_of_payload_poisons(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with faulty_executor(tiny_model_dir, monkeypatch, "0:reply#2:slow=0.4,0:reply#3:ack") as ex:
        started = time.monotonic()
        tokens = _prefill(ex, 1)
        assert time.monotonic() - started >= 0.4
        reason, _ = _poisoned(_decode, ex, tokens, len(PROMPT))
        assert reason == "decode rank 0 returned acknowledgement instead of primary decode reply"


def test_corrupted_and_stale_replies_are_dropped_and_the_step_times_out(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = "0:reply#2:corrupt,1:reply#2:wrong_seq"
    with faulty_executor(tiny_model_dir, monkeypatch, spec, tp=2, step_timeout=1.0) as ex:
        reason, took = _poisoned(_prefill, ex, 1)
        assert reason == "prefill did not complete within 1 s: no reply from ranks [0, 1]"
        assert took <= 1.5
        assert ex._link.rejected_frames == 1  # the corrupted frame did not decode


# ---------------------------------------------------------------------------------------------
# Replies that arrive but break the response contract
# ---------------------------------------------------------------------------------------------


def test_wrong_rank_is_out_of_range(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with faulty_executor(tiny_model_dir, monkeypatch, "0:reply#2:wrong_rank") as ex:
        reason, _ = _poisoned(_prefill, ex, 1)
        assert reason == "prefill returned out-of-range rank 100 for world size 1"


def test_duplicate_reply_is_a_duplicate_rank(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 answers late, so both copies of rank 1's reply fill the step's two places.
    spec = "1:reply#2:duplicate,0:reply#2:slow=30"
    with faulty_executor(tiny_model_dir, monkeypatch, spec, tp=2) as ex:
        reason, took = _poisoned(_prefill, ex, 1)
        assert reason == "prefill returned duplicate rank 1"
        assert took < 10  # decided without waiting for rank 0's late reply


def test_a_command_outside_the_wire_limits_is_refused_and_named_at_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with faulty_executor(tiny_model_dir, monkeypatch, "0:command#2:out_of_range") as ex:
        reason, took = _poisoned(_prefill, ex, 1)
        assert reason.startswith("rank 0 refused prefill, a command outside the wire limits: command seq 2")
        assert "Expected `int` >= 0 - at `$.body.chunks[0][2]`" in reason
        assert took < 5  # answered at once, not at the 10 s step deadline


def test_slot_occupancy_mismatch_poisons_with_a_state_error(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with faulty_executor(tiny_model_dir, monkeypatch, "0:command#4:slot_mismatch") as ex:
        tokens = _prefill(ex, 1, 2)
        _decode(ex, tokens, len(PROMPT))
        reason, _ = _poisoned(ex.call, DropRequest(1, Expectation.MUST_EXIST, SlotMove(2, 1, 0)))
        assert reason == (
            "rank 0 failed during drop request (drop request): "
            "request 1 lives in slot 0 but the scheduler dropped it from slot 1"
        )


# ---------------------------------------------------------------------------------------------
# Startup
# ---------------------------------------------------------------------------------------------


@contextmanager
def _no_leftovers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The launch's private runtime directory goes under ``tmp_path``; nothing may remain."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield
    assert multiprocessing.active_children() == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("phalanx-")] == []


def test_failed_weight_load_names_rank_and_phase(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(faults.ENV, "1:load:raise")
    with _no_leftovers(monkeypatch, tmp_path), pytest.raises(StartupError) as info:
        launch_executor(ExecutorConfig(model_dir=str(tiny_model_dir), tp=2, **LIMITS))
    assert (
        str(info.value)
        == "rank 1 failed during startup:load: InjectedFault: injected fault at load on rank 1"
    )
    assert (info.value.rank, info.value.phase) == (1, "startup:load")
    assert sorted(info.value.exit_codes) == [0, 1]
    assert all(code not in (None, 0) for code in info.value.exit_codes.values()), info.value.exit_codes


def test_a_rank_hung_before_ready_fails_the_start_at_the_startup_timeout_and_is_killed(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from phalanx.executor import gate

    monkeypatch.setattr(gate, "WAITING_NOTICE_S", 1.0)
    monkeypatch.setenv(faults.ENV, "1:load:hang")
    config = ExecutorConfig(model_dir=str(tiny_model_dir), tp=2, startup_timeout=3.0, **LIMITS)
    with _no_leftovers(monkeypatch, tmp_path), pytest.raises(StartupError) as info:
        launch_executor(config)
    assert str(info.value) == "startup did not complete within 3 s: no Ready from ranks [1]"
    assert (info.value.rank, info.value.phase) == (1, "startup:load")
    assert "waiting for ranks to load, compile and profile" in capfd.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a CUDA GPU")
def test_cuda_asked_for_on_a_host_without_a_gpu_says_so(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with _no_leftovers(monkeypatch, tmp_path), pytest.raises(StartupError) as info:
        launch_executor(ExecutorConfig(model_dir=str(tiny_model_dir), tp=1, device="cuda", **LIMITS))
    message = str(info.value)
    assert message.startswith(
        "rank 0 failed during startup:device: RuntimeError: rank 0: device cuda:0 asked for, but torch ("
    ), message
    assert message.endswith("sees 0 CUDA GPU(s) on this host"), message
    assert (info.value.rank, info.value.phase) == (0, "startup:device")


def test_hung_distributed_init_aborts_within_the_watchdog_time(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv(faults.ENV, "1:dist_init:hang")
    config = ExecutorConfig(model_dir=str(tiny_model_dir), tp=2, dist_init_timeout=1.0, **LIMITS)
    with _no_leftovers(monkeypatch, tmp_path), pytest.raises(StartupError) as info:
        launch_executor(config)
    assert info.value.phase == "startup:dist_init"
    # The hung rank's watchdog aborts it; its peer fails (or is aborted) in the same phase.
    assert "during startup:dist_init" in str(info.value)
    assert info.value.exit_codes[1] == -signal.SIGABRT  # only the watchdog's os.abort() ends a hung rank
    err = capfd.readouterr().err
    watchdog_lines = [line for line in err.splitlines() if "startup watchdog expired; aborting" in line]
    assert any("watchdog_rank=1" in line and "phase=startup:dist_init" in line for line in watchdog_lines)
