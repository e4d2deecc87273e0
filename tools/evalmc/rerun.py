"""Rerunning the rows a finished run left without an answer (cut off, or an API error) with a
larger token budget, and merging them into the run's samples.

The model must be the one of the original run and the temperature is taken from it; only the
token budget changes. The rerun has its own checkpoint, resumed under the same rules as a run.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog

from phalanx.tools.evalmc.checkpoint import (
    Checkpoint,
    fingerprint,
    fingerprint_matches,
    repair_jsonl_tail,
    write_json_atomic,
)
from phalanx.tools.evalmc.client import ChatSettings
from phalanx.tools.evalmc.data import Item
from phalanx.tools.evalmc.runner import RunFiles, ask_all, recover, summarise

log = structlog.get_logger("eval_mc")


class RerunError(RuntimeError):
    """The rerun cannot proceed against this output directory."""


def _needs_rerun(row: dict[str, Any]) -> bool:
    return bool(row["truncated"]) or row["error"] is not None


def _item_of(row: dict[str, Any]) -> Item:
    return Item(row["id"], row["subject"], "", tuple(row["options"]), row["answer"])


def rerun_truncated(
    files: RunFiles, model: str | None, max_tokens: int, concurrency: int, timeout_s: float, attempts: int
) -> dict[str, Any]:
    if not files.summary.exists() or not files.samples.exists():
        raise RerunError(
            f"no finished run of {files.bench} in {files.out_dir} (run eval-mc without --rerun-truncated first)"
        )
    summary = json.loads(files.summary.read_text(encoding="utf-8"))
    base = json.loads(files.samples.read_text(encoding="utf-8"))
    original = summary["fingerprint"]
    if model is not None and model != original["model"]:
        raise RerunError(f"--model {model!r} differs from the original run's model {original['model']!r}")
    settings = ChatSettings(
        original["base_url"], original["model"], max_tokens, original["temperature"], attempts
    )

    current = fingerprint(settings.base_url, settings.model, max_tokens, settings.temperature)
    if not fingerprint_matches(files.rerun_config, current):
        files.rerun_partial.unlink(missing_ok=True)
        write_json_atomic(files.rerun_config, current)
    prompts = [row["prompt"] for row in base]
    checkpoint = Checkpoint(files.rerun_partial)
    targets = [i for i, row in enumerate(base) if _needs_rerun(row)]
    done = {
        i: row for i, row in recover(repair_jsonl_tail(files.rerun_partial), prompts).items() if i in targets
    }
    checkpoint.rewrite([done[i] for i in sorted(done)])
    todo = [(i, _item_of(base[i]), prompts[i]) for i in targets if i not in done]
    log.info("eval-mc rerun", bench=files.bench, targets=len(targets), recovered=len(done), todo=len(todo))
    for row in asyncio.run(
        ask_all(todo, settings, concurrency, timeout_s, checkpoint, f"{files.bench} rerun")
    ):
        done[row["idx"]] = row

    merged = list(base)
    still_failing = 0
    for i in targets:
        row = done[i]
        failed = _needs_rerun(row)
        still_failing += failed
        merged[i] = {**row, "rerun": True, "rerun_failed": failed}
    write_json_atomic(files.merged, merged)
    merged_summary = summarise(files.bench, merged)
    summary.update(
        acc_merged=merged_summary["acc"],
        rerun_n=len(targets),
        still_truncated=sum(bool(done[i]["truncated"]) for i in targets),
        rerun_failed=still_failing,
        initial_api_errors=summary["api_errors"],
        rerun_max_tokens=max_tokens,
        incomplete_after_rerun=still_failing > 0,
    )
    write_json_atomic(files.summary, summary)
    return summary
