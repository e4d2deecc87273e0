"""eval-mc end to end against a real server (TP 2, CPU, tiny model): a run killed mid-way and
resumed loses and duplicates no sample; the torn last line of the checkpoint is repaired."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from phalanx.tools.cli import main as phalanx
from phalanx.tools.evalmc.extract import extract_answer
from tests.support.live_server import MODEL_NAME, REPO

SUBJECTS = {"geography": 16, "arithmetic": 12, "colours": 8}
SAMPLE = 24


@pytest.fixture(scope="module")
def base_url(tiny_server: str) -> str:
    return tiny_server + "/v1"


def _dataset(path: Path) -> Path:
    rows = [
        {
            "id": f"{subject}-{i}",
            "subject": subject,
            "question": f"Question {i} about {subject}: which option is right?",
            "options": ["one", "two", "three", "four"],
            "answer": "ABCD"[i % 4],
        }
        for subject, n in SUBJECTS.items()
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _argv(base_url: str, data: Path, out: Path) -> list[str]:
    return [
        "eval-mc", "--bench", "mmlu_redux", "--data", str(data), "--out", str(out), "--base-url", base_url,
        "--max-tokens", "6", "--temperature", "0", "--concurrency", "2", "--sample", str(SAMPLE),
    ]  # fmt: skip


def test_killed_run_resumes_without_losing_or_duplicating(base_url: str, tmp_path: Path) -> None:
    data, out = _dataset(tmp_path / "mc.jsonl"), tmp_path / "out"
    partial = out / "mmlu_redux_samples.partial.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "phalanx.tools", *_argv(base_url, data, out), "--model", MODEL_NAME],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not (partial.exists() and len(partial.read_text().splitlines()) >= 4):
        assert process.poll() is None, "eval-mc finished before it could be killed"
        assert time.monotonic() < deadline, "eval-mc made no progress"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done_before = [json.loads(line)["idx"] for line in partial.read_text().splitlines()]
    assert 4 <= len(done_before) < SAMPLE
    with partial.open("a") as f:
        f.write('{"idx": 3, "content": "Answer: B", "tor')  # a write cut by the kill

    assert phalanx(_argv(base_url, data, out)) == 0
    summary = json.loads((out / "mmlu_redux_summary.json").read_text())
    samples = json.loads((out / "mmlu_redux_samples.json").read_text())
    assert summary["n"] == SAMPLE and summary["recovered_samples"] == len(done_before)
    assert [s["idx"] for s in samples] == list(range(SAMPLE))
    rows = [json.loads(line) for line in partial.read_text().splitlines()]
    assert sorted(r["idx"] for r in rows) == list(range(SAMPLE))  # the torn line is gone, nothing twice
    assert Counter(s["subject"] for s in samples) == {"geography": 11, "arithmetic": 8, "colours": 5}
    assert summary["correct"] == sum(s["correct"] for s in samples)
    for s in samples:
        assert s["error"] is None and s["completion_tokens"] >= 1
        assert s["pred"] == extract_answer(s["content"], tuple(s["options"]), "ABCD").letter

    # a finished run resumed again asks for nothing and scores the same
    assert phalanx(_argv(base_url, data, out)) == 0
    again = json.loads((out / "mmlu_redux_summary.json").read_text())
    assert (again["recovered_samples"], again["correct"], again["generated_tokens"]) == (
        SAMPLE,
        summary["correct"],
        0,
    )
