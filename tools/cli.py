"""The ``phalanx`` command line. Each subcommand lives in its own module under ``tools/`` (``bench``
and ``replay``: a package, whose ``cli.py`` holds its own subcommands).

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their subcommand runs, so ``phalanx generate`` never pays for the server.

Ctrl-C and SIGTERM unwind a subcommand (its replica shut down, its temporary files removed) and
end it with one line and the shell's codes, 130 and 143, instead of a traceback or a death without
cleanup. ``phalanx serve`` answers both itself, with an orderly stop and exit 0.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from phalanx.tools.cli_help import ArgumentParser, version_text
from phalanx.tools.stop_signals import StopSignal, stop_signals_raise

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("phalanx.tools.serve", "OpenAI-compatible server (the embedded tiny demo model by default)"),
    "generate": ("phalanx.tools.generate", "generate a completion for one prompt"),
    "worker": ("phalanx.tools.worker", "run one rank (for torchrun / SLURM launches)"),
    "replay": ("phalanx.tools.replay.cli", "show, summarise, re-run or diff a recorded protocol trace"),
    "bench": ("phalanx.tools.bench.cli", "benchmarks: decode, serve, round trip, sharded load"),
    "eval-mc": ("phalanx.tools.eval_mc", "multiple-choice accuracy over the chat completions API"),
    "make-tiny-model": ("phalanx.tools.make_tiny_model", "write a tiny random Qwen3.5 checkpoint"),
    "make-random-model": (
        "phalanx.tools.random_checkpoint",
        "write a random Qwen3.5 checkpoint of a real size",
    ),
}


def _usage() -> str:
    lines = ["usage: phalanx COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<16} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += [
        f"  {'help [COMMAND]':<16} this list, or one command's flags and their defaults",
        "",
        "options:",
        f"  {'--version':<16} phalanx, torch, triton and CUDA versions and the device",
    ]
    return "\n".join(lines)


def command_parser(name: str) -> argparse.ArgumentParser:
    module_name, help_text = SUBCOMMANDS[name]
    parser = ArgumentParser(prog=f"phalanx {name}", description=help_text)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def _unknown(name: str) -> int:
    print(f"phalanx: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv == ["help"]:
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(version_text())
        return 0
    if argv[0] == "help":  # phalanx help serve == phalanx serve --help
        argv = [*argv[1:], "--help"]
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        return _unknown(name)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    args = command_parser(name).parse_args(rest)
    try:
        with stop_signals_raise():
            return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"phalanx {name}: interrupted", file=sys.stderr)
        return 130
    except StopSignal as stop:
        print(f"phalanx {name}: stopped by {stop}", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
