"""Memory sizing on the GPU: a KV pool sized to the GPU (its padding page and high pages past 2^31
elements) decodes right eagerly and from graphs, and a model that does not fit is refused in one
sentence with no process left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
REPO = Path(__file__).resolve().parents[2]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_kv_pages_past_2_31_elements_give_the_low_pages_logits(tiny_model_dir: Path) -> None:
    """The same request decoded through pages at the pool's start and past 2^31 elements."""
    from phalanx.models.qwen35 import DecodeBatch, PrefillBatch, Qwen35Model

    model = Qwen35Model.load(tiny_model_dir, device=DEV, dtype=torch.bfloat16)
    page_size = 16
    elements_per_page = page_size * model.layout.num_kv_heads * model.config.head_dim
    high = (1 << 31) // elements_per_page + 3
    model.allocate_cache(high + 8, page_size, 2)
    prompt = _prompt(40, seed=4)

    def run(pages: list[int]) -> list[torch.Tensor]:
        logits = [model.prefill(PrefillBatch.build([(prompt, 0, 1, pages)], DEV))[0]]
        for i in range(8):
            token = int(logits[-1].argmax())
            logits.append(model.decode(DecodeBatch.build([(token, len(prompt) + i, 1, pages)], DEV))[0])
        return logits

    low, far = run([0, 1, 2, 3]), run([high, high + 1, high + 2, high + 3])
    assert (high + 4) * elements_per_page > 1 << 31
    for step, (a, b) in enumerate(zip(low, far, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits through pages past 2^31 elements differ"


def _teacher_forced(model_dir: Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Our model's logits [len(ids), vocab] (float32) along ``ids``, in one prefill."""
    from phalanx.models.qwen35 import PrefillBatch, Qwen35Model

    model = Qwen35Model.load(model_dir, device=DEV, dtype=dtype)
    pages = list(range(-(-len(ids) // 16)))
    model.allocate_cache(len(pages) + 1, 16, 2)
    logits = model.prefill(PrefillBatch.build([(ids, 0, 1, pages)], DEV), all_logits=True).float()
    del model
    torch.cuda.empty_cache()
    return logits


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_the_default_sized_pool_serves_the_model_greedy_tokens(
    tiny_model_dir: Path, cuda_graph: bool
) -> None:
    """Defaults: every page that fits (far past 2^31 elements for the tiny model, the padding page
    last) and up to 256 slots. Teacher-forced on our model in fp32, each greedy token's logit is
    within bf16 rounding of the maximum (the ranks race their decode linears' kernels per shape,
    so their bf16 rounding, and a near tie's pick, may differ from this process's)."""
    from phalanx.engine.engine import Engine, EngineConfig, GenerationParams, TokenEvent
    from phalanx.models.qwen35.config import Qwen35Config

    prompt = _prompt(40, seed=3)
    config = EngineConfig(
        model_dir=tiny_model_dir, device="cuda", kv_pages=0, max_slots=0, cuda_graph=cuda_graph
    )
    with Engine.start(config) as engine:
        capacity = engine._executor.capacity
        events = list(engine.submit(prompt, GenerationParams(max_tokens=24, ignore_eos=True)))
    text = Qwen35Config.from_dir(tiny_model_dir)
    elements_per_page = 16 * text.num_key_value_heads * text.head_dim
    assert (capacity.kv_pages + 1) * elements_per_page > 1 << 31, capacity
    assert capacity.max_slots == 256, capacity
    big_gpu = torch.cuda.get_device_properties(DEV).total_memory >= 70 << 30
    assert capacity.max_batch_tokens == (8192 if big_gpu else 2048), capacity
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == 24
    ids = prompt + tokens[:-1]
    exact = _teacher_forced(tiny_model_dir, ids, torch.float32)
    margin = (_teacher_forced(tiny_model_dir, ids, torch.bfloat16) - exact).abs().amax(dim=-1)
    for step, token in enumerate(tokens):
        row = exact[len(prompt) - 1 + step]
        gap, allowed = float(row.max() - row[token]), 2 * float(margin[len(prompt) - 1 + step])
        assert gap <= allowed, f"step {step}: token {token} is {gap:.4g} below the maximum ({allowed:.4g})"


def test_a_model_that_does_not_fit_is_refused_in_one_sentence(tiny_model_dir: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "tools",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt-ids",
        "1,2",
    ]
    proc = subprocess.run(
        [*command, "--gpu-memory-utilization", "0.001"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("phalanx generate: error:")]
    assert error and "the model does not fit: nothing is left for the KV cache and request states" in error[0]
    assert "--gpu-memory-utilization 0.001 allows" in error[0]
    leftover = subprocess.run(["pgrep", "-f", str(tiny_model_dir)], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"processes left: {leftover}"
