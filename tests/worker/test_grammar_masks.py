"""Rank 0's packed grammar masks equal the plain per-row bitmask reading, row by row and step by
step: rows without a grammar, a grammar that completes, one that reaches a dead end (a character
this vocabulary cannot write), on a vocabulary padded past its tokenizer to a size that is not a
multiple of 32. And the picks fed at the next mask: a refused pick still fails, a dropped
request's pick is never fed to anyone."""

from __future__ import annotations

from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from phalanx.protocol.messages import SamplingParams
from phalanx.server.detokenizer import _BYTE_OF_CHAR as BYTE_OF_CHAR
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.grammar import GrammarTable, unpack_words, word_bits
from phalanx.worker.sampling import DrawnTokens, draw_tokens

WRITABLE = b'abcdefghijklmnopqrstuvwxy {}":,0123456789'  # no "z": a grammar that needs it dead-ends
VOCAB = 77  # the model's rows: the tokenizer's 43 tokens, padded (77 is not a multiple of 32)
CPU = torch.device("cpu")
GRAMMARS = {
    2: llguidance.LLMatcher.grammar_from_regex("ab?c"),  # completes
    3: llguidance.LLMatcher.grammar_from_regex("az"),  # dead-ends after the a
    4: llguidance.LLMatcher.grammar_from_regex(r'\{"n": [0-9]{1,2}\}'),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    char_of_byte = {byte: char for char, byte in BYTE_OF_CHAR.items()}
    pieces = {char_of_byte[byte]: index for index, byte in enumerate(WRITABLE)}
    pieces["ab"] = len(pieces)
    tokenizer = Tokenizer(models.BPE(vocab=pieces, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    root = tmp_path_factory.mktemp("masks")
    tokenizer.save(str(root / "tokenizer.json"))
    return root


def _eos(model_dir: Path) -> int:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("<|endoftext|>")


class PlainMasks:
    """The reference: each matcher's bitmask read alone and unpacked into a bool row."""

    def __init__(self, model_dir: Path, eos: int) -> None:
        text = (model_dir / "tokenizer.json").read_text()
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=VOCAB, eos_token=[eos])
        self.eos = eos
        self.matchers = {rid: llguidance.LLMatcher(self.tokenizer, g) for rid, g in GRAMMARS.items()}

    def allowed(self, request_ids: list[int]) -> torch.Tensor:
        allowed = np.ones((len(request_ids), VOCAB), dtype=bool)
        for row, request_id in enumerate(request_ids):
            matcher = self.matchers.get(request_id)
            if matcher is None:
                continue
            if not matcher.is_stopped():
                bits = np.unpackbits(
                    np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
                )
                allowed[row] = bits[:VOCAB]
            if matcher.is_stopped() or not allowed[row].any():
                allowed[row] = False
                allowed[row, self.eos] = True
        return torch.from_numpy(allowed)

    def advance(self, request_ids: list[int], tokens: list[int]) -> None:
        for request_id, token in zip(request_ids, tokens, strict=True):
            matcher = self.matchers.get(request_id)
            if matcher is not None and not matcher.is_stopped() and not matcher.consume_token(token):
                del self.matchers[request_id]  # the end a dead end forced


def _table(model_dir: Path) -> GrammarTable:
    table = GrammarTable(model_dir, VOCAB, (_eos(model_dir),))
    for request_id, grammar in GRAMMARS.items():
        assert table.start(request_id, grammar) is None
    return table


def _logits(tokens: list[int]) -> torch.Tensor:
    """Logits whose greedy picks are exactly ``tokens``."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return logits


def _drawn(tokens: list[int]) -> DrawnTokens:
    """Greedy picks of exactly ``tokens``, as rank 0 samples them."""
    return draw_tokens(_logits(tokens), [SamplingParams()] * len(tokens), [0] * len(tokens))


def test_packed_masks_equal_the_plain_masks_step_by_step(model_dir: Path) -> None:
    eos = _eos(model_dir)
    table, plain = _table(model_dir), PlainMasks(model_dir, eos)
    request_ids = [1, 2, 3, 4]  # request 1 has no grammar
    ended = set()
    for _ in range(12):
        expected = plain.allowed(request_ids)
        assert torch.equal(table.allowed(request_ids, CPU), expected)
        assert torch.equal(table.allowed([3, 1], CPU), plain.allowed([3, 1]))  # any subset, any order
        picks = [int(row.nonzero()[-1]) for row in expected]  # the highest allowed id
        ended |= {rid for rid, row in zip(request_ids, expected, strict=True) if row.sum() == 1 and row[eos]}
        plain.advance(request_ids, picks)
        table.defer(request_ids, _drawn(picks))
    assert ended == {2, 3, 4}  # completed or dead-ended: the end only


def test_padding_past_the_tokenizer_is_never_allowed(model_dir: Path) -> None:
    table = _table(model_dir)
    allowed = table.allowed([2, 4, 1], CPU)
    assert allowed.shape == (3, VOCAB)
    assert not allowed[:2, 43:].any() and allowed[2].all()


def test_device_unpacking_equals_numpy_bit_order() -> None:
    words = torch.randint(
        -(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    )
    expected = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
    assert torch.equal(unpack_words(words, word_bits(CPU), VOCAB), torch.from_numpy(expected.astype(bool)))


def test_a_refused_pick_fails_at_the_next_mask(model_dir: Path) -> None:
    table = _table(model_dir)
    refused = WRITABLE.index(b"q")
    table.defer([2], _drawn([refused]))
    with pytest.raises(
        WorkerStateError, match=f"^request 2 picked token {refused}, which its grammar does not allow"
    ):
        table.allowed([2], CPU)


def test_a_dropped_requests_pick_is_fed_to_no_one(model_dir: Path) -> None:
    table, plain = _table(model_dir), PlainMasks(model_dir, _eos(model_dir))
    opening = WRITABLE.index(b"{")
    table.defer([1, 2, 4], _drawn([5, WRITABLE.index(b"q"), opening]))  # request 2's pick is refused
    table.drop(2)
    table.start(2, GRAMMARS[2])  # the id again, a fresh grammar: the stale pick must not reach it
    plain.advance([4], [opening])
    assert torch.equal(table.allowed([1, 2, 4], CPU), plain.allowed([1, 2, 4]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_masks_unpacked_on_the_gpu_equal_those_on_the_cpu(model_dir: Path) -> None:
    on_cpu, on_gpu = _table(model_dir), _table(model_dir)
    request_ids = [1, 2, 3, 4]
    for _ in range(12):
        expected = on_cpu.allowed(request_ids, CPU)
        assert torch.equal(on_gpu.allowed(request_ids, torch.device("cuda")).cpu(), expected)
        picks = [int(row.nonzero()[-1]) for row in expected]
        on_cpu.defer(request_ids, _drawn(picks))
        on_gpu.defer(request_ids, draw_tokens(_logits(picks).cuda(), [SamplingParams()] * 4, [0] * 4))
