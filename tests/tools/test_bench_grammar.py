"""``phalanx bench grammar`` on a small vocabulary: every batch size gets a row of positive times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.tools.cli import main


def test_bench_grammar_times_masks_and_picks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grammar.json"
    assert (
        main(["bench", "grammar", "--vocab", "2048", "--batch", "1,3", "--steps", "4", "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 3]
    assert all(row[key] > 0 for row in rows for key in ("mask_us", "constrained_pick_us", "plain_pick_us"))
    assert "masks µs" in capsys.readouterr().out


def test_bench_grammar_refuses_a_tiny_vocabulary() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "grammar", "--vocab", "10"])
