"""A prompt's tokenization stops once the context is passed: the ids of a text within the limit
are exactly the tokenizer's, and a text far over it costs about one slice beyond the limit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from phalanx.server.detokenizer import TextTokenizer
from phalanx.server.prompt_tokens import SLICE_CHARS, TooManyTokens, encode_within


class CountingTokenizer(TextTokenizer):
    """The real tokenizer, counting the characters it was asked to encode."""

    encoded_chars = 0

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> CountingTokenizer:
    loaded = TextTokenizer.from_model_dir(tiny_model_dir)
    return CountingTokenizer(loaded.tokenizer, loaded.special_ids)


def _mixed_text(words: int) -> str:
    pieces = ["lorem", "ipsum", "dolor.", "\n\n", "  sit", "amet,", "日本語", "x" * 40, "<think>"]
    rng = random.Random(0)
    return " ".join(rng.choice(pieces) for _ in range(words))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_text_within_the_limit_gets_the_tokenizers_own_ids(
    tokenizer: CountingTokenizer, add_special_tokens: bool
) -> None:
    text = _mixed_text(12_000)
    assert len(text) > 4 * SLICE_CHARS  # counted in slices first
    whole = tokenizer.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    assert encode_within(tokenizer, text, add_special_tokens, len(whole)) == whole
    with pytest.raises(TooManyTokens) as refused:
        encode_within(tokenizer, text, add_special_tokens, len(whole) - 1)
    assert refused.value.counted == len(whole)


@pytest.mark.parametrize("text", ["lorem ipsum dolor " * 250_000, "x" * 4_000_000, " " * 4_000_000])
def test_a_text_far_over_the_limit_stops_within_a_slice(tokenizer: CountingTokenizer, text: str) -> None:
    tokenizer.encoded_chars = 0
    with pytest.raises(TooManyTokens) as refused:
        encode_within(tokenizer, text, True, 2047)
    assert refused.value.counted > 2047
    assert tokenizer.encoded_chars <= 2 * SLICE_CHARS + 2047 * 64, tokenizer.encoded_chars
