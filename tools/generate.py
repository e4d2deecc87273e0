"""``phalanx generate``: one prompt through a freshly launched replica, printed as text or JSON.

Without ``--model`` it runs the embedded tiny demo model (built on first use into the user's
cache directory). Prompts are tokenized with the model directory's ``tokenizer.json``. Only
warnings and errors are logged (stderr) unless ``--verbose``; ``--quiet`` leaves errors alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from phalanx.config.replica import ParallelConfig
from phalanx.engine.engine import Engine, ErrorEvent, FinishEvent, GenerationParams, TokenEvent
from phalanx.executor.errors import ExecutorError
from phalanx.executor.model_info import read_model_info
from phalanx.protocol.logs import configure_logging
from phalanx.tools.launch_options import (
    add_launch_arguments,
    add_log_arguments,
    add_model_arguments,
    choose_launch,
    model_dir_problem,
    replica_config,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: the tiny demo model)"
    )
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=ParallelConfig.tp,
        help="tensor-parallel degree (ranks)",
    )
    add_model_arguments(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma separated (e.g. 1,2,3)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 keeps all)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables it")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens even past EOS")
    parser.add_argument("--json", action="store_true", help='print {"token_ids", "text", "finish_reason"}')
    chatter = parser.add_mutually_exclusive_group()
    chatter.set_defaults(log_level="warning")
    chatter.add_argument(
        "--verbose", dest="log_level", action="store_const", const="info", help="log info lines too (stderr)"
    )
    chatter.add_argument(
        "--quiet", dest="log_level", action="store_const", const="error", help="log errors only"
    )
    add_log_arguments(parser, level=False)
    add_launch_arguments(parser)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except ValueError as exc:
        print(f"phalanx generate: error: {exc}", file=sys.stderr)
        return 2
    except ExecutorError as exc:
        print(f"phalanx generate: error: the replica did not start: {exc}", file=sys.stderr)
        return 1


def _generate(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    if args.model is None:
        from phalanx.tools.demo_model import demo_model_dir

        model_dir = demo_model_dir()
    else:
        model_dir = args.model
    problem = model_dir_problem(model_dir)
    if problem is not None:
        raise ValueError(problem)
    choice = choose_launch(args, Path(model_dir))
    if args.prompt is not None:
        _check_utf8(args.prompt)
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prompt_ids = (
        parse_prompt_ids(args.prompt_ids) if args.prompt is None else tokenizer.encode(args.prompt).ids
    )
    params = GenerationParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    # refuse bad flags and impossible prompts before paying for a launch
    params.validate(read_model_info(model_dir).vocab_size)
    context = choice.max_model_len or read_model_info(model_dir).max_position_embeddings
    if len(prompt_ids) + params.max_tokens > context:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens plus max_tokens {params.max_tokens} exceeds the "
            f"model context of {context} tokens"
        )
    with Engine.start(replica_config(args, Path(model_dir), args.tp, choice)) as engine:
        events = list(engine.submit(prompt_ids, params))
    final = events[-1]
    if isinstance(final, ErrorEvent):
        print(f"phalanx generate: generation failed: {final.message}", file=sys.stderr)
        return 1
    if not isinstance(final, FinishEvent):
        raise RuntimeError(f"stream ended without a final event: {final!r}")
    token_ids = [event.token_id for event in events if isinstance(event, TokenEvent)]
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "finish_reason": final.reason}))
    else:
        print(text)
    return 0


def _check_utf8(prompt: str) -> None:
    """The shell passes bytes, and Python keeps those that are not UTF-8 as lone surrogates, which
    no tokenizer takes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"--prompt is not UTF-8 text: its character {e.start} is a byte that decodes to nothing"
        ) from None
