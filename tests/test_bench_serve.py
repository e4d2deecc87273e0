"""``phalanx bench serve`` against a real server: every request completes, the JSON is consistent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from live_server import MODEL_NAME, live_server

from tools import bench_serve
from tools.cli import main as phalanx


def test_bench_serve_against_live_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with live_server(tiny_model_dir, tmp_path / "server.log") as base_url:
        argv = ["bench", "serve", "--base-url", base_url, "--concurrency", "4", "--num-prompts", "8"]
        argv += ["--input-len", "24"]
        assert phalanx([*argv, "--output-len", "6", "--out", str(out)]) == 0
        text_out = tmp_path / "bench_text.json"
        assert phalanx([*argv, "--output-len", "3", "--prompt-kind", "text", "--out", str(text_out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == MODEL_NAME
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (8, 0, 48)
    assert result["output_tokens_per_s"] > 0
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < result[name]["p50"] <= result[name]["p99"]
    # ITL p50 can not exceed the slowest request's whole decode; TTFT is part of the latency
    assert result["ttft_ms"]["mean"] < result["latency_ms"]["mean"]
    assert json.loads(text_out.read_text())["total_output_tokens"] == 24


def test_bench_serve_reports_an_unreachable_server(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "x.json")])
    assert bench_serve.run(args) == 1
