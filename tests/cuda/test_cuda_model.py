"""The model on CUDA with the Triton kernels: the tiny checkpoint against fp32 and transformers bf16,
and the 4B geometry with random weights made on the GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass
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
    from phalanx.models.qwen35 import DecodeBatch, PrefillBatch

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


# Both recurrent-state dtypes are held to the same golden tolerances (--mamba-ssm-cache-dtype).
STATE_DTYPES = pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@STATE_DTYPES
def test_tiny_logits_match_fp32_reference_within_bf16(tiny_model_dir: Path, state_dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    from phalanx.models.qwen35 import PrefillBatch, Qwen35Model

    prompt = prompt_ids(100)
    # On the GPU: with fla-core installed, transformers runs its kernels, which need CUDA tensors.
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(DEV).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt], device=DEV)).logits[0].cpu()
    model = Qwen35Model.load(tiny_model_dir, device=DEV, dtype=torch.bfloat16, state_dtype=state_dtype)
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


@dataclass
class Trajectory:
    """transformers' bf16 greedy run: its tokens, each step's logits, and the fp32 reference's
    logits at each step (the same model in fp32, teacher-forced on those tokens)."""

    tokens: list[int]
    logits: list[torch.Tensor]
    reference: torch.Tensor

    def within_rounding(self, step: int, ours: int) -> bool:
        """Whether bf16 greedy may pick ``ours`` over transformers' token at ``step``: transformers'
        top two are a bf16 tie there, or the fp32 reference orders the two tokens by no more than
        transformers' own bf16 rounding moved their gap (a random tiny model amplifies rounding:
        its bf16 logits are ~3 % off fp32, and fp32 gaps of two units in the last place occur)."""
        hf, ref, theirs = self.logits[step].float(), self.reference[step], self.tokens[step]
        top = hf.topk(2).values
        if float(top[0] - top[1]) <= bf16_tie(hf):
            return True
        exact_gap = float(ref[theirs] - ref[ours])
        bf16_gap = float(hf[theirs] - hf[ours])
        return abs(bf16_gap - exact_gap) >= abs(exact_gap)


def hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> Trajectory:
    """transformers' bf16 greedy run from ``prompt``, with the fp32 reference along it."""
    from transformers import AutoModelForCausalLM

    hf = transformers_bf16(model_dir)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
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
        tokens = out.sequences[0, len(prompt) :].tolist()
        fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEV).eval()
        forced = torch.tensor([prompt + tokens[:-1]], device=DEV)
        reference = fp32(input_ids=forced).logits[0, len(prompt) - 1 :].float()
    return Trajectory(tokens, [scores[0] for scores in out.scores], reference)


