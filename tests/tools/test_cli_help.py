"""What the command line says about itself: ``phalanx --version``, ``phalanx help [COMMAND]``,
every flag of every subcommand with help text and its default, and vLLM's names for the flags
that mean what vLLM's do."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from phalanx.tools.cli import SUBCOMMANDS, command_parser, main


def _parsers(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    return [found for name in SUBCOMMANDS for found in _parsers(command_parser(name), name)]


def test_version_names_phalanx_torch_triton_cuda_and_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["phalanx", "torch", "triton", "CUDA", "device"]
    assert lines[0] == "phalanx 0.1.0" and lines[1] == f"torch {torch.__version__}"
    if not torch.cuda.is_available():
        assert lines[3] == "CUDA none (a CPU build of torch)" or lines[3] == f"CUDA {torch.version.cuda}"
        assert lines[4] == "device cpu (no CUDA device visible)"
    else:
        assert lines[4].startswith(f"device cuda: {torch.cuda.device_count()} x ")


def test_help_lists_the_commands_and_help_command_shows_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help"]) == 0
    listing = capsys.readouterr().out
    assert all(f"\n  {name} " in listing for name in SUBCOMMANDS) and "--version" in listing
    with pytest.raises(SystemExit) as exit_info:
        main(["help", "serve"])
    assert exit_info.value.code == 0
    serve_help = capsys.readouterr().out
    assert serve_help.startswith("usage: phalanx serve ") and "(default: 8000)" in serve_help
    assert main(["help", "nonsense"]) == 2
    assert "phalanx: unknown command 'nonsense'" in capsys.readouterr().err


@pytest.mark.parametrize(("path", "parser"), _every_parser(), ids=lambda value: str(value).replace(" ", "-"))
def test_every_flag_has_help_text_and_shows_its_default(path: str, parser: argparse.ArgumentParser) -> None:
    text = " ".join(parser.format_help().split())  # argparse wraps lines; compare words
    in_required_group = {
        a for group in parser._mutually_exclusive_groups if group.required for a in group._group_actions
    }
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"phalanx {path}: {name} has no help text"
        takes_value = action.option_strings and action.nargs != 0
        if not takes_value or action.required or action in in_required_group:
            continue
        if action.default is None:
            assert "default" in action.help, f"phalanx {path}: {name} does not say what its default is"
        else:
            assert f"(default: {action.default})" in text or "default" in action.help, (
                f"phalanx {path}: {name}'s default {action.default!r} is not shown"
            )


def test_vllm_names_are_aliases_of_ours() -> None:
    serve = command_parser("serve").parse_args(["--tensor-parallel-size", "2", "--max-num-seqs", "4"])
    assert (serve.tp, serve.max_slots) == (2, 4)
    generate = command_parser("generate").parse_args(["--tensor-parallel-size", "2", "--prompt", "x"])
    assert generate.tp == 2 and generate.log_level == "warning"
    worker = command_parser("worker").parse_args(["--model", "m", "--max-num-seqs", "8"])
    assert worker.max_slots == 8
    batched = command_parser("serve").parse_args(["--max-num-batched-tokens", "4096"])
    assert batched.max_batch_tokens == 4096
    assert command_parser("serve").parse_args([]).max_batch_tokens == 0  # the rank picks it


def test_max_batch_tokens_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        command_parser("serve").parse_args(["--max-batch-tokens", "0"])
    err = capsys.readouterr().err
    assert "argument --max-batch-tokens/--max-num-batched-tokens: must be a positive integer, got '0'" in err


def test_generate_logs_warnings_unless_verbose_and_errors_only_when_quiet() -> None:
    parser = command_parser("generate")
    assert parser.parse_args(["--prompt", "x", "--verbose"]).log_level == "info"
    assert parser.parse_args(["--prompt", "x", "--quiet"]).log_level == "error"
    with pytest.raises(SystemExit):
        parser.parse_args(["--prompt", "x", "--quiet", "--verbose"])
