"""What the command line says about itself: ``--help`` with every flag's default, and ``--version``."""

from __future__ import annotations

import argparse
from importlib import metadata


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default in words.
    Switches (flags taking no value) are off by default and say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.option_strings
            and action.nargs != 0
            and action.default not in (None, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """Every phalanx parser and sub-parser (``add_subparsers`` makes them of this class too)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """``phalanx X``, then torch, triton, CUDA and the device this host would serve on."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        device = f"cuda: {count} x {torch.cuda.get_device_name(0)}"
    else:
        device = "cpu (no CUDA device visible)"
    return "\n".join(
        [
            f"phalanx {_version('phalanx')}",
            f"torch {torch.__version__}",
            f"triton {_version('triton')}",
            f"CUDA {torch.version.cuda or 'none (a CPU build of torch)'}",
            f"device {device}",
        ]
    )
