"""Every Qwen3.5 size through ``phalanx generate`` with default flags (cuda, CUDA graphs, memory
sized to the GPU) and with ``--enforce-eager``: random checkpoints in the released layout
(``text_config`` nesting, ``model.language_model.*`` names, vision and MTP tensors to skip), each
size's widths, heads, GQA and GDN ratios, tied and untied heads, at a reduced depth. Teacher-forced
on transformers in fp32, each greedy token's logit is within bf16 rounding of the maximum."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# A size's first run on a fresh machine compiles and autotunes all its kernels: the 4B case took
# 313 s there (docs/benchmarks/README.md), past the suite's 300 s default.
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(900)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
# QWEN35_TEST_SIZES=0.8b,9b runs a subset (each size compiles its own kernels on first use).
SIZES = tuple(os.environ.get("QWEN35_TEST_SIZES", "0.8b,2b,4b,9b,27b").split(","))
LAYERS = 4
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=SIZES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from phalanx.tools.random_checkpoint import write_random_checkpoint

    out = tmp_path_factory.mktemp(f"qwen35-{request.param}")
    write_random_checkpoint(request.param, out, DEV, seed=1, layers=LAYERS)
    torch.cuda.empty_cache()
    return out


def _generate(
    model_dir: Path, prompt: list[int], capsys: pytest.CaptureFixture[str], *flags: str
) -> list[int]:
    from phalanx.tools.cli import main

    ids = ",".join(map(str, prompt))
    argv = ["generate", "--model", str(model_dir), "--prompt-ids", ids, "--max-tokens", str(NEW_TOKENS)]
    code = main([*argv, "--ignore-eos", "--json", *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])["token_ids"]


def _bf16_margin(hf_fp32, hf_bf16, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits along ``ids`` and, per position, how far transformers' own bf16 forward moves
    a logit (its largest deviation from fp32 there): the rounding a bf16 pick may be off by."""
    with torch.no_grad():
        exact = hf_fp32(input_ids=ids).logits[0].float()
        rounded = hf_bf16(input_ids=ids).logits[0].float()
    return exact, (rounded - exact).abs().amax(dim=-1)


def test_every_size_generates_greedy_tokens_within_bf16_of_transformers(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    prompt = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {
        "graphs": _generate(checkpoint, prompt, capsys),
        "eager": _generate(checkpoint, prompt, capsys, "--enforce-eager"),
    }
    hf_fp32 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(DEV).eval()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(DEV).eval()
    config = json.loads((checkpoint / "config.json").read_text())
    for mode, tokens in runs.items():
        assert len(tokens) == NEW_TOKENS
        ids = torch.tensor([prompt + tokens[:-1]], device=DEV)
        exact, margin = _bf16_margin(hf_fp32, hf_bf16, ids)
        for step, token in enumerate(tokens):
            row = exact[len(prompt) - 1 + step]
            gap = float(row.max() - row[token])
            allowed = 2 * float(margin[len(prompt) - 1 + step])
            assert gap <= allowed, (
                f"{config['text_config']['hidden_size']}-wide model, {mode}, step {step}: token {token}'s "
                f"fp32 logit is {gap:.4g} below the maximum, beyond bf16 rounding ({allowed:.4g})"
            )
