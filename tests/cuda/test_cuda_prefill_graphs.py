"""Prefill graphs on the GPU (``worker/prefill_graphs.py``): every key captures, and replays with
new inputs each time give a plain eager pass's logits, states, capture and K/V (bf16 model, the
tiny checkpoint), fresh and continuing a cached prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from phalanx.models.qwen35 import PrefillBatch, Qwen35Model  # noqa: E402
from phalanx.worker.prefill_graphs import PrefillGraphRunner  # noqa: E402
from tests.support.gpu_checks import rel  # noqa: E402

DEV = torch.device("cuda")
# A graph's pass and the plain one run GEMMs of other row counts (the padding), so cuBLAS sums in
# other orders: the tiny model's bf16 logits differed by up to 2.3 % (a 130-token chunk in its
# 256-token graph); states and K/V, where a padding leak would show, stay within 2 %.
LOGITS_REL, STATE_REL = 3e-2, 2e-2
PAGE, KV_PAGES, SLOTS, PAD_SLOT, MAX_PAGES = 16, 128, 8, 7, 64


def _states(model: Qwen35Model, slot: int) -> list[torch.Tensor]:
    layers = [layer.linear_attention for layer in model.layers if layer.linear_attention]
    return [g.recurrent_state[slot].float() for g in layers] + [g.conv_state[slot].float() for g in layers]


def _kv(model: Qwen35Model, pages: list[int]) -> list[torch.Tensor]:
    layers = [layer.attention for layer in model.layers if layer.attention]
    return [cache[pages].float() for a in layers for cache in (a.k_cache, a.v_cache)]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_replays_give_the_eager_pass_s_logits_states_captures_and_kv(tiny_model_dir: Path) -> None:
    model = Qwen35Model.load(tiny_model_dir, device=DEV, dtype=torch.bfloat16)
    model.allocate_cache(KV_PAGES + 1, PAGE, SLOTS)
    runner = PrefillGraphRunner(model, DEV, pad_slot=PAD_SLOT, pad_page=KV_PAGES, max_pages=MAX_PAGES)
    runner.capture()
    assert len(runner._graphs) == len(runner.keys) == 18
    ours, theirs = list(range(0, 60)), list(range(60, 120))
    bad: list[str] = []
    # (length, start, capture offset or 0): every bucket, filled, aligned or not, fresh or continuing
    for length, start, capture in [(50, 0, 0), (64, 0, 0), (128, 64, 0), (130, 0, 64), (200, 320, 128),
                                   (512, 0, 256), (1, 700, 0), (333, 16, 0), (192, 0, 128), (384, 64, 0),
                                   (128, 640, 64)]:  # fmt: skip
        head, tokens = _prompt(start, length), _prompt(length, start + 1)
        if start:  # both slots continue the same cached prefix
            model.prefill(PrefillBatch.build([(head, 0, 1, ours)], DEV))
            model.prefill(PrefillBatch.build([(head, 0, 2, theirs)], DEV))
        key = runner.key_for(length, start, len(ours), 1 if capture else 0)
        assert key is not None, (length, start, capture)
        logits = runner.prefill(key, tokens, start, 1, ours, [(capture, 4)] if capture else [])
        saves = [(0, capture, 5)] if capture else []
        plain = model.prefill(PrefillBatch.build([(tokens, start, 2, theirs)], DEV, saves))
        where = f"length {length} at {start}"
        pairs = [("logits", logits, plain)]
        pairs += [("state", *p) for p in zip(_states(model, 1), _states(model, 2), strict=True)]
        if capture:
            pairs += [("captured state", *p) for p in zip(_states(model, 4), _states(model, 5), strict=True)]
        used = -(-(start + length) // PAGE)
        pairs += [("kv", *p) for p in zip(_kv(model, ours[:used]), _kv(model, theirs[:used]), strict=True)]
        bad += [
            f"{where} ({key}): {what} rel {rel(a, b):.3g}"
            for what, a, b in pairs
            if rel(a, b) > (LOGITS_REL if what == "logits" else STATE_REL)
        ]
    assert not bad, "\n".join(bad)
