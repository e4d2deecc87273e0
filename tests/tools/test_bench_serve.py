"""``phalanx bench serve`` against a real server: every request completes, the JSON is consistent."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
from pathlib import Path

import httpx

from phalanx.tools.bench import serve as bench_serve
from phalanx.tools.cli import main as phalanx
from tests.support.live_server import serve_process


def test_bench_serve_against_the_demo_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``phalanx serve`` with no --model: the demo model (here already in the cache) at TP 2,
    and the curl line it prints works; then the benchmark runs against it."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_model_dir, cache / "phalanx" / "tiny-demo")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    out = tmp_path / "bench.json"
    with serve_process([], tmp_path / "server.log", env=env) as served:
        base_url, printed = served.url, served.printed
        assert f"phalanx serving 'tiny-demo' (tp=2, cpu, float32, eager decode) on {base_url}" in printed
        curl = shlex.split(
            next(line for line in printed if line.startswith("try: curl ")).removeprefix("try: ")
        )
        assert curl[1] == base_url + "/v1/chat/completions"
        reply = httpx.post(
            curl[1], content=curl[curl.index("-d") + 1], headers={"Content-Type": "application/json"}
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        argv = ["bench", "serve", "--base-url", base_url, "--concurrency", "4", "--num-prompts", "8"]
        argv += ["--input-len", "24"]
        assert phalanx([*argv, "--output-len", "6", "--out", str(out)]) == 0
        text_out = tmp_path / "bench_text.json"
        assert phalanx([*argv, "--output-len", "3", "--prompt-kind", "text", "--out", str(text_out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-demo"
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
