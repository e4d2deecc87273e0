"""``phalanx bench serve --response-format json_object`` / ``--guided-json SCHEMA_FILE``: every
request carries the constraint beside the fixed length (``ignore_eos``), and the JSON result
records the option; no server needed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from phalanx.tools.bench import serve as bench_serve

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(flags))


def _body(args: argparse.Namespace) -> dict:
    return bench_serve.request_body("m", [1, 2], args.output_len, bench_serve.constraint_fields(args))


def test_an_unconstrained_request_has_no_constraint() -> None:
    body = _body(_args("--output-len", "7"))
    assert body == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 7,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_json_object_constrains_every_request_at_the_fixed_length() -> None:
    args = _args("--response-format", "json_object", "--output-len", "9")
    body = _body(args)
    assert body["response_format"] == {"type": "json_object"}
    assert (body["max_tokens"], body["ignore_eos"]) == (9, True)
    summary = bench_serve.summarise(args, "m", [], 1.0)
    assert (summary["response_format"], summary["guided_json"]) == ("json_object", None)


def test_guided_json_sends_the_schema_files_schema(tmp_path: Path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    args = _args("--guided-json", str(schema_file))
    body = _body(args)
    assert body["guided_json"] == SCHEMA and "response_format" not in body and body["ignore_eos"]
    summary = bench_serve.summarise(args, "m", [], 1.0)
    assert (summary["response_format"], summary["guided_json"]) == (None, str(schema_file))


def test_the_two_constraints_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("--response-format", "json_object", "--guided-json", "x.json")
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_schema_file_that_is_not_json_is_refused_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    # the address is unreachable: a request sent would fail otherwise (exit 1), not exit 2
    args = _args("--guided-json", str(bad), "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "o"))
    assert bench_serve.run(args) == 2
    assert capsys.readouterr().err.startswith("phalanx bench serve: --guided-json: Expecting property name")
    args.guided_json = tmp_path / "missing.json"
    assert bench_serve.run(args) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_the_text_tokens_count_the_streamed_tokens_that_carried_text() -> None:
    done = bench_serve.RequestResult(ok=True, latency_s=1.0, ttft_s=0.1, output_tokens=4, text_tokens=3)
    summary = bench_serve.summarise(_args(), "m", [done], 1.0)
    assert (summary["mean_output_tokens"], summary["mean_text_tokens"]) == (4, 3)
