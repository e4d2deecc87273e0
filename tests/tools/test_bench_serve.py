"""``phalanx bench serve`` against a real server: every request completes, the JSON is consistent."""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
from pathlib import Path

import httpx

from phalanx.tools.bench import serve as bench_serve
from phalanx.tools.cli import main as phalanx
from tests.support.live_server import metric, serve_process


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
        chat_out = tmp_path / "bench_chat.json"
        chat = ["--output-len", "2", "--shared-prefix-len", "16", "--turns", "3", "--prompt-kind", "text"]
        assert phalanx([*argv, *chat, "--out", str(chat_out)]) == 0
        hits = metric(base_url, "phalanx_prefix_cache_hits_total")
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-demo"
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (8, 0, 48)
    assert result["output_tokens_per_s"] > 0
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < result[name]["p50"] <= result[name]["p99"]
    # ITL p50 can not exceed the slowest request's whole decode; TTFT is part of the latency
    assert result["ttft_ms"]["mean"] < result["latency_ms"]["mean"]
    assert json.loads(text_out.read_text())["total_output_tokens"] == 24
    chat_result = json.loads(chat_out.read_text())
    assert (chat_result["completed"], chat_result["failed"], chat_result["turns"]) == (24, 0, 3)
    assert chat_result["ttft_ms_first_turn"]["p50"] > 0 and chat_result["ttft_ms_later_turns"]["p50"] > 0
    assert hits >= 16  # every later turn restores at least its conversation's last prompt


def test_bench_serve_reports_an_unreachable_server(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "x.json")])
    assert bench_serve.run(args) == 1


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_shared_prefix_prompts_share_exactly_their_first_tokens() -> None:
    prompts = bench_serve.make_prompts(
        _args("--num-prompts", "5", "--input-len", "40", "--shared-prefix-len", "32")
    )
    assert all(len(prompt) == 40 for prompt in prompts)
    assert len({tuple(prompt[:32]) for prompt in prompts}) == 1
    assert len({tuple(prompt[32:]) for prompt in prompts}) == 5
    assert (
        len(
            {
                tuple(p[:32])
                for p in bench_serve.make_prompts(_args("--num-prompts", "5", "--input-len", "40"))
            }
        )
        == 5
    )
    texts = bench_serve.make_prompts(
        _args("--prompt-kind", "text", "--num-prompts", "3", "--input-len", "12", "--shared-prefix-len", "12")
    )
    assert len(set(texts)) == 1 and len(texts[0].split()) == 12


def test_a_next_turn_is_the_last_prompt_its_reply_and_new_tokens() -> None:
    args = _args("--input-len", "10", "--shared-prefix-len", "6", "--output-len", "4")
    rng = random.Random(0)
    prompt = [1] * 10
    reply = bench_serve.RequestResult(ok=True, output_tokens=4, text=" four words of reply")
    following = bench_serve.next_turn(rng, args, prompt, reply)
    assert following[:10] == prompt and len(following) == 10 + 4 + 4
    text_args = _args("--prompt-kind", "text", "--input-len", "3")
    text = bench_serve.next_turn(rng, text_args, "a b c", reply)
    assert text.startswith("a b c four words of reply ") and len(text.split()) == 3 + 4 + 3


def test_a_shared_prefix_longer_than_the_prompt_is_refused(tmp_path: Path, capsys) -> None:
    args = _args("--input-len", "8", "--shared-prefix-len", "9", "--out", str(tmp_path / "x.json"))
    assert bench_serve.run(args) == 2
    assert "--shared-prefix-len 9 is longer than --input-len 8" in capsys.readouterr().err
