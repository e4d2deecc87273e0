"""Running a benchmark: resume from the checkpoint, ask the server for the rest, score, summarise.

Every row carries what is needed to rescore it (options, gold answer, the reply), so a recovered
row is always scored by the current extractor, never by the one that wrote it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog
from tqdm import tqdm

from phalanx.tools.evalmc.checkpoint import (
    Checkpoint,
    fingerprint,
    fingerprint_matches,
    repair_jsonl_tail,
    write_json_atomic,
)
from phalanx.tools.evalmc.client import ChatResult, ChatSettings, chat
from phalanx.tools.evalmc.data import Item
from phalanx.tools.evalmc.extract import extract_answer

log = structlog.get_logger("eval_mc")


@dataclass(frozen=True)
class RunFiles:
    out_dir: Path
    bench: str

    def _file(self, suffix: str) -> Path:
        return self.out_dir / f"{self.bench}_{suffix}"

    @property
    def partial(self) -> Path:
        return self._file("samples.partial.jsonl")

    @property
    def config(self) -> Path:
        return self._file("run_config.json")

    @property
    def samples(self) -> Path:
        return self._file("samples.json")

    @property
    def summary(self) -> Path:
        return self._file("summary.json")

    @property
    def rerun_partial(self) -> Path:
        return self._file("rerun.partial.jsonl")

    @property
    def rerun_config(self) -> Path:
        return self._file("rerun_config.json")

    @property
    def merged(self) -> Path:
        return self._file("samples_merged.json")


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


def score(row: dict[str, Any]) -> dict[str, Any]:
    """The row with pred / method / correct / truncated recomputed from its reply."""
    options = tuple(row["options"])
    letters = "".join(chr(ord("A") + i) for i in range(len(options)))
    found = extract_answer(row["content"], options, letters)
    failed = row["error"] is not None
    return {
        **row,
        "pred": found.letter,
        "method": found.method,
        "correct": found.letter == row["answer"],
        # cut off before an answer: the token budget ran out (often inside the thinking)
        "truncated": not failed and found.letter is None and row["finish_reason"] == "length",
    }


def new_row(idx: int, item: Item, prompt: str, result: ChatResult) -> dict[str, Any]:
    return score(
        {
            "idx": idx,
            "id": item.id,
            "subject": item.subject,
            "prompt_sha": prompt_hash(prompt),
            "prompt": prompt,
            "options": list(item.options),
            "answer": item.answer,
            "content": result.content,
            "reasoning": result.reasoning,
            "finish_reason": result.finish_reason,
            "completion_tokens": result.completion_tokens,
            "error": result.error,
        }
    )


def recover(rows: list[dict[str, Any]], prompts: list[str]) -> dict[int, dict[str, Any]]:
    """Reusable rows by index: same prompt, no error; rescored. A later duplicate wins."""
    recovered: dict[int, dict[str, Any]] = {}
    for row in rows:
        idx = row.get("idx")
        if not isinstance(idx, int) or not 0 <= idx < len(prompts):
            continue
        if row.get("error") is None and row.get("prompt_sha") == prompt_hash(prompts[idx]):
            recovered[idx] = score(row)
    return recovered


async def ask_all(
    todo: list[tuple[int, Item, str]],
    settings: ChatSettings,
    concurrency: int,
    timeout_s: float,
    checkpoint: Checkpoint,
    desc: str,
) -> list[dict[str, Any]]:
    """Ask for every (idx, item, prompt); each finished row is checkpointed as soon as it lands."""
    gate = asyncio.Semaphore(concurrency)
    done: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with tqdm(total=len(todo), desc=desc, unit="q") as bar:
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

            async def one(idx: int, item: Item, prompt: str) -> None:
                async with gate:
                    result = await chat(client, settings, prompt)
                row = new_row(idx, item, prompt, result)
                checkpoint.append(row)
                done.append(row)
                bar.update(1)

            await asyncio.gather(*(one(*t) for t in todo))
    return done


def summarise(bench: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    per_subject: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        per_subject[row["subject"]][0] += 1
        per_subject[row["subject"]][1] += int(row["correct"])
    correct = sum(int(r["correct"]) for r in rows)
    api_errors = sum(r["error"] is not None for r in rows)
    return {
        "bench": bench,
        "n": len(rows),
        "correct": correct,
        "acc": round(100.0 * correct / len(rows), 2) if rows else 0.0,
        "api_errors": api_errors,
        "truncated_thinking": sum(bool(r["truncated"]) for r in rows),
        "incomplete": api_errors > 0,
        "per_subject": {
            s: {"n": n, "correct": c, "acc": round(100.0 * c / n, 2)}
            for s, (n, c) in sorted(per_subject.items())
        },
    }


def run_benchmark(
    bench: str,
    items: list[Item],
    prompts: list[str],
    settings: ChatSettings,
    files: RunFiles,
    concurrency: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Evaluate every item (resuming a matching checkpoint) and write samples and summary."""
    files.out_dir.mkdir(parents=True, exist_ok=True)
    current = fingerprint(settings.base_url, settings.model, settings.max_tokens, settings.temperature)
    if not fingerprint_matches(files.config, current):
        for stale in (files.partial, files.merged, files.rerun_partial, files.rerun_config):
            if stale.exists():
                log.info("fresh run: removing stale file", path=str(stale))
                stale.unlink()
        write_json_atomic(files.config, current)
    checkpoint = Checkpoint(files.partial)
    recovered = recover(repair_jsonl_tail(files.partial), prompts)
    checkpoint.rewrite([recovered[i] for i in sorted(recovered)])
    todo = [(i, items[i], prompts[i]) for i in range(len(items)) if i not in recovered]
    log.info("eval-mc start", bench=bench, total=len(items), recovered=len(recovered), todo=len(todo))

    started = time.monotonic()
    fresh = asyncio.run(ask_all(todo, settings, concurrency, timeout_s, checkpoint, bench))
    wall_s = time.monotonic() - started

    rows = sorted([*recovered.values(), *fresh], key=lambda r: r["idx"])
    write_json_atomic(files.samples, rows)
    generated = sum(r["completion_tokens"] for r in fresh)
    summary = {
        **summarise(bench, rows),
        "recovered_samples": len(recovered),
        "wall_min": round(wall_s / 60.0, 3),
        "generated_tokens": generated,
        "agg_toks_per_s": round(generated / wall_s, 2) if fresh and wall_s > 0 else 0.0,
        "fingerprint": current,
    }
    write_json_atomic(files.summary, summary)
    return summary
