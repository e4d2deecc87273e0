"""The benchmarks' shared argument types, and the command lines that refuse nonsense through them
before any work starts (they used to fail deep inside with a traceback)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from phalanx.tools.bench.args import at_least, integer_at_least, tp_degrees
from phalanx.tools.cli import main


def test_counts_with_a_floor() -> None:
    assert at_least(1)("3") == 3 and at_least(0)("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be an integer >= 1, got 0"):
        at_least(1)("0")
    with pytest.raises(argparse.ArgumentTypeError, match="must be an integer, got 'ten'"):
        at_least(1)("ten")
    with pytest.raises(argparse.ArgumentTypeError, match="must be 0 or more steps, got -2"):
        integer_at_least("-2", 0, "0 or more steps")


def test_tp_degrees_refuse_nonsense() -> None:
    assert tp_degrees("1,2,4") == [1, 2, 4]
    with pytest.raises(argparse.ArgumentTypeError, match="must be comma-separated integers, got 'two'"):
        tp_degrees("two")
    with pytest.raises(argparse.ArgumentTypeError, match="needs TP degrees of at least 1, got '0,2'"):
        tp_degrees("0,2")


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["bench", "roundtrip", "--tp", "0"], "argument --tp: needs TP degrees of at least 1, got '0'"),
        (
            ["bench", "roundtrip", "--iterations", "0"],
            "argument --iterations: must be an integer >= 1, got 0",
        ),
        (["bench", "roundtrip", "--rows", "-1"], "argument --rows: must be an integer >= 1, got -1"),
        (["bench", "decode", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
        (["bench", "host", "--batch", "0"], "argument --batch: must be an integer >= 1, got 0"),
        (["bench", "linear", "--replays", "0"], "argument --replays: must be an integer >= 1, got 0"),
        (["bench", "gdn", "--layers", "0"], "argument --layers: must be an integer >= 1, got 0"),
        (["bench", "load", "--tp", "0"], "argument --tp: must be an integer >= 1, got 0"),
    ],
)
def test_benchmarks_refuse_counts_below_their_floor(
    command: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(command)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_roundtrip_runs_the_degrees_it_parsed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "roundtrip", "--tp", "1", "--iterations", "5", "--warmup", "0", "--rows", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Decode round trip, 2 rows, ipc, 5 iterations"
    assert lines[2].split()[0] == "1"


def test_make_tiny_model_names_a_directory_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["make-tiny-model", str(blocker / "model")]) == 2
    assert f"phalanx make-tiny-model: error: cannot write {blocker / 'model'}:" in capsys.readouterr().err
