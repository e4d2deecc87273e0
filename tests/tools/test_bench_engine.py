"""``phalanx bench engine`` on the CPU: a random tiny checkpoint, both decode modes through real
rank processes, one table, and the same greedy tokens from each mode. Run in process: the ranks
are spawned all the same, and a child would spend seconds importing what pytest holds already."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from phalanx.tools.cli import main as phalanx


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> Done:
    """``phalanx bench engine --geometry tiny --device cpu ARGS``: its exit code and output."""
    try:
        code = phalanx(["bench", "engine", "--geometry", "tiny", "--device", "cpu", *args])
    except SystemExit as refused:  # argparse's usage errors
        code = refused.code
    out = capsys.readouterr()
    return Done(code, out.out, out.err)


def test_both_modes_time_the_same_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    done = _bench(capsys, "--batch", "1,2", "--prompt-len", "9", "--output-len", "12")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = lines.index(
        "| decode | requests | TPOT ms (median) | ITL ms (median) | ITL p99 ms | longest gap ms | output tokens/s "
        "| first to last token, ms a token |"
    )
    rows = [line.split(" | ")[0:2] for line in lines[header + 2 : header + 6]]
    assert rows == [["| pipelined", "1"], ["| pipelined", "2"], ["| blocking", "1"], ["| blocking", "2"]]
    for line in lines[header + 2 : header + 6]:
        itl, p99, longest = (float(cell) for cell in line.split(" | ")[3:6])
        assert itl <= p99 <= longest, f"gap figures out of order: {line}"
    assert "every mode generated the same 12 tokens at batch 1" in lines


def test_an_unknown_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    done = _bench(capsys, "--modes", "pipelined,overlapped")
    assert done.returncode == 2
    assert (
        "phalanx bench engine: unknown mode overlapped; choose from ['pipelined', 'blocking']" in done.stdout
    )


def test_staggered_arrivals_time_each_requests_own_span(capsys: pytest.CaptureFixture[str]) -> None:
    done = _bench(
        capsys, "--batch", "3", "--prompt-len", "9", "--output-len", "12", "--arrival-ms", "5", "--modes", "pipelined"
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    title = (
        "phalanx engine, tiny, cpu, eager, TP 1: prompt 9, 12 output tokens a request, arriving 5 ms apart"
    )
    assert title in lines
    (row,) = [line for line in lines if line.startswith("| pipelined | 3 |")]
    tpot, itl, p99, longest, _, whole = (float(cell) for cell in row.strip("| ").split(" | ")[2:])
    assert itl <= p99 <= longest and tpot == whole  # each request's own first-to-last span


def test_a_negative_arrival_gap_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    done = _bench(capsys, "--arrival-ms", "-1")
    assert done.returncode == 2
    assert "argument --arrival-ms: must be 0 ms or more, got -1" in done.stderr
