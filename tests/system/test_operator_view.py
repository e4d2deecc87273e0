"""What an operator sees of a running server: one JSON record a line (coordinator, ranks and
uvicorn alike), an access line per request, a stats line every interval while busy and none while
idle, ``--api-key`` refusing with 401 in OpenAI's shape, a curl hint that works for a model without
a chat template, and processes titled by role. ``generate`` logs console lines with ``--verbose``
and nothing with ``--quiet``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.live_server import REPO, Served, metric, serve_process
from tests.support.log_lines import json_records

KEY = "sk-operator-test"
STATS_INTERVAL_S = 0.5
MAX_TOKENS = 24
CONSOLE_LINE = re.compile(r"^(DEBUG  |INFO   |WARNING|ERROR  ) \d\d-\d\d \d\d:\d\d:\d\d (r\d+ *|coord) \S")


@pytest.fixture(scope="module")
def plain_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model without a chat template: a base model, served through completions only."""
    target = tmp_path_factory.mktemp("plain") / "tiny-base"
    shutil.copytree(tiny_model_dir, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def served(plain_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Path]]:
    log_path = tmp_path_factory.mktemp("operator") / "serve.log"
    args = ["--model", str(plain_model_dir), "--tp", "2", "--served-model-name", "tiny"]
    args += ["--max-slots", "4", "--kv-pages", "64", "--api-key", KEY, "--log-format", "json"]
    args += ["--stats-interval", str(STATS_INTERVAL_S)]
    with serve_process(args, log_path) as server:
        yield server, log_path


def _records(log_path: Path, event: str) -> list[dict]:
    return [record for record in json_records(log_path.read_text()) if record["event"] == event]


def _new_records(log_path: Path, event: str, seen: int, count: int, timeout_s: float = 10.0) -> list[dict]:
    """The ``count`` records of ``event`` after the first ``seen``: an access line follows the
    response's last byte, so the client may have read the response before the line is written."""
    deadline = time.monotonic() + timeout_s
    while len(records := _records(log_path, event)) < seen + count:
        assert time.monotonic() < deadline, f"{len(records) - seen} new {event} records, not {count}"
        time.sleep(0.02)
    return records[seen:]


