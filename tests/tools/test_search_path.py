"""The repository root goes behind installed distributions on sys.path (``tools/search_path.py``):
its layer folders (``kernels/`` …) must not shadow a distribution of the same name, as transformers
imports the ``kernels`` distribution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.tools.search_path import REPOSITORY, keep_repository_last


def test_every_entry_naming_the_root_moves_to_the_end_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPOSITORY)
    monkeypatch.setattr(sys, "path", ["", str(REPOSITORY), "/opt/site-packages", f"{REPOSITORY}/."])
    keep_repository_last()
    assert sys.path == ["/opt/site-packages", str(REPOSITORY)]
    keep_repository_last()
    assert sys.path == ["/opt/site-packages", str(REPOSITORY)]


def test_other_entries_stay_in_their_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", "/a", "/b"])
    keep_repository_last()
    assert sys.path == ["", "/a", "/b"]


def test_the_cli_run_from_the_root_builds_a_model_through_transformers(tmp_path: Path) -> None:
    """`python -m phalanx.tools` from the root: transformers (which imports the ``kernels``
    distribution where one is installed) writes the tiny model."""
    out = tmp_path / "tiny"
    done = subprocess.run(
        [sys.executable, "-m", "phalanx.tools", "make-tiny-model", str(out)],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
