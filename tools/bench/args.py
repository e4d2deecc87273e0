"""Argument types the benchmarks share: counts with a floor, durations, and lists of TP degrees.
Each refuses a bad value as an argparse error that names the flag, before any work starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def integer_at_least(text: str, minimum: int, meaning: str | None = None) -> int:
    """``text`` as an integer of at least ``minimum``; ``meaning`` words the floor in the error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {meaning or f'an integer >= {minimum}'}, got {value}")
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers of at least ``minimum`` (a count of steps, rows, calls)."""

    def parse(text: str) -> int:
        return integer_at_least(text, minimum)

    return parse


def milliseconds(text: str) -> float:
    """A duration in milliseconds, zero or more (``--arrival-ms``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 ms or more, got {text}")
    return value


def tp_degrees(text: str) -> list[int]:
    """``--tp 1,2,4``: the tensor-parallel degrees to measure."""
    try:
        degrees = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not degrees or min(degrees) < 1:
        raise argparse.ArgumentTypeError(f"needs TP degrees of at least 1, got {text!r}")
    return degrees