def _complete(url: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def test_an_idle_server_writes_no_stats_and_no_access_lines(served: tuple[Served, Path]) -> None:
    _, log_path = served
    time.sleep(4 * STATS_INTERVAL_S)
    assert _records(log_path, "stats") == []
    assert _records(log_path, "request") == []  # the readiness probe of /health is logged at debug


def test_without_the_key_requests_are_refused_401_in_openai_shape(served: tuple[Served, Path]) -> None:
    server, log_path = served
    before = len(_records(log_path, "request"))
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    for key, message in [
        (None, "no API key given: send it as 'Authorization: Bearer KEY'"),
        ("sk-wrong", "incorrect API key"),
    ]:
        answer = _complete(server.url, body, key)
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
        assert answer.json() == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    basic = httpx.get(server.url + "/v1/models", headers={"Authorization": "Basic eDp5"}, timeout=10)
    assert basic.status_code == 401
    assert (
        basic.json()["error"]["message"] == "the Authorization header must use the Bearer scheme, got 'Basic'"
    )
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert metric(server.url, "phalanx_requests_rejected_total") == 3  # /metrics wants no key either
    assert _complete(server.url, body).status_code == 200
    statuses = [(r["path"], r["status"]) for r in _new_records(log_path, "request", before, 4)]
    assert statuses == [
        ("/v1/completions", 401),
        ("/v1/completions", 401),
        ("/v1/models", 401),
        ("/v1/completions", 200),
    ]


def test_the_printed_curl_line_uses_completions_without_a_chat_template(served: tuple[Served, Path]) -> None:
    server, _ = served
    hint = next(line for line in server.printed if line.startswith("try: "))
    assert f"curl {server.url}/v1/completions " in hint and '"Authorization: Bearer $PHALANX_API_KEY"' in hint
    done = subprocess.run(
        ["bash", "-c", hint.removeprefix("try: ") + " --silent --show-error"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PHALANX_API_KEY": KEY},
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] > 0


def test_a_streamed_response_is_logged_once_it_has_streamed(served: tuple[Served, Path]) -> None:
    server, log_path = served
    before = len(_records(log_path, "request"))
    body = {"prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True, "stream": True, "user": "alice"}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as answer:
        frames = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    (record,) = _new_records(log_path, "request", before, 1)
    assert (record["status"], record["prompt_tokens"], record["completion_tokens"]) == (200, 3, 5)
    assert 0 < record["ttft_ms"] <= record["total_ms"]
    assert record["user"] == "alice"


def test_load_writes_an_access_line_per_request_and_stats_lines_while_busy(
    served: tuple[Served, Path],
) -> None:
    server, log_path = served
    before = len(_records(log_path, "request"))
    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _complete(server.url, body), range(6)))
    took_s = time.monotonic() - started
    assert [answer.status_code for answer in answers] == [200] * 6
    time.sleep(3 * STATS_INTERVAL_S)  # the line after the burst, then silence

    access = _new_records(log_path, "request", before, 6)
    for record in access:
        assert (record["method"], record["path"], record["status"]) == ("POST", "/v1/completions", 200)
        assert (record["prompt_tokens"], record["completion_tokens"]) == (5, MAX_TOKENS)
        assert 0 < record["ttft_ms"] <= record["total_ms"] <= took_s * 1000 + 50
        assert record["level"] == "info" and record["rank"] == "coordinator"
        assert "user" not in record  # the request named none

    stats = _records(log_path, "stats")
    assert stats, "no stats line while six requests ran"
    assert any(s["running"] >= 1 and s["generation_tok_s"] > 0 for s in stats)
    assert sum(s["prompt_tok_s"] for s in stats) > 0
    for line in stats:
        assert set(line) >= {"prompt_tok_s", "generation_tok_s", "running", "waiting", "kv_used_pct", "slots"}
        assert 0 <= line["kv_used_pct"] <= 100 and re.fullmatch(r"[0-4]/4", line["slots"])
    assert stats[-1]["running"] == 0 and stats[-1]["generation_tok_s"] >= 0
    time.sleep(3 * STATS_INTERVAL_S)
    assert len(_records(log_path, "stats")) == len(stats)  # idle again: no more lines


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if re.search(rf"^PPid:\s+{pid}$", text, re.MULTILINE):
            found.append(int(status.parent.name))
    return found


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_the_server_and_its_ranks_are_titled_by_role(
    served: tuple[Served, Path], plain_model_dir: Path
) -> None:
    server, _ = served
    assert _title(server.process.pid) == "phalanx serve (tiny)"
    titles = sorted(_title(pid) for pid in _children(server.process.pid))
    ranks = [title for title in titles if title.startswith("phalanx rank")]
    assert ranks == [f"phalanx rank {rank}/2 ({plain_model_dir.name})" for rank in (0, 1)], titles


def test_every_line_on_stderr_is_one_json_record_without_a_traceback(served: tuple[Served, Path]) -> None:
    _, log_path = served
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), [x for x in lines if not x.startswith("{")]
    records = [json.loads(line) for line in lines]
    assert {record["rank"] for record in records} >= {"coordinator", 0, 1}
    assert any(record.get("logger", "").startswith("uvicorn") for record in records)
    assert not any("exception" in record or record["level"] == "error" for record in records)


def _generate(model_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "phalanx.tools",
        "generate",
        "--model",
        str(model_dir),
        "--prompt-ids",
        "1,2,3",
    ]
    return subprocess.run(
        [*argv, "--max-tokens", "3", *flags], cwd=REPO, capture_output=True, text=True, timeout=180
    )


def test_generate_logs_console_lines_when_verbose_and_nothing_when_quiet(tiny_model_dir: Path) -> None:
    verbose = _generate(tiny_model_dir, "--tp", "2", "--verbose")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    lines = verbose.stderr.splitlines()
    assert lines and all(CONSOLE_LINE.match(line) for line in lines), verbose.stderr[-3000:]
    assert {line.split()[3] for line in lines} >= {"coord", "r0", "r1"}
    assert [line for line in lines if "epoch" in line] == [next(x for x in lines if "executor serving" in x)]
    assert "Traceback" not in verbose.stderr
    quiet = _generate(tiny_model_dir, "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.strip() != ""
