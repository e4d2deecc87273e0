"""Token ids to text, one token at a time, with stop strings matched on the text.

A byte-level BPE token can end in the middle of a UTF-8 character; the decoder then yields
U+FFFD. The incremental decoder (tokenizers' ``DecodeStream``) re-decodes a short window and emits
text only once it no longer ends in a partial character, so streamed deltas concatenate to
exactly the full decode.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each byte is written as one printable character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


class TextTokenizer:
    """The HF fast tokenizer plus the special-token set of ``tokenizer_config.json``.

    transformers lets ``added_tokens_decoder`` in tokenizer_config.json override which added tokens
    are special (Qwen's ``<think>`` is an added token that is *not* special, so it is shown).
    """

    def __init__(self, tokenizer: Tokenizer, special_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        self._added_ids = frozenset(tokenizer.get_added_tokens_decoder())
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> TextTokenizer:
        model_dir = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
            for token_id, token in (config.get("added_tokens_decoder") or {}).items():
                (special.add if token.get("special") else special.discard)(int(token_id))
        return cls(tokenizer, frozenset(special))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the interpreter lock while it works (encode holds it throughout),
        # so the event loop's other streams go on while a long text is tokenized in a thread.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tokenizer.decode([i for i in ids if i not in self.special_ids], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, special tokens included (for logprobs).

        A byte-level BPE token may hold part of a UTF-8 character, so its bytes come from the
        byte alphabet, not from decoding it alone. An id past the tokenizer's vocabulary (the
        model's padded rows) has no bytes.
        """
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and token_id not in self._added_ids and all(ch in _BYTE_OF_CHAR for ch in piece):
            return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token's text; a token that is not whole UTF-8 is written as OpenAI does, ``bytes:\\xNN``."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class IncrementalDetokenizer:
    """tokenizers' ``DecodeStream`` (one call into Rust a token) over the ids that are shown:
    special ids are skipped, as ``TextTokenizer.decode`` skips them."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self._ids: list[int] = []  # the shown ids, for the flush
        self._emitted = 0  # characters given so far
        self._held = False  # the last ids gave no text yet (a partial character)

    def push(self, token_id: int) -> str:
        """The new text this token completes (possibly empty)."""
        if token_id in self._tokenizer.special_ids:
            return ""
        self._ids.append(token_id)
        text = self._stream.step(self._tokenizer.tokenizer, token_id)
        self._held = text is None
        if text is None:
            return ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """Text still held back at the end of the stream (an incomplete character decodes as U+FFFD)."""
        if not self._held:
            return ""
        self._held = False
        text = self._tokenizer.decode(self._ids)
        tail, self._emitted = text[self._emitted :], len(text)
        return tail


class StopMatcher:
    """Finds the first stop string in the generated text; holds back text that could start one.
    The text ends before the stop string, or after it with ``include``."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, delta: str, armed: bool = True) -> str:
        """Text safe to emit after ``delta``; sets ``stopped`` once a stop string appears.
        Unarmed (before a minimum output length) no stop string ends the text."""
        if self.stopped:
            return ""
        search_from = max(0, len(self._text) - self._hold)
        self._text += delta
        hits = [(self._text.find(s, search_from), s) for s in self._stops] if armed else []
        found = [(at, stop) for at, stop in hits if at >= 0]
        if found:
            self.stopped = True
            at, stop = min(found, key=lambda hit: hit[0])
            return self._emit(at + len(stop) if self._include else at)
        return self._emit(len(self._text) - self._hold)

    def flush(self) -> str:
        return "" if self.stopped else self._emit(len(self._text))

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out
