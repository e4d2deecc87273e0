"""Reading what ``--log-format json`` (or ``log_format="json"``) wrote: one JSON object a line."""

from __future__ import annotations

import json
from typing import Any


def json_records(text: str) -> list[dict[str, Any]]:
    """Every log record in ``text``; lines that are not JSON objects (prints, tqdm bars) are skipped."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def rank_records(text: str, rank: int) -> list[dict[str, Any]]:
    return [record for record in json_records(text) if record.get("rank") == rank]
