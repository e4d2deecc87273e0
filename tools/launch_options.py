"""Launch flags shared by ``phalanx serve`` and ``phalanx generate``: recording and attached ranks."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", help="append every protocol frame to this trace (see phalanx replay)")
    parser.add_argument(
        "--attach",
        metavar="tcp://HOST:PORT",
        type=_attach_address,
        help="do not spawn ranks: bind here and wait for --tp ranks started elsewhere "
        "(torchrun/SLURM running `phalanx worker --coordinator tcp://HOST:PORT`); "
        "both sides need the same PHALANX_SECRET",
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
    options: dict[str, Any] = {}
    if args.record:
        options["record"] = args.record
    if args.attach:
        host, port = args.attach
        options.update(transport="tcp", attach=True, host=host, port=port)
    return options
