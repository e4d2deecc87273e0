"""CUDA-graph decode on the GPU: graph replay against eager decode on the tiny model (bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.models.qwen35.batch import DecodeBatch
from phalanx.worker.errors import WorkerStateError
from phalanx.worker.graph_geometry import GraphError
from tests.worker.test_graphs_runner import PAGE_SIZE, Pair

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
# bf16 weights: graph and eager run the same kernels, but padded batches change GEMM shapes.
BF16_RELATIVE_ERROR = 2e-2
LONG_PAGES = 40  # 320 positions: a prompt and 256 generated tokens


def _pair(model_dir: Path, n: int, pages_per_request: int = 4) -> Pair:
    pair = Pair(
        model_dir,
        n,
        device=CUDA,
        dtype=torch.bfloat16,
        relative_error=BF16_RELATIVE_ERROR,
        pages_per_request=pages_per_request,
    )
    assert pair.runner.uses_cuda_graphs, "the gate kept decode eager on CUDA"
    return pair


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_graph_logits_match_eager_across_bucket_straddles(tiny_model_dir: Path, batch: int) -> None:
    pair = _pair(tiny_model_dir, batch)
    for _ in range(4):
        pair.step(list(range(batch)))
    assert pair.runner.replays == 4


def test_replaying_the_last_graph_is_decoding_the_same_rows_again(tiny_model_dir: Path) -> None:
    """``replay_last`` (what ``bench decode`` times as the graph alone) runs what more decodes of
    the same rows would: the plain model decodes them twice more and the logits agree."""
    pair = _pair(tiny_model_dir, 3)
    rows = pair.rows([0, 1, 2])
    with pytest.raises(GraphError, match="replay_last needs a CUDA-graph decode to replay; none has run"):
        pair.runner.replay_last(1)
    pair.runner.decode(DecodeBatch.build(rows))
    with pytest.raises(GraphError, match="replay_last of 0 replays; give at least 1"):
        pair.runner.replay_last(0)
    got = pair.runner.replay_last(2)
    for _ in range(3):
        expected = pair.plain.decode(DecodeBatch.build(rows, CUDA, max_pages=pair.pages_per_request))
    assert got.shape == expected.shape and pair.runner.replays == 3
    error = float((got.float() - expected.float()).norm() / expected.float().norm())
    assert error <= BF16_RELATIVE_ERROR, f"logits differ by {error:.3g} (relative)"


def test_graph_logits_match_eager_after_slot_compaction(tiny_model_dir: Path) -> None:
    pair = _pair(tiny_model_dir, 5)
    pair.step([0, 1, 2, 3, 4])
    pair.move(4, 1)  # request 1 retires from slot 1; the last slot moves into the hole
    for _ in range(3):
        pair.step([0, 4, 2, 3])
    pair.step([0, 4, 2])  # bucket 4 with one padding row in a freed slot


def test_256_greedy_tokens_identical_with_and_without_graphs(tiny_model_dir: Path) -> None:
    pair = _pair(tiny_model_dir, 1, pages_per_request=LONG_PAGES)
    eager_tokens: list[int] = []
    graph_tokens: list[int] = []
    eager_next = graph_next = pair.token[0]
    start = pair.position[0]
    for step in range(256):
        position = start + step
        pages = pair.pages(0)[: position // PAGE_SIZE + 1]
        # The same page-table width as the graph's, so both run exactly the same kernels.
        eager = pair.plain.decode(
            DecodeBatch.build([(eager_next, position, 0, pages)], CUDA, max_pages=LONG_PAGES)
        )
        graph = pair.runner.decode(DecodeBatch.build([(graph_next, position, 0, pages)]))
        eager_next = int(eager.argmax(-1).item())
        graph_next = int(graph.argmax(-1).item())
        eager_tokens.append(eager_next)
        graph_tokens.append(graph_next)
    assert graph_tokens == eager_tokens
    assert pair.runner.replays == 256


def test_graph_steps_staged_while_earlier_replays_wait_read_their_own_rows(tiny_model_dir: Path) -> None:
    """Each replay reads its rows from pinned host buffers when its first kernel runs. With a
    sleeping kernel ahead of every replay, the host stages each next step while the previous
    replay still waits on the GPU; it must wait for that replay to have read its rows before
    refilling the buffers, so every step's logits are those of its own rows."""
    pair = _pair(tiny_model_dir, 3)
    requests = [0, 1, 2]
    expected, got = [], []
    for step in range(6):
        rows = pair.rows(requests)
        expected.append(pair.plain.decode(DecodeBatch.build(rows, CUDA, max_pages=pair.pages_per_request)))
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time: the replay below queues behind it
        got.append(pair.runner.decode(DecodeBatch.build(rows)).clone())
        for r in requests:  # new tokens every step, none read back from the GPU
            pair.token[r] = (pair.token[r] * 7 + 3 + step) % 384
            pair.position[r] += 1
    for step, (out, ref) in enumerate(zip(got, expected, strict=True)):
        error = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert error <= BF16_RELATIVE_ERROR, f"step {step}: logits differ by {error:.3g} (relative)"


def test_graph_steps_land_their_greedy_tokens_in_the_pinned_ring(tiny_model_dir: Path) -> None:
    """Each replay's greedy tokens land on the host in the ring half of its step's parity (no copy
    call): equal to the logits' argmax for each of two steps in a row, while the step before's
    half still holds its own; the step after next overwrites a half, and reading the older step's
    tokens from it is refused."""
    pair = _pair(tiny_model_dir, 3)
    landed, argmax = [], []
    for _ in range(3):
        logits = pair.runner.decode(DecodeBatch.build(pair.rows([0, 1, 2])))
        torch.cuda.synchronize()
        landed.append(pair.runner.landed_tokens())
        argmax.append(logits.argmax(-1).tolist())
    assert landed[1].read() == argmax[1] and landed[2].read() == argmax[2]
    assert landed[1].seq + 1 == landed[2].seq
    with pytest.raises(
        WorkerStateError,
        match=rf"greedy tokens of decode step {landed[0].seq} were overwritten by step {landed[2].seq} "
        "before rank 0 read them",
    ):
        landed[0].read()
