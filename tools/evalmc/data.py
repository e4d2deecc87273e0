"""Loading multiple-choice items from local JSONL or parquet files, and stratified sampling.

The accepted columns (docs/eval-mc.md) cover the native layouts of C-Eval, MMLU-Redux, MMLU-Pro
and SuperGPQA, so their files can be used as downloaded, without conversion.
"""

from __future__ import annotations

import json
import random
import string
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LETTERS = string.ascii_uppercase
SAMPLE_SEED = 1337


class DatasetError(ValueError):
    """A dataset file that cannot be read as multiple-choice items."""


@dataclass(frozen=True)
class Item:
    """One multiple-choice question; ``answer`` is the gold letter."""

    id: str
    subject: str
    question: str
    options: tuple[str, ...]
    answer: str
    cot: str = ""

    @property
    def letters(self) -> str:
        return LETTERS[: len(self.options)]


def read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        return rows
    raise DatasetError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl or .parquet)")


def _options(row: dict[str, Any], where: str) -> tuple[str, ...]:
    for key in ("options", "choices"):
        if row.get(key) is not None:
            options = tuple(str(o) for o in row[key])
            break
    else:
        options = tuple(str(row[letter]) for letter in LETTERS if row.get(letter) is not None)
    if len(options) < 2:
        raise DatasetError(f"{where}: needs at least 2 options (columns options, choices or A, B, ...)")
    if len(options) > len(LETTERS):
        raise DatasetError(f"{where}: {len(options)} options, at most {len(LETTERS)} are supported")
    return options


def _answer(row: dict[str, Any], options: tuple[str, ...], where: str) -> str:
    letters = LETTERS[: len(options)]
    raw = row.get("answer_letter", row.get("answer"))
    if isinstance(raw, bool) or raw is None:
        raise DatasetError(f"{where}: missing answer (column answer or answer_letter)")
    if isinstance(raw, int):
        if not 0 <= raw < len(options):
            raise DatasetError(f"{where}: answer index {raw} is outside 0..{len(options) - 1}")
        return letters[raw]
    text = str(raw).strip()
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    if text in options:  # SuperGPQA's ``answer`` holds the option text
        return letters[options.index(text)]
    raise DatasetError(f"{where}: answer {text!r} is neither a letter in {letters} nor an option's text")


def load_items(path: Path) -> list[Item]:
    """Read every row of ``path`` as an Item; the subject defaults to the file's stem."""
    items = []
    for n, row in enumerate(read_rows(path)):
        where = f"{path} row {n}"
        if "question" not in row:
            raise DatasetError(f"{where}: missing column 'question'")
        options = _options(row, where)
        subject = row.get("subject") or row.get("category") or row.get("discipline") or path.stem
        raw_id = row.get("id", row.get("question_id", row.get("uuid")))
        items.append(
            Item(
                id=str(raw_id) if raw_id is not None else f"{path.stem}-{n}",
                subject=str(subject),
                question=str(row["question"]),
                options=options,
                answer=_answer(row, options, where),
                cot=str(row.get("cot_content") or row.get("explanation") or ""),
            )
        )
    return items


def load_paths(paths: list[Path]) -> list[Item]:
    """Items of every file (or every .jsonl/.parquet file of a directory), in sorted path order."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".parquet"))
        elif path.exists():
            files.append(path)
        else:
            raise DatasetError(f"{path}: no such file or directory")
    if not files:
        raise DatasetError(f"no .jsonl or .parquet files in {', '.join(map(str, paths))}")
    return [item for f in files for item in load_items(f)]


def stratified_sample(items: list[Item], n: int, seed: int = SAMPLE_SEED) -> list[Item]:
    """Exactly ``min(n, len(items))`` items, spread over subjects in proportion to their size.

    Each subject first gets the floor of its proportional quota; the remaining places go to the
    subjects with the largest fractional parts (ties by subject name). The picked items keep the
    dataset's order.
    """
    if n >= len(items):
        return list(items)
    by_subject: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(items):
        by_subject[item.subject].append(i)
    exact = {s: n * len(idx) / len(items) for s, idx in by_subject.items()}
    quota = {s: int(q) for s, q in exact.items()}
    leftover = n - sum(quota.values())
    for s in sorted(exact, key=lambda s: (-(exact[s] - quota[s]), s))[:leftover]:
        quota[s] += 1
    rng = random.Random(seed)
    picked: list[int] = []
    for s in sorted(by_subject):
        picked += rng.sample(by_subject[s], quota[s])
    return [items[i] for i in sorted(picked)]
