"""Tokenizing a prompt with work bounded by the context, not by the prompt's length.

A long text is counted in slices cut before a space (where a byte-level pre-tokenizer splits
anyway), and counting stops as soon as the count passes the limit: a prompt of megabytes costs
about as much as one that fills the context. A text that stays within the limit is then encoded
whole, so the ids are exactly the tokenizer's.
"""

from __future__ import annotations

from phalanx.server.detokenizer import TextTokenizer

# Characters per counted slice: small enough that one encode call never holds the interpreter
# long, large enough that the per-call overhead does not matter.
SLICE_CHARS = 16_384


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a surrogate code point, if it does. JSON can carry one (an unpaired
    ``\\ud800`` escape), and no tokenizer takes it: it is not Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


class TooManyTokens(Exception):
    """The text has more than ``limit`` tokens; ``counted`` is a lower bound of how many."""

    def __init__(self, counted: int, limit: int) -> None:
        super().__init__(f"more than {limit} tokens (at least {counted})")
        self.counted = counted
        self.limit = limit


def encode_within(tokenizer: TextTokenizer, text: str, add_special_tokens: bool, limit: int) -> list[int]:
    """The token ids of ``text``; raises TooManyTokens once it is known to have more than ``limit``."""
    if len(text) > SLICE_CHARS:
        _count_until_over(tokenizer, text, add_special_tokens, limit)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) > limit:
        raise TooManyTokens(len(ids), limit)
    return ids


def _count_until_over(tokenizer: TextTokenizer, text: str, add_special_tokens: bool, limit: int) -> None:
    """Count ``text``'s tokens slice by slice and raise as soon as there are more than ``limit``.
    A cut may split one token in two, so each cut so far is taken off the count."""
    counted, cuts, start = 0, 0, 0
    while start < len(text):
        end = _cut(text, start)
        counted += len(
            tokenizer.encode(text[start:end], add_special_tokens=add_special_tokens and start == 0)
        )
        if counted - cuts > limit:
            raise TooManyTokens(counted - cuts, limit)
        cuts += 1
        start = end


def _cut(text: str, start: int) -> int:
    """Where the slice from ``start`` ends: before the last space run in its second half, else
    after SLICE_CHARS characters (a text without spaces)."""
    end = start + SLICE_CHARS
    if end >= len(text):
        return len(text)
    space = text.rfind(" ", start + SLICE_CHARS // 2, end)
    if space < 0:
        return end
    while space > start + SLICE_CHARS // 2 and text[space - 1] == " ":
        space -= 1
    return space
