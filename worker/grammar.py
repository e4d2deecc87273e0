"""Constrained output on rank 0: one llguidance matcher per request whose prompt carried a grammar.

Before each pick the matcher says which tokens the grammar allows next (a bitmask over the model's
vocabulary, padded rows never allowed); after it, the picked token advances the matcher. Once the
grammar is complete only the end-of-sequence tokens are allowed, and they stay allowed (a request
that ignores end-of-sequence runs on to its length). A grammar that allows no token of this
vocabulary at some point ends its request there the same way, with end-of-sequence. The tokenizer is built on first use, from the
checkpoint's tokenizer.json (about a second for a 248k vocabulary).
"""

from __future__ import annotations

from pathlib import Path

import llguidance
import numpy as np
import torch

from phalanx.worker.errors import WorkerStateError


class GrammarTable:
    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_file = Path(model_dir) / "tokenizer.json"
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: dict[int, llguidance.LLMatcher] = {}

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._matchers

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            json_text = self._tokenizer_file.read_text(encoding="utf-8")
            self._tokenizer = llguidance.LLTokenizer(json_text, n_vocab=self._vocab_size, eos_token=self._eos)
        return self._tokenizer

    def start(self, request_id: int, grammar: str) -> str | None:
        """Keep a matcher for the request; returns why the grammar does not compile (then none is
        kept: the request is rejected alone)."""
        matcher = llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            return f"grammar does not compile: {matcher.get_error().strip()}"
        self._matchers[request_id] = matcher
        return None

    def drop(self, request_id: int) -> None:
        self._matchers.pop(request_id, None)

    def allowed(self, request_ids: list[int], device: torch.device) -> torch.Tensor | None:
        """Which ids each row may pick (bool [rows, vocab]; every id for a row without a
        grammar); None when no row has one."""
        if not any(request_id in self._matchers for request_id in request_ids):
            return None
        allowed = np.ones((len(request_ids), self._vocab_size), dtype=bool)
        for row, request_id in enumerate(request_ids):
            matcher = self._matchers.get(request_id)
            if matcher is None:
                continue
            if not matcher.is_stopped():
                # llguidance's mask may run a word past the vocabulary: those ids do not exist here
                bits = np.unpackbits(
                    np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
                )
                allowed[row] = bits[: self._vocab_size]
            if matcher.is_stopped() or not allowed[row].any():  # complete, or a dead end: the end only
                allowed[row] = False
                allowed[row, self._eos] = True
        return torch.from_numpy(allowed).to(device)

    def advance(self, request_ids: list[int], tokens: list[int]) -> None:
        """Feed each constrained row's picked token to its matcher."""
        for request_id, token in zip(request_ids, tokens, strict=True):
            matcher = self._matchers.get(request_id)
            if matcher is None or matcher.is_stopped():
                continue
            if not matcher.consume_token(token):
                if token in self._eos:  # the end a dead end forced: the request stops here
                    del self._matchers[request_id]
                    continue
                raise WorkerStateError(
                    f"request {request_id} picked token {token}, which its grammar does not allow: "
                    f"{matcher.get_error()}"
                )
