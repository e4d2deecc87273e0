"""CUDA capacity math on the CPU: the GPU's memory report is a test double, the sizing is real.

``--gpu-memory-utilization`` of the total, less what is in use after loading, the measured
activations, the graphs' pool and the slack, holds request states and KV pages; without
``--max-slots`` up to 256 requests, their states taking at most half of that."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from phalanx.protocol.launch import WorkerLimits
from phalanx.worker.capacity import (
    CUDA_SLACK_BYTES,
    GIB,
    SNAPSHOT_SHARE,
    CapacityError,
    batch_tokens_for,
    memory_line,
    size_capacity,
)
from phalanx.worker.memory_profile import ActivationProfile

MIB = 1 << 20
CUDA = torch.device("cuda", 0)


@dataclass
class _Model:
    weight_bytes: int = 8 * GIB
    world_size: int = 1
    state: int = 48 * MIB
    kv_page: int = 512 * 1024
    state_dtype: torch.dtype = torch.float32

    def state_bytes_per_slot(self) -> int:
        return self.state

    def kv_bytes_per_page(self, page_size: int) -> int:
        return self.kv_page


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    memory = {"free": 130 * GIB, "total": 140 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (memory["free"], memory["total"]))
    return memory


def _limits(**overrides: object) -> WorkerLimits:
    fields = dict(kv_pages=0, page_size=16, max_slots=0, max_batch_tokens=2048, gpu_memory_utilization=0.9)
    return WorkerLimits(**{**fields, **overrides})


def test_defaults_take_256_slots_and_give_the_rest_to_kv_pages(gpu: dict[str, int]) -> None:
    model, activations = _Model(), ActivationProfile(prefill=GIB, decode=GIB // 2)
    capacity, plan = size_capacity(_limits(), model, CUDA, 0, cuda_graph=True, activations=activations)
    assert plan is not None
    budget = int(140 * GIB * 0.9) - 10 * GIB - GIB - GIB // 2 - CUDA_SLACK_BYTES
    assert plan.for_caches == budget
    assert capacity.max_slots == 256
    # decode slots (the 256 bucket) + prefill staging + a graphed prefill's padding slot
    states = (256 + 256 + 1) * model.state
    snapshots = int(budget * SNAPSHOT_SHARE) // model.state  # a tenth of the cache memory
    assert capacity.snapshot_slots == snapshots == 243
    assert capacity.kv_pages == (budget - states - snapshots * model.state) // model.kv_page - 1
    line = memory_line(capacity, plan, model, True, 32768)
    assert (
        "(256 slots, recurrent state in float32)" in line
        and "graph buckets 1-256" in line
        and "activations 1.00 GiB" in line
    )
    assert (
        "request states 24.05 GiB (256 slots, recurrent state in float32), prefix snapshots 243 (11.39 GiB)"
        in line
    )
    off, _ = size_capacity(
        _limits(prefix_cache=False), model, CUDA, 0, cuda_graph=True, activations=activations
    )
    assert off.snapshot_slots == 0 and off.kv_pages == (budget - states) // model.kv_page - 1
    assert "prefix cache off" in memory_line(off, plan, model, True, 32768)


def test_prefix_snapshots_given_come_out_of_the_kv_pages(gpu: dict[str, int]) -> None:
    model = _Model()
    auto, _ = size_capacity(_limits(), model, CUDA, 0, cuda_graph=True)
    given, _ = size_capacity(_limits(prefix_snapshots=1000), model, CUDA, 0, cuda_graph=True)
    assert given.snapshot_slots == 1000 and given.max_slots == auto.max_slots
    freed = (1000 - auto.snapshot_slots) * model.state
    assert auto.kv_pages - given.kv_pages == pytest.approx(freed / model.kv_page, abs=1)
    with pytest.raises(CapacityError) as caught:
        size_capacity(_limits(prefix_snapshots=10_000), model, CUDA, 4, cuda_graph=True)
    assert str(caught.value).startswith(
        "rank 4: no memory is left for KV pages after 256 request states and 10000 prefix snapshots ("
    )


def test_auto_snapshots_leave_the_kv_pool_at_least_half_of_what_the_states_leave(
    gpu: dict[str, int],
) -> None:
    """With --max-slots the states may take most of the memory: the snapshots take at most half
    of the rest, not a tenth of the whole."""
    model = _Model(state=400 * MIB)
    capacity, plan = size_capacity(_limits(max_slots=130), model, CUDA, 0, cuda_graph=False)
    assert plan is not None
    left = plan.for_caches - 2 * capacity.max_slots * model.state
    assert (
        capacity.snapshot_slots
        == left // 2 // model.state
        < int(plan.for_caches * SNAPSHOT_SHARE) // model.state
    )
    assert capacity.max_slots == 130 and capacity.snapshot_slots == 17
    assert capacity.kv_pages >= left // 2 // model.kv_page - 1


def test_states_take_at_most_half_of_the_cache_memory_by_default(gpu: dict[str, int]) -> None:
    model = _Model(state=400 * MIB)  # 256 requests would need 200 GiB of states
    capacity, plan = size_capacity(_limits(), model, CUDA, 0, cuda_graph=False)
    assert plan is not None
    assert 2 * capacity.max_slots * model.state <= plan.for_caches // 2
    assert 2 * (capacity.max_slots + 1) * model.state > plan.for_caches // 2


def test_an_explicit_max_slots_and_kv_pages_cap_what_fits(gpu: dict[str, int]) -> None:
    capacity, _ = size_capacity(_limits(max_slots=8, kv_pages=1000), _Model(), CUDA, 0, cuda_graph=True)
    assert (capacity.max_slots, capacity.kv_pages) == (8, 1000)


def test_a_lower_utilization_shrinks_the_pool(gpu: dict[str, int]) -> None:
    full, _ = size_capacity(_limits(), _Model(), CUDA, 0)
    half, _ = size_capacity(_limits(gpu_memory_utilization=0.5), _Model(), CUDA, 0)
    assert half.kv_pages < full.kv_pages // 2


def test_a_model_that_leaves_nothing_for_caches_is_one_sentence(gpu: dict[str, int]) -> None:
    gpu["free"] = 20 * GIB  # 120 GiB in use after loading: above the 0.5 × 140 allowed
    with pytest.raises(CapacityError) as caught:
        size_capacity(_limits(gpu_memory_utilization=0.5), _Model(weight_bytes=118 * GIB), CUDA, 3)
    assert str(caught.value) == (
        "rank 3: the model does not fit: nothing is left for the KV cache and request states "
        "(--gpu-memory-utilization 0.5 allows 70.0 of the GPU's 140.0 GiB; in use after loading "
        "120.0 GiB (weights 118.0 GiB), activations 0.00 GiB, CUDA graphs 0.00 GiB); raise "
        "--gpu-memory-utilization, use more GPUs (--tp), or lower --max-batch-tokens"
    )


def test_cpu_capacity_is_the_configured_limits() -> None:
    cpu = torch.device("cpu")
    capacity, plan = size_capacity(_limits(kv_pages=64, max_slots=4), _Model(), cpu, 0)
    assert (capacity.kv_pages, capacity.max_slots, capacity.snapshot_slots, plan) == (64, 4, 8, None)
    off, _ = size_capacity(_limits(kv_pages=64, max_slots=4, prefix_cache=False), _Model(), cpu, 0)
    given, _ = size_capacity(_limits(kv_pages=64, max_slots=4, prefix_snapshots=3), _Model(), cpu, 0)
    assert (off.snapshot_slots, given.snapshot_slots) == (0, 3)
    assert off.kv_pages == given.kv_pages == 64


def test_a_tp_rank_profiles_its_steps_before_the_process_group_exists(tiny_model_dir) -> None:
    """The profile run's collectives are skipped (no process group yet) and keep their shapes:
    rank 1 of 2 prefills and decodes to full-vocabulary logits, then drops its throwaway cache."""
    from phalanx.models.qwen35 import DecodeBatch, PrefillBatch, Qwen35Model

    model = Qwen35Model.load(tiny_model_dir, rank=1, world_size=2)
    model.allocate_cache(4, 16, 1)
    model.tp.local_only = True
    prefill = model.prefill(PrefillBatch.build([(list(range(20)), 0, 0, [0, 1])]))
    decode = model.decode(DecodeBatch.build([(0, 0, 0, [0])] * 3))
    model.tp.local_only = False
    model.release_cache()
    vocab = model.config.vocab_size
    assert prefill.shape == (1, vocab) and decode.shape == (3, vocab)
    with pytest.raises(RuntimeError, match="rank 1: decode before allocate_cache"):
        model.decode(DecodeBatch.build([(0, 0, 0, [0])]))


@pytest.mark.parametrize(
    ("name", "total_gib", "configured", "expected"),
    [
        ("NVIDIA H200", 140, 0, 8192),
        ("NVIDIA A100-SXM4-80GB", 80, 0, 2048),
        ("NVIDIA L40S", 45, 0, 2048),
        ("NVIDIA H200", 140, 4096, 4096),
    ],
)
def test_max_batch_tokens_follow_the_gpu_unless_configured(
    monkeypatch: pytest.MonkeyPatch, name: str, total_gib: int, configured: int, expected: int
) -> None:
    properties = type("Properties", (), {"total_memory": total_gib * GIB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
    limits = batch_tokens_for(_limits(max_batch_tokens=configured), CUDA)
    assert limits.max_batch_tokens == expected
    assert limits.max_slots == 0 and limits.gpu_memory_utilization == 0.9  # the rest kept


def test_max_batch_tokens_on_cpu_are_2048_unless_configured() -> None:
    cpu = torch.device("cpu")
    assert batch_tokens_for(_limits(max_batch_tokens=0), cpu).max_batch_tokens == 2048
    assert batch_tokens_for(_limits(max_batch_tokens=96), cpu).max_batch_tokens == 96
