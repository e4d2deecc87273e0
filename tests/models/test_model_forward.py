"""The model's logits match transformers' Qwen3_5ForCausalLM (fp32) at TP 1, 2 and 4.

One set of scenarios (whole prompt, uneven chunks 1/3/64/rest, prefill + 32 greedy decode steps,
4 requests prefilled and decoded together, one of them in its second chunk) runs per model (tied
and untied) and TP degree. TP > 1 runs in spawned gloo ranks, one process per rank: 4 processes
run TP=4, then ranks 0 and 1 re-form a TP=2 group, and every rank's logits are checked.
References come from transformers: a full forward over the prompt plus its greedy `generate`
continuation, which our greedy tokens must equal.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from phalanx.models.qwen35 import DecodeBatch, PrefillBatch, Qwen35Model

PAGE_SIZE = 16
DECODE_STEPS = 32  # after the prefill: 33 greedy tokens in all, compared with generate
PROMPT_LEN = 100  # > 64: transformers' chunked delta rule runs two chunks
BATCH_LENS = (5, 17, 40, 70)
CHUNKS = (1, 3, 64)  # then the rest
SECOND_CHUNK_AT = 24  # request 3 of the batch is prefilled in two chunks
BATCH_DECODE_STEPS = 8
REL_TOL = 1e-4


@dataclass
class Reference:
    prompts: list[list[int]]  # prompt 0 is the long one, 1.. are the batch
    continuations: list[list[int]]  # transformers' greedy tokens after each prompt (33 / 8 of them)
    logits: list[torch.Tensor]  # [len(prompt) + len(continuation), vocab]


def make_prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (PROMPT_LEN, *BATCH_LENS)]


def hf_reference(model_dir: Path, seed: int) -> Reference:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # never stop early
    hf.generation_config.pad_token_id = 0
    prompts = make_prompts(384, seed)
    continuations, logits = [], []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            new_tokens = DECODE_STEPS + 1 if i == 0 else BATCH_DECODE_STEPS
            out = hf.generate(
                ids, max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            continuations.append(out[0, len(prompt) :].tolist())
            logits.append(hf(input_ids=out).logits[0].float())
    return Reference(prompts, continuations, logits)


# ----- scenarios (run on every rank) --------------------------------------------------------------


class Pages:
    """Hands out distinct pages per request, like the scheduler would."""

    def __init__(self) -> None:
        self.next = 1  # page 0 stays unused as a padding page

    def take(self, tokens: int) -> list[int]:
        count = -(-tokens // PAGE_SIZE)
        pages = list(range(self.next, self.next + count))
        self.next += count
        return pages


def greedy_decode(
    model: Qwen35Model, rows: list[tuple[int, int, int, list[int]]], steps: int
) -> torch.Tensor:
    """rows: (first token, position, slot, pages); feeds back argmax; returns logits [steps, B, vocab]."""
    out = []
    for _ in range(steps):
        logits = model.decode(DecodeBatch.build(rows, max_pages=max(len(r[3]) for r in rows)))
        out.append(logits)
        next_tokens = logits.argmax(-1).tolist()
        rows = [
            (tok, pos + 1, slot, pages) for tok, (_, pos, slot, pages) in zip(next_tokens, rows, strict=True)
        ]
    return torch.stack(out)


def run_scenarios(model: Qwen35Model, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    model.allocate_cache(num_pages_total=64, page_size=PAGE_SIZE, num_state_slots=8)
    results: dict[str, torch.Tensor] = {}
    pages = Pages()
    prompt = prompts[0]
    total = len(prompt) + DECODE_STEPS + 1

    whole_pages = pages.take(total)
    results["whole"] = model.prefill(PrefillBatch.build([(prompt, 0, 0, whole_pages)]), all_logits=True)

    chunk_pages = pages.take(total)
    parts, pos = [], 0
    for length in (*CHUNKS, len(prompt) - sum(CHUNKS)):
        chunk = (prompt[pos : pos + length], pos, 1, chunk_pages)
        parts.append(model.prefill(PrefillBatch.build([chunk]), all_logits=True))
        pos += length
    results["chunks"] = torch.cat(parts)
    # The chunked request then decodes from its carried state: prefill + 32 greedy steps.
    first = int(parts[-1][-1].argmax())
    results["decode"] = torch.cat(
        [parts[-1][-1:], greedy_decode(model, [(first, len(prompt), 1, chunk_pages)], DECODE_STEPS)[:, 0]]
    )

    # Four requests prefilled together (the last one in its second chunk), then decoded together.
    batch = prompts[1:]
    batch_pages = [pages.take(len(p) + BATCH_DECODE_STEPS) for p in batch]
    head = batch[-1][:SECOND_CHUNK_AT]
    model.prefill(PrefillBatch.build([(head, 0, 7, batch_pages[-1])]))
    chunks = [(p, 0, 2 + i, batch_pages[i]) for i, p in enumerate(batch[:-1])]
    chunks.append((batch[-1][SECOND_CHUNK_AT:], SECOND_CHUNK_AT, 7, batch_pages[-1]))
    results["batch_prefill"] = model.prefill(PrefillBatch.build(chunks), all_logits=True)
    last = results["batch_prefill"][PrefillBatch.build(chunks).cu_seqlens[1:].long() - 1]
    rows = [
        (int(last[i].argmax()), len(p), chunk[2], batch_pages[i])
        for i, (p, chunk) in enumerate(zip(batch, chunks, strict=True))
    ]
    results["batch_decode"] = greedy_decode(model, rows, BATCH_DECODE_STEPS)
    return results


# ----- checks against transformers -------------------------------------------------------------


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst over positions of max |Δ| / max |ref| at that position."""
    return float(((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max())


def check_against(results: dict[str, torch.Tensor], ref: Reference, label: str) -> None:
    n = PROMPT_LEN
    expected = {
        "whole": ref.logits[0][:n],
        "chunks": ref.logits[0][:n],
        "decode": ref.logits[0][n - 1 : n + DECODE_STEPS],
    }
    for name, want in expected.items():
        err = relative_error(results[name], want)
        assert err <= REL_TOL, f"{label} {name}: relative error {err:.2e} > {REL_TOL}"
    ours_greedy = results["decode"].argmax(-1).tolist()
    assert ours_greedy == ref.continuations[0], f"{label}: greedy continuation differs from transformers"

    batch = ref.prompts[1:]
    offsets = [0]
    for i, prompt in enumerate(batch):
        length = len(prompt) - (SECOND_CHUNK_AT if i == len(batch) - 1 else 0)
        offsets.append(offsets[-1] + length)
    for i, prompt in enumerate(batch):
        full = ref.logits[i + 1]
        start = SECOND_CHUNK_AT if i == len(batch) - 1 else 0
        got = results["batch_prefill"][offsets[i] : offsets[i + 1]]
        err = relative_error(got, full[start : len(prompt)])
        assert err <= REL_TOL, f"{label} batch request {i} prefill: relative error {err:.2e}"
        decoded = results["batch_decode"][:, i]
        want = full[len(prompt) : len(prompt) + BATCH_DECODE_STEPS]
        err = relative_error(decoded, want)
        assert err <= REL_TOL, f"{label} batch request {i} decode: relative error {err:.2e}"
        tokens = [int(got[-1].argmax())] + decoded.argmax(-1).tolist()[:-1]
        assert tokens == ref.continuations[i + 1][:BATCH_DECODE_STEPS], (
            f"{label} batch request {i}: tokens differ"
        )


# ----- fixtures and tests ---------------------------------------------------------------------------

MODELS = {"untied": ("tiny_model_dir", 11), "tied": ("tiny_model_dir_tied", 12)}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: one intra-op thread is faster, and spares the other ranks' cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def references(request: pytest.FixtureRequest) -> dict[str, tuple[Path, Reference]]:
    out = {}
    for name, (fixture, seed) in MODELS.items():
        model_dir = request.getfixturevalue(fixture)
        out[name] = (model_dir, hf_reference(model_dir, seed))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_tp1_matches_transformers(references: dict[str, tuple[Path, Reference]], name: str) -> None:
    model_dir, ref = references[name]
    model = Qwen35Model.load(model_dir)
    check_against(run_scenarios(model, ref.prompts), ref, f"TP=1 {name}")


TP_DEGREES = (4, 2)  # one spawned group of 4 processes; ranks 0 and 1 then re-form a TP=2 group


def _rank_main(rank: int, jobs: list[tuple[str, str, list[list[int]]]], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    for world_size in TP_DEGREES:
        if rank >= world_size:
            return
        rendezvous = f"file://{out_dir}/rendezvous-tp{world_size}"
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
        try:
            for name, model_dir, prompts in jobs:
                model = Qwen35Model.load(model_dir, rank=rank, world_size=world_size)
                torch.save(
                    run_scenarios(model, prompts), Path(out_dir) / f"tp{world_size}-{name}-rank{rank}.pt"
                )
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(references: dict[str, tuple[Path, Reference]]) -> Iterator[Path]:
    """Runs every scenario at each TP degree in spawned gloo ranks; yields the folder of results."""
    jobs = [(name, str(model_dir), ref.prompts) for name, (model_dir, ref) in references.items()]
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _rank_main, args=(jobs, out_dir), nprocs=max(TP_DEGREES), join=False, start_method="spawn"
        )
        deadline = time.monotonic() + 240
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail("TP ranks did not finish within 240 s")
        yield Path(out_dir)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_transformers(
    references: dict[str, tuple[Path, Reference]], tp_results: Path, world_size: int
) -> None:
    for name, (_, ref) in references.items():
        for rank in range(world_size):
            results = torch.load(tp_results / f"tp{world_size}-{name}-rank{rank}.pt")
            check_against(results, ref, f"TP={world_size} rank {rank} {name}")
