"""Launch flags shared by ``phalanx serve`` and ``phalanx generate``: recording, attached ranks, the
log flags, and the model directory check both make before paying for a launch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from protocol.logs import LOG_FORMATS, LOG_LEVELS

DEVICE_HELP = "where the ranks run: cuda (one GPU per rank, bf16, NCCL) or cpu (float32, gloo)"


def model_dir_problem(model_dir: str | Path) -> str | None:
    """What keeps ``model_dir`` from being served (no such directory, not a directory, no
    tokenizer.json), or None. The ranks check the checkpoint itself when they load it."""
    path = Path(model_dir)
    if not path.exists():
        return f"model directory {model_dir} does not exist"
    if not path.is_dir():
        return f"model path {model_dir} is not a directory"
    if not (path / "tokenizer.json").is_file():
        return f"no tokenizer.json in model directory {model_dir}"
    return None


def add_max_slots_argument(parser: argparse.ArgumentParser) -> None:
    """``--max-slots``, with vLLM's name ``--max-num-seqs`` beside it."""
    parser.add_argument(
        "--max-slots",
        "--max-num-seqs",
        dest="max_slots",
        type=int,
        default=16,
        help="requests decoding at once (decode slots)",
    )


def add_log_arguments(parser: argparse.ArgumentParser, level: bool = True) -> None:
    """``--log-format``, and ``--log-level`` unless the command has its own way to set it."""
    if level:
        parser.add_argument(
            "--log-level",
            choices=LOG_LEVELS,
            default="info",
            help="the lowest level logged, by the coordinator, every rank and the HTTP server",
        )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="console",
        help="console: one short aligned line per record; json: one JSON object per line (log shippers)",
    )


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record", help="append every protocol frame to this trace (see phalanx replay; default: none)"
    )
    parser.add_argument(
        "--no-pipeline",
        dest="pipeline",
        action="store_false",
        help="read each decode step's result before sending the next (default: the next step is "
        "sent first, so the GPU never waits for the round trip)",
    )
    parser.add_argument(
        "--attach",
        metavar="tcp://HOST:PORT",
        type=_attach_address,
        help="do not spawn ranks: bind here and wait for --tp ranks started elsewhere "
        "(torchrun/SLURM running `phalanx worker --coordinator tcp://HOST:PORT`); "
        "both sides need the same PHALANX_SECRET (default: spawn the ranks here)",
    )


def parse_attach_address(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); anything else is a ValueError naming the flag."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"--attach expects tcp://HOST:PORT, got {address!r}")
    return parts.hostname, port


def _attach_address(address: str) -> tuple[str, int]:
    try:
        return parse_attach_address(address)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def executor_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ExecutorConfig fields these flags set (passed as EngineConfig.executor_options)."""
    options: dict[str, Any] = {"log_level": args.log_level, "log_format": args.log_format}
    if args.record:
        options["record"] = args.record
    if args.attach:
        host, port = args.attach
        options.update(transport="tcp", attach=True, host=host, port=port)
    return options
