"""Answer extraction: which option letter did the model choose?

Order of preference, each step only when the earlier ones found nothing:

1. an explicit marker ("Answer: B", "the answer is (B)", "答案：B", "\\boxed{B}"), the last one in
   the text wins, since models restate the question's options before concluding;
2. a line that is only a letter ("B", "(B)", "**B**"), last line first; or a reply that starts with
   a letter and punctuation ("B. Paris", "B、") as in C-Eval's "答案: " continuation;
3. the text of an option quoted in the reply, longest option first, so "New York City" is not
   scored as "New York".

The old mistake this guards against: taking the first capital letter anywhere scores "Answer: B"
as the "A" of "Answer".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MARKER = re.compile(
    r"(?:(?i:answer)\s*(?:(?i:is)\s*[:：]?|[:：])|答案\s*(?:是|为|應為|应为)?\s*[:：]?)"
    r"[\s*]*[(\[（]?\s*([A-Z])(?![A-Za-z0-9])"
)
_BOXED = re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*([A-Z])\s*\}?\s*\}")
_LETTER_LINE = re.compile(r"^[\s*(\[（]*([A-Z])[\s*)\]）.:：]*$")
_LEADING_LETTER = re.compile(r"^[\s*(\[（]*([A-Z])(?:[)\]）.．、:：,，]|\s*$)")
_THINK_END = "</think>"


@dataclass(frozen=True)
class Extraction:
    letter: str | None
    method: str  # "marker", "letter_line", "leading_letter", "option_text" or "none"


def strip_thinking(content: str) -> str:
    """The answer part of a reply whose thinking was not separated by the server."""
    return content.rsplit(_THINK_END, 1)[-1] if _THINK_END in content else content


def _last_valid(matches: list[re.Match[str]], letters: str) -> str | None:
    for match in reversed(matches):
        if match.group(1) in letters:
            return match.group(1)
    return None


def extract_by_marker(text: str, letters: str) -> str | None:
    spans = sorted([*_MARKER.finditer(text), *_BOXED.finditer(text)], key=lambda m: m.start())
    return _last_valid(spans, letters)


def extract_by_letter_line(text: str, letters: str) -> str | None:
    for line in reversed(text.splitlines()):
        match = _LETTER_LINE.match(line)
        if match and match.group(1) in letters:
            return match.group(1)
    return None


def extract_leading_letter(text: str, letters: str) -> str | None:
    match = _LEADING_LETTER.match(text)
    return match.group(1) if match and match.group(1) in letters else None


def extract_by_option_text(text: str, options: tuple[str, ...], letters: str) -> str | None:
    haystack = text.casefold()
    by_length = sorted(range(len(options)), key=lambda i: -len(options[i].strip()))
    for i in by_length:
        needle = options[i].strip().rstrip(".。").casefold()
        if needle and needle in haystack:
            return letters[i]
    return None


def extract_answer(content: str, options: tuple[str, ...], letters: str) -> Extraction:
    text = strip_thinking(content).strip()
    steps = (
        ("marker", lambda: extract_by_marker(text, letters)),
        ("letter_line", lambda: extract_by_letter_line(text, letters)),
        ("leading_letter", lambda: extract_leading_letter(text, letters)),
        ("option_text", lambda: extract_by_option_text(text, options, letters)),
    )
    for method, step in steps:
        letter = step()
        if letter is not None:
            return Extraction(letter, method)
    return Extraction(None, "none")
