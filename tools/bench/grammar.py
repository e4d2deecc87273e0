"""``phalanx bench grammar``: what structured output costs rank 0 per decode step, on the CPU.

Builds a byte-level tokenizer of ``--vocab`` tokens (Qwen3.5's 248,320 by default: the 256 bytes,
then random lower-case pieces, a third of them after a space), offers it to llguidance as the
worker does (``worker/grammar.py``), and runs ``--batch`` requests under a tool-call grammar (a
``<tool_call>`` block whose JSON follows a small schema) step by step: each step builds the rows'
masks, picks every row's token from logits under its mask (``draw_tokens``, as rank 0 samples) and
advances the matchers. Reported beside it: the same pick without a grammar (on the CPU both picks
are dominated by sorting the vocabulary; the masks are the work a grammar adds, and on CUDA they are
built while the step's forward runs). Times are medians over ``--steps`` steps; every grammar
restarts when it completes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from phalanx.protocol.messages import SamplingParams
from phalanx.server.detokenizer import _BYTE_OF_CHAR as BYTE_OF_CHAR  # GPT-2's byte alphabet
from phalanx.server.structured import GrammarCheck, tool_call_grammar
from phalanx.tools.bench.args import at_least
from phalanx.worker.grammar import GrammarTable
from phalanx.worker.sampling import draw_tokens

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vocab", type=at_least(512), default=248_320, help="tokenizer size (default Qwen3.5's)"
    )
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=at_least(1), default=200, help="timed steps per batch size")
    parser.add_argument("--json", type=Path, help="also write the rows to this file (default: none)")


def _tokenizer_dir(vocab: int, root: Path) -> Path:
    """A byte-level BPE tokenizer.json with ``vocab`` tokens (no merges: only its pieces matter)."""
    char_of_byte = {byte: char for char, byte in BYTE_OF_CHAR.items()}
    rng = random.Random(0)
    pieces = {char_of_byte[b]: b for b in range(256)}
    while len(pieces) < vocab - 1:
        text = (" " if rng.random() < 0.33 else "") + "".join(
            rng.choice(string.ascii_lowercase) for _ in range(rng.choice([2, 3, 4, 5, 6, 8]))
        )
        pieces.setdefault("".join(char_of_byte[b] for b in text.encode()), len(pieces))
    tokenizer = Tokenizer(models.BPE(vocab=pieces, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(root / "tokenizer.json"))
    return root


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _run_batch(table: GrammarTable, grammar: str, batch: int, vocab: int, steps: int, eos: int) -> dict:
    ids = list(range(1, batch + 1))
    for request_id in ids:
        table.start(request_id, grammar)
    params = [SamplingParams(temperature=1.0, seed=i) for i in ids]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    masks, picks, plain = [], [], []
    for step in range(steps):
        started = time.perf_counter()
        allowed = table.allowed(ids, torch.device("cpu"))
        masked = time.perf_counter()
        drawn = draw_tokens(logits, params, [step] * batch, allowed=allowed)
        tokens = drawn.to_host()
        table.defer(ids, drawn)
        table.advance_deferred()  # the worker feeds them at the next mask; counted with the pick here
        picks.append(time.perf_counter() - masked)
        masks.append(masked - started)
        started = time.perf_counter()
        draw_tokens(logits, params, [step] * batch).to_host()
        plain.append(time.perf_counter() - started)
        for request_id, sample in zip(ids, tokens, strict=True):
            if sample.token == eos:  # complete: start the next call
                table.drop(request_id)
                table.start(request_id, grammar)
    return {
        "batch": batch,
        "mask_us": _median_us(masks),
        "constrained_pick_us": _median_us(picks),
        "plain_pick_us": _median_us(plain),
    }


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = _tokenizer_dir(args.vocab, Path(tmp))
        eos = args.vocab - 1
        grammar = tool_call_grammar([TOOL], ["get_weather"], GrammarCheck(model_dir, args.vocab, (eos,)))
        table = GrammarTable(model_dir, args.vocab, (eos,))
        table.start(0, grammar)  # builds the tokenizer once, as rank 0's first grammar does
        print(
            f"vocab {args.vocab}: tokenizer and first grammar ready in {time.perf_counter() - started:.1f} s"
        )
        print(f"{'batch':>5} {'masks µs':>9} {'per row µs':>11} {'masked pick µs':>15} {'plain pick µs':>14}")
        rows = []
        for batch in [int(b) for b in args.batch.split(",")]:
            row = _run_batch(table, grammar, batch, args.vocab, args.steps, eos)
            print(
                f"{batch:>5} {row['mask_us']:>9.0f} {row['mask_us'] / batch:>11.0f} "
                f"{row['constrained_pick_us']:>15.0f} {row['plain_pick_us']:>14.0f}"
            )
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"vocab": args.vocab, "rows": rows}, indent=2))
    return 0
