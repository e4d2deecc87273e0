"""The model on CUDA with the Triton kernels: the tiny checkpoint against fp32 and transformers bf16,
and the 4B geometry with random weights made on the GPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
PAGE_SIZE = 16
NEW_TOKENS = 64


def greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill the prompt in one chunk, then decode greedily; returns the tokens and each step's logits."""
    from models.qwen35 import DecodeBatch, PrefillBatch

    pages = list(range(-(-(len(prompt) + new_tokens) // PAGE_SIZE)))
    model.allocate_cache(len(pages) + 1, PAGE_SIZE, 2)
    logits = [model.prefill(PrefillBatch.build([(prompt, 0, 1, pages)], DEV))[0]]
    tokens = [int(logits[-1].argmax())]
    for i in range(new_tokens - 1):
        step = DecodeBatch.build([(tokens[-1], len(prompt) + i, 1, pages)], DEV)
        logits.append(model.decode(step)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def transformers_bf16(model_dir: Path):
    """transformers in bf16 on the GPU, keeping the checkpoint's fp32 tensors fp32 as phalanx does."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEV).eval()
    fp32 = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("A_log", "linear_attn.norm.weight")):
                param.data = fp32[name].data.to(DEV)
    return hf


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_tiny_logits_match_fp32_reference_within_bf16(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from models.qwen35 import PrefillBatch, Qwen35Model

    prompt = prompt_ids(100)
    # On the GPU: with fla-core installed, transformers runs its kernels, which need CUDA tensors.
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(DEV).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt], device=DEV)).logits[0].cpu()
    model = Qwen35Model.load(tiny_model_dir, device=DEV, dtype=torch.bfloat16)
    model.allocate_cache(16, PAGE_SIZE, 2)
    # Two chunks: the second continues the first's KV, conv and recurrent state.
    first = model.prefill(PrefillBatch.build([(prompt[:37], 0, 0, list(range(7)))], DEV), all_logits=True)
    second = model.prefill(PrefillBatch.build([(prompt[37:], 37, 0, list(range(7)))], DEV), all_logits=True)
    got = torch.cat([first, second]).cpu()
    err = float((got - ref).norm() / ref.norm())
    # bf16 tolerance, measured rather than guessed: transformers' own bf16 forward on the same
    # prompt sets the scale of rounding error this random model amplifies.
    with torch.no_grad():
        hf_bf16 = transformers_bf16(tiny_model_dir)(input_ids=torch.tensor([prompt], device=DEV))
    hf_err = float((hf_bf16.logits[0].float().cpu() - ref).norm() / ref.norm())
    assert err <= 2 * hf_err + 5e-3, (
        f"bf16 CUDA logits vs fp32 reference: relative error {err:.3g} (transformers bf16: {hf_err:.3g})"
    )


def bf16_tie(logits: torch.Tensor) -> float:
    """Two bf16 units in the last place at the top logit: a gap this small is a tie in bf16."""
    top = float(logits.float().abs().max())
    return 2.0 * 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 0.0


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], list[bool]]:
    """transformers' greedy tokens and, at each step, whether its two best logits are a bf16 tie."""
    ids = torch.tensor([prompt], device=DEV)
    with torch.no_grad():
        out = hf.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            output_scores=True,
            return_dict_in_generate=True,
        )
    tied = []
    for scores in out.scores:
        top = scores[0].float().topk(2).values
        tied.append(float(top[0] - top[1]) <= bf16_tie(scores[0]))
    return out.sequences[0, len(prompt) :].tolist(), tied


def teacher_forced(model, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """phalanx's logits at each step when fed transformers' tokens (prefill, then decode)."""
    from models.qwen35 import DecodeBatch, PrefillBatch

    pages = list(range(-(-(len(prompt) + len(forced)) // PAGE_SIZE)))
    model.allocate_cache(len(pages) + 1, PAGE_SIZE, 2)
    logits = [model.prefill(PrefillBatch.build([(prompt, 0, 1, pages)], DEV))[0]]
    for i, token in enumerate(forced[:-1]):
        logits.append(model.decode(DecodeBatch.build([(token, len(prompt) + i, 1, pages)], DEV))[0])
    return logits


def test_tiny_greedy_tokens_match_transformers_bf16(tiny_model_dir: Path) -> None:
    """64 greedy tokens equal transformers' (bf16). A random tiny model has near-flat logits, so
    transformers' own trajectory passes through bf16 ties (top two within two units in the last
    place), where greedy has no defined answer and either token is right. (1) Teacher-forced on
    transformers' 64 tokens, phalanx's argmax equals transformers' token at every untied step.
    (2) Free running, phalanx's tokens equal transformers' until they part, if they do, and they
    part only at a step where transformers' top two are tied (all 64 equal when none is)."""
    from models.qwen35 import Qwen35Model

    hf = transformers_bf16(tiny_model_dir)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    model = Qwen35Model.load(tiny_model_dir, device=DEV, dtype=torch.bfloat16)

    prompt = prompt_ids(40, seed=1)
    expected, tied = hf_greedy(hf, prompt, NEW_TOKENS)
    forced = teacher_forced(model, prompt, expected)
    wrong = [
        (step, int(ours.argmax()), token)
        for step, (ours, token, tie) in enumerate(zip(forced, expected, tied, strict=True))
        if int(ours.argmax()) != token and not tie
    ]
    assert not wrong, f"teacher-forced (step, phalanx, transformers) at untied steps: {wrong}"

    tokens, _ = greedy(model, prompt, NEW_TOKENS)
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), None)
    assert first_diff is None or tied[first_diff], (
        f"free-running greedy tokens part at step {first_diff} (phalanx {tokens[first_diff]}, "
        f"transformers {expected[first_diff]}), where transformers' top two are not a bf16 tie "
        f"(its ties: steps {[i for i, tie in enumerate(tied) if tie]})"
    )


def test_4b_geometry_random_weights_generates() -> None:
    from tools.bench_decode import build_random_model

    model = build_random_model("4b", DEV)
    tokens, logits = greedy(model, prompt_ids(200, seed=2), 16)
    assert len(tokens) == 16 and all(0 <= t < model.config.vocab_size for t in tokens)
    assert all(torch.isfinite(step).all() for step in logits)


def test_engine_on_cuda_generates_the_model_greedy_tokens(tiny_model_dir: Path) -> None:
    """The whole runtime (executor + one worker process) on CUDA: its greedy stream equals the
    model's own greedy decode on the same GPU."""
    from executor.engine import Engine, EngineConfig, GenerationParams, TokenEvent
    from models.qwen35 import Qwen35Model

    prompt = prompt_ids(40, seed=3)
    model = Qwen35Model.load(tiny_model_dir, device=DEV, dtype=torch.bfloat16)
    expected, _ = greedy(model, prompt, 32)
    config = EngineConfig(model_dir=tiny_model_dir, tp=1, device="cuda", kv_pages=64)
    with Engine.start(config) as engine:
        events = list(engine.submit(prompt, GenerationParams(max_tokens=32, ignore_eos=True)))
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert tokens == expected
