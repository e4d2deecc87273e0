"""Constrained output on rank 0: one llguidance matcher per request whose prompt carried a grammar.

Before each pick the matcher says which tokens the grammar allows next (a bitmask over the model's
vocabulary, padded rows never allowed); after it, the picked token advances the matcher. Once the
grammar is complete only the end-of-sequence tokens are allowed, and they stay allowed (a request
that ignores end-of-sequence runs on to its length). A grammar that allows no token of this
vocabulary at some point ends its request there the same way, with end-of-sequence. The tokenizer is built on first use, from the
checkpoint's tokenizer.json (about a second for a 248k vocabulary).

The masks stay packed on the host (llguidance's int32 words, 32 ids each, filled by its thread
pool into one pinned buffer) and are unpacked on the device, after a copy that does not wait for
the step's forward. A step's picks advance the matchers only when the next mask is built
(``defer``): by then the next step's forward is launched, so waiting for the picks overlaps it.
"""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

from phalanx.worker.errors import WorkerStateError
from phalanx.worker.sampling import DrawnTokens

_WORD = 32  # ids per mask word


def _words(ids: list[int], width: int) -> np.ndarray:
    """A packed row that allows exactly ``ids`` (int32 [width])."""
    words = np.zeros(width, dtype=np.uint32)
    for token in ids:
        words[token // _WORD] |= np.uint32(1 << (token % _WORD))
    return words.view(np.int32)


def _packed_rows(rows: int, vocab_size: int) -> torch.Tensor:
    """Every id allowed (int32 [rows, words]); pinned on a CUDA host, so its copy runs async.
    Not ``llguidance.torch``'s: importing that module compiles a kernel we never call (seconds)."""
    shape = (rows, -(-vocab_size // _WORD))
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def unpack_words(packed: torch.Tensor, bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed masks (int32 [rows, words]) as bool [rows, vocab_size], on their device; ``bits``
    holds each bit of a word alone (``word_bits``, int32 [32], on that device)."""
    return (packed.unsqueeze(-1) & bits).ne(0).view(packed.shape[0], -1)[:, :vocab_size]


def word_bits(device: torch.device) -> torch.Tensor:
    words = np.array([1 << bit for bit in range(_WORD)], dtype=np.uint32).view(np.int32)
    return torch.from_numpy(words).to(device)


class GrammarTable:
    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_file = Path(model_dir) / "tokenizer.json"
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._executor = llguidance.LLExecutor()
        width = -(-vocab_size // _WORD)
        self._end_only = _words(self._eos, width)
        # the ids past the vocabulary in the last word: llguidance's mask may set them
        tail = vocab_size % _WORD
        self._last_word = np.uint32((1 << tail) - 1 if tail else 0xFFFFFFFF).view(np.int32)
        self._packed = _packed_rows(0, vocab_size)  # grows to the rows
        self._copied: torch.cuda.Event | None = None  # the packed buffer's last copy to the device
        self._word_bits: dict[torch.device, torch.Tensor] = {}  # made once: a pageable copy waits
        self._deferred: list[tuple[list[int], DrawnTokens]] = []  # picks not yet fed to matchers

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
        """Forget the request and its picks not yet fed (a new request under its id starts clean)."""
        self._matchers.pop(request_id, None)
        self._deferred = [
            ([other if other != request_id else None for other in request_ids], drawn)
            for request_ids, drawn in self._deferred
        ]

    def allowed(self, request_ids: list[int], device: torch.device) -> torch.Tensor | None:
        """Which ids each row may pick (bool [rows, vocab]; every id for a row without a
        grammar); None when no row has one. Feeds the deferred picks first."""
        if not any(request_id in self._matchers for request_id in request_ids):
            return None
        self.advance_deferred()
        packed = self._fill(request_ids)
        on_device = packed.to(device, non_blocking=True)
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._unpack(on_device)

    def _fill(self, request_ids: list[int]) -> torch.Tensor:
        """The rows' packed masks in the pinned buffer (int32 [rows, words])."""
        rows = len(request_ids)
        if self._copied is not None:  # the buffer's last copy must land before it is rewritten
            self._copied.synchronize()
        if self._packed.shape[0] < rows:
            self._packed = _packed_rows(rows, self._vocab_size)
        packed = self._packed[:rows]
        words = packed.numpy()  # the same memory
        words.fill(-1)
        matching, ended = [], []
        for row, request_id in enumerate(request_ids):
            matcher = self._matchers.get(request_id)
            if matcher is None:
                continue
            if matcher.is_stopped():
                ended.append(row)
            else:
                matching.append((matcher, row))
        if matching:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, matching, words)
            words[:, -1] &= self._last_word
            live = words.any(axis=1)
            ended += [row for _, row in matching if not live[row]]  # a dead end
        words[ended] = self._end_only  # complete, or a dead end: the end only
        return packed

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        if packed.device.type == "cpu":  # numpy unpacks bits an order of magnitude faster here
            bits = np.unpackbits(packed.numpy().view(np.uint8), axis=1, bitorder="little")
            return torch.from_numpy(bits[:, : self._vocab_size].view(np.bool_))
        bits = self._word_bits.get(packed.device)
        if bits is None:
            bits = self._word_bits[packed.device] = word_bits(packed.device)
        return unpack_words(packed, bits, self._vocab_size)

    def defer(self, request_ids: list[int], drawn: DrawnTokens) -> None:
        """Keep a step's picks (still on their way to the host) for the next mask to feed."""
        self._deferred.append((list(request_ids), drawn))

    def advance_deferred(self) -> None:
        """Feed the kept picks to their matchers (waits for them to reach the host)."""
        deferred, self._deferred = self._deferred, []
        for request_ids, drawn in deferred:
            self.advance(request_ids, drawn.token_ids())

    def advance(self, request_ids: list[int | None], tokens: list[int]) -> None:
        """Feed each constrained row's picked token to its matcher (None: a dropped request)."""
        for request_id, token in zip(request_ids, tokens, strict=True):
            matcher = self._matchers.get(request_id) if request_id is not None else None
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
