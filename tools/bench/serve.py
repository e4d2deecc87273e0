"""``phalanx bench serve``: latency and throughput of a running OpenAI-compatible server.

Sends ``--num-prompts`` random prompts (token ids by default, or random words) to
``/v1/completions`` with streaming, at most ``--concurrency`` in flight, each generating exactly
``--output-len`` tokens (``ignore_eos``). Reports TTFT (arrival of the first token), TPOT (mean
time per output token after the first, per request), ITL (every gap between streamed tokens),
p50/p99 and output tokens/s, and writes them as JSON.

``--response-format json_object`` or ``--guided-json SCHEMA_FILE`` constrains every request's
output, to measure what a grammar costs per token. The length stays fixed: once a grammar is
complete the server allows only end-of-sequence tokens, which ``ignore_eos`` runs on through to
``--output-len``; they carry no text, so ``mean_text_tokens`` (streamed tokens that carried text)
says how many tokens were written under the grammar.
Prefix-cache workloads: ``--shared-prefix-len N`` starts every prompt with the same N random
tokens (a system prompt), the other ``--input-len - N`` drawn per prompt. ``--turns K`` makes each
prompt a conversation of K requests in turn: the next prompt is the previous one, its reply and as
many new tokens as the first prompt's own part (with token ids the server returns no reply ids,
so the reply's place holds as many random ids; with text it is the reply's text). TTFT is then
also reported for the first turns and the later ones apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from phalanx.tools.bench.args import at_least

WORDS = [
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "number",
]


@dataclass
class RequestResult:
    ok: bool
    latency_s: float = 0.0
    ttft_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    text_tokens: int = 0  # streamed tokens that carried text
    output_tokens: int = 0
    error: str = ""
    text: str = ""  # the streamed reply
    turn: int = 0  # the request's place in its conversation (0: the first prompt)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server address (with or without /v1)"
    )
    parser.add_argument("--model", default=None, help="model id (default: the server's first model)")
    parser.add_argument("--concurrency", type=at_least(1), default=8, help="requests in flight at once")
    parser.add_argument("--num-prompts", type=at_least(1), default=64, help="requests sent in all")
    parser.add_argument(
        "--input-len", type=at_least(1), default=128, help="prompt tokens (words with --prompt-kind text)"
    )
    parser.add_argument(
        "--output-len", type=at_least(1), default=128, help="tokens generated per request (ignore_eos)"
    )
    parser.add_argument(
        "--prompt-kind", choices=("ids", "text"), default="ids", help="random token ids, or random text"
    )
    parser.add_argument(
        "--shared-prefix-len",
        type=at_least(0),
        default=0,
        help="tokens (words with --prompt-kind text) every prompt starts with, the same for all",
    )
    parser.add_argument(
        "--turns",
        type=at_least(1),
        default=1,
        help="requests per conversation: each next prompt is the last one, its reply and new tokens",
    )
    parser.add_argument("--max-id", type=int, default=256, help="random token ids are drawn from [0, max-id)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the random prompts")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    constrained = parser.add_mutually_exclusive_group()
    constrained.add_argument(
        "--response-format",
        choices=("json_object",),
        help="constrain every request's output to JSON (default: none, unconstrained)",
    )
    constrained.add_argument(
        "--guided-json",
        type=Path,
        metavar="SCHEMA_FILE",
        help="constrain every request to this JSON schema (default: none, unconstrained)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-serve.json"), help="JSON result file")


def _api(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


Prompt = list[int] | str


def constraint_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields that constrain the output, from the flags (none by default); raises
    OSError or ValueError for a schema file that cannot be read as JSON."""
    if args.response_format is not None:
        return {"response_format": {"type": args.response_format}}
    if args.guided_json is not None:
        return {"guided_json": json.loads(args.guided_json.read_text(encoding="utf-8"))}
    return {}


def request_body(model: str, prompt: Prompt, output_len: int, constraint: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **constraint,
    }


def _random_part(rng: random.Random, args: argparse.Namespace, length: int) -> Prompt:
    if args.prompt_kind == "ids":
        return [rng.randrange(args.max_id) for _ in range(length)]
    return " ".join(rng.choice(WORDS) for _ in range(length))


def _joined(*parts: Prompt) -> Prompt:
    """Token id lists concatenated, or texts joined by a space."""
    if isinstance(parts[0], str):
        return " ".join(part for part in parts if part)  # type: ignore[misc]
    return [token for part in parts for token in part]  # type: ignore[union-attr]


