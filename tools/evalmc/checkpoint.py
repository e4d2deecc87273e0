"""The per-sample checkpoint: one JSON line per finished sample, appended and flushed as it lands.

A run is identified by its fingerprint (base URL, model, max_tokens, temperature). A checkpoint
written under another fingerprint is discarded, never mixed in. A line torn by a kill is cut off;
a corrupt line before the last one is reported and skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("eval_mc")


def fingerprint(base_url: str, model: str, max_tokens: int, temperature: float) -> dict[str, Any]:
    return {"base_url": base_url, "max_tokens": max_tokens, "model": model, "temperature": temperature}


def fingerprint_matches(config_path: Path, current: dict[str, Any]) -> bool:
    if not config_path.exists():
        return False
    try:
        saved = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    return json.dumps(saved, sort_keys=True) == json.dumps(current, sort_keys=True)


def write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, ensure_ascii=False, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def repair_jsonl_tail(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL checkpoint. A torn last line (a kill mid-write) is cut from the file; a
    corrupt line before it is reported and dropped."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    rows: list[dict[str, Any]] = []
    kept = bytearray()
    for n, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rows.append(json.loads(raw))
        except json.JSONDecodeError:
            what = "torn last line dropped" if n == len(lines) - 1 else "corrupt line dropped"
            log.warning(f"checkpoint {what}", path=str(path), line=n + 1)
            continue
        kept += raw if raw.endswith(b"\n") else raw + b"\n"
    if bytes(kept) != data:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(bytes(kept))
        os.replace(tmp, path)
    return rows


class Checkpoint:
    """Append-only JSONL of finished samples."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Replace the file with exactly ``rows`` (used on resume, after rescoring)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, self.path)

    def append(self, row: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