def teacher_forced(model, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """phalanx's logits at each step when fed transformers' tokens (prefill, then decode)."""
    from phalanx.models.qwen35 import DecodeBatch, PrefillBatch

    pages = list(range(-(-(len(prompt) + len(forced)) // PAGE_SIZE)))
    model.allocate_cache(len(pages) + 1, PAGE_SIZE, 2)
    logits = [model.prefill(PrefillBatch.build([(prompt, 0, 1, pages)], DEV))[0]]
    for i, token in enumerate(forced[:-1]):
        logits.append(model.decode(DecodeBatch.build([(token, len(prompt) + i, 1, pages)], DEV))[0])
    return logits


@STATE_DTYPES
def test_tiny_greedy_tokens_match_transformers_bf16(tiny_model_dir: Path, state_dtype: torch.dtype) -> None:
    """64 greedy tokens equal transformers' (bf16), except where bf16 rounding decides the pick
    (``Trajectory.within_rounding``): a random tiny model has near-flat logits, and there greedy
    has no defined answer in bf16. (1) Teacher-forced on transformers' 64 tokens, phalanx's argmax
    equals transformers' token at every other step. (2) Free running, phalanx's tokens equal
    transformers' until they part, if they do, and they part only at such a step."""
    from phalanx.models.qwen35 import Qwen35Model

    prompt = prompt_ids(40, seed=1)
    expected = hf_greedy(tiny_model_dir, prompt, NEW_TOKENS)
    model = Qwen35Model.load(tiny_model_dir, device=DEV, dtype=torch.bfloat16, state_dtype=state_dtype)
    forced = teacher_forced(model, prompt, expected.tokens)
    wrong = [
        (step, int(ours.argmax()), token)
        for step, (ours, token) in enumerate(zip(forced, expected.tokens, strict=True))
        if int(ours.argmax()) != token and not expected.within_rounding(step, int(ours.argmax()))
    ]
    assert not wrong, f"teacher-forced (step, phalanx, transformers) outside bf16 rounding: {wrong}"

    tokens, _ = greedy(model, prompt, NEW_TOKENS)
    first_diff = next(
        (i for i, (a, b) in enumerate(zip(tokens, expected.tokens, strict=True)) if a != b), None
    )
    assert first_diff is None or expected.within_rounding(first_diff, tokens[first_diff]), (
        f"free-running greedy tokens part at step {first_diff} (phalanx {tokens[first_diff]}, "
        f"transformers {expected.tokens[first_diff]}), where bf16 rounding does not decide the pick"
    )


def test_4b_geometry_random_weights_generates() -> None:
    from phalanx.tools.bench.random_model import build_random_model

    model = build_random_model("4b", DEV)
    tokens, logits = greedy(model, prompt_ids(200, seed=2), 16)
    assert len(tokens) == 16 and all(0 <= t < model.config.vocab_size for t in tokens)
    assert all(torch.isfinite(step).all() for step in logits)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_bound_decode_ops_give_the_general_path_s_logits_bit_for_bit(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the 4B shapes: decode through the layers' bound ops (kernels/bound.py, bound from the
    third step on) against the same model with binding off, every step's logits equal. Every
    linear binds, whether its key went to Triton or cuBLAS (at batch 64 cuBLAS answers some)."""
    from phalanx.kernels import bound
    from phalanx.models.qwen35 import DecodeBatch
    from phalanx.tools.bench.random_model import build_random_model

    model = build_random_model("4b", DEV)
    pages_per_row = 4

    def decode_steps() -> list[torch.Tensor]:
        model.allocate_cache(rows * pages_per_row + 1, PAGE_SIZE, rows)  # fresh caches, new bound ops
        tokens = prompt_ids(rows, seed=rows)
        logits = []
        for position in range(6):
            step = DecodeBatch.build(
                [
                    (tokens[r], position, r, list(range(r * pages_per_row, (r + 1) * pages_per_row)))
                    for r in range(rows)
                ],
                DEV,
            )
            logits.append(model.decode(step))
            tokens = logits[-1].argmax(-1).tolist()
        return logits

    monkeypatch.setattr(bound, "MAX_BOUND_ROWS", 0)
    general = decode_steps()
    monkeypatch.setattr(bound, "MAX_BOUND_ROWS", 256)
    bound_logits = decode_steps()
    layer = model.layers[0]
    linears = {
        "in_proj": layer.linear_attention.in_proj,
        "out_proj": layer.linear_attention.out_proj.linear,
        "gate_up": layer.mlp.gate_up,
        "down": layer.mlp.down.linear,
        "head": model.head.linear,
    }
    unbound = [name for name, op in linears.items() if not any(op._bindings._bound.values())]
    assert not unbound, f"never bound at {rows} rows: {unbound}"
    assert any(layer.linear_attention.decode_step._bindings._bound.values()), "the GDN step never bound"
    for step, (got, expected) in enumerate(zip(bound_logits, general, strict=True)):
        assert torch.equal(got, expected), f"decode step {step}: bound logits differ from the general path's"


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_engine_on_cuda_generates_the_model_greedy_tokens(tiny_model_dir: Path, cuda_graph: bool) -> None:
    """The whole runtime (executor + one worker process) on CUDA, pipelined, eager and with graphs
    (whose tokens rank 0 reads where the graph landed them): its greedy stream equals the model's
    own greedy decode on the same GPU until they part, if they do, and they part only where the
    model's top two logits are a bf16 tie. The worker times its kernels' configs afresh, and a
    different block size sums in a different order: on a random tiny model's near-flat logits that
    may flip a tie, never a clear pick."""
    from phalanx.engine.engine import Engine, EngineConfig, GenerationParams, TokenEvent
    from phalanx.models.qwen35 import Qwen35Model

    prompt = prompt_ids(40, seed=3)
    model = Qwen35Model.load(tiny_model_dir, device=DEV, dtype=torch.bfloat16)
    expected, logits = greedy(model, prompt, 32)
    config = EngineConfig(model_dir=tiny_model_dir, tp=1, device="cuda", kv_pages=64, cuda_graph=cuda_graph)
    with Engine.start(config) as engine:
        events = list(engine.submit(prompt, GenerationParams(max_tokens=32, ignore_eos=True)))
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == len(expected)
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), None)
    if first_diff is None:
        return
    step = logits[first_diff].float()
    gap = float(step[expected[first_diff]] - step[tokens[first_diff]])
    assert gap <= bf16_tie(step), (
        f"the engine's greedy tokens part from the model's at step {first_diff} (engine "
        f"{tokens[first_diff]}, model {expected[first_diff]}) by a logit gap of {gap:.4g}, more "
        f"than a bf16 tie ({bf16_tie(step):.4g})"
    )