def make_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The first prompt of each conversation: the shared prefix, then its own random part."""
    if args.shared_prefix_len > args.input_len:
        raise ValueError(
            f"--shared-prefix-len {args.shared_prefix_len} is longer than --input-len {args.input_len}"
        )
    rng = random.Random(args.seed)
    shared = _random_part(rng, args, args.shared_prefix_len)
    own = args.input_len - args.shared_prefix_len
    return [_joined(shared, _random_part(rng, args, own)) for _ in range(args.num_prompts)]


def next_turn(rng: random.Random, args: argparse.Namespace, prompt: Prompt, reply: RequestResult) -> Prompt:
    """The conversation's next prompt: the last one, the reply, then new tokens as many as a
    first prompt's own part (at least one)."""
    if isinstance(prompt, str):
        answer: Prompt = reply.text.strip()
    else:
        answer = [rng.randrange(args.max_id) for _ in range(reply.output_tokens)]
    return _joined(prompt, answer, _random_part(rng, args, max(args.input_len - args.shared_prefix_len, 1)))


async def one_request(client: httpx.AsyncClient, api: str, body: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", f"{api}/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if any(c.get("finish_reason") is None for c in event.get("choices", [])):
                    result.token_times.append(time.perf_counter() - start)
                    result.text_tokens += any(c.get("text") for c in event["choices"])
                result.text += "".join(c.get("text", "") for c in event.get("choices", []))
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency_s = time.perf_counter() - start
    result.ttft_s = result.token_times[0] if result.token_times else result.latency_s
    result.ok = result.output_tokens > 0
    result.error = "" if result.ok else "no tokens"
    return result


async def run_benchmark(
    args: argparse.Namespace, model: str, prompts: list[Prompt], constraint: dict[str, Any]
) -> tuple[list[RequestResult], float]:
    """Every conversation's turns in order, at most ``--concurrency`` conversations at once."""
    api = _api(args.base_url)
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        async def conversation(index: int, prompt: Prompt) -> list[RequestResult]:
            rng = random.Random(f"{args.seed}:{index}")
            results = []
            async with gate:
                for turn in range(args.turns):
                    body = request_body(model, prompt, args.output_len, constraint)
                    result = await one_request(client, api, body)
                    result.turn = turn
                    results.append(result)
                    bar.update(1)
                    if not result.ok:
                        break
                    prompt = next_turn(rng, args, prompt, result)
            return results

        with tqdm(total=len(prompts) * args.turns, desc="bench serve", unit="req") as bar:
            started = time.perf_counter()
            done = await asyncio.gather(*(conversation(i, p) for i, p in enumerate(prompts)))
            return [result for results in done for result in results], time.perf_counter() - started


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ms = np.asarray(values) * 1000.0
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
    }


def summarise(
    args: argparse.Namespace, model: str, results: list[RequestResult], duration_s: float
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in done)
    by_turn = {}
    if args.turns > 1:
        by_turn = {
            "ttft_ms_first_turn": _stats_ms([r.ttft_s for r in done if r.turn == 0]),
            "ttft_ms_later_turns": _stats_ms([r.ttft_s for r in done if r.turn > 0]),
        }
    return {
        "base_url": args.base_url,
        "model": model,
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prompt_kind": args.prompt_kind,
        "response_format": args.response_format,
        "guided_json": None if args.guided_json is None else str(args.guided_json),
        "shared_prefix_len": args.shared_prefix_len,
        "turns": args.turns,
        "completed": len(done),
        "failed": args.num_prompts * args.turns - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration_s,
        "total_output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(done) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": _stats_ms([r.ttft_s for r in done]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms(itl),
        "latency_ms": _stats_ms([r.latency_s for r in done]),
        "mean_output_tokens": statistics.fmean([r.output_tokens for r in done]) if done else 0.0,
        "mean_text_tokens": statistics.fmean([r.text_tokens for r in done]) if done else 0.0,
        **by_turn,
    }


def _first_model(base_url: str) -> str:
    response = httpx.get(_api(base_url) + "/models", timeout=30.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    try:
        prompts = make_prompts(args)
    except ValueError as e:
        print(f"phalanx bench serve: {e}", file=sys.stderr)
        return 2
    try:
        constraint = constraint_fields(args)
    except (OSError, ValueError) as e:
        print(f"phalanx bench serve: --guided-json: {e}", file=sys.stderr)
        return 2
    try:
        model = args.model or _first_model(args.base_url)
    except httpx.HTTPError as e:
        print(f"phalanx bench serve: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 1
    results, duration_s = asyncio.run(run_benchmark(args, model, prompts, constraint))
    summary = summarise(args, model, results, duration_s)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"{summary['completed']}/{args.num_prompts * args.turns} requests in {duration_s:.2f} s at concurrency"
        f" {args.concurrency}: {summary['output_tokens_per_s']:.1f} output tok/s"
    )
    timings = ("ttft_ms", "tpot_ms", "itl_ms", "ttft_ms_first_turn", "ttft_ms_later_turns")
    for name in (name for name in timings if name in summary):
        s = summary[name]
        print(f"  {name:<19} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p99 {s['p99']:9.2f}")
    if constraint:
        print(
            f"  constrained: {summary['mean_text_tokens']:.1f} of {summary['mean_output_tokens']:.1f}"
            " tokens a request carried text (end-of-sequence tokens after a completed grammar carry none)"
        )
    print(f"result: {args.out}")
    return 0 if summary["failed"] == 0 else 1
