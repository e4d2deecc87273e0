"""How much one rank can hold: from the configured limits on CPU, from measured memory on CUDA.

On CUDA the rank may use ``gpu_memory_utilization`` of the GPU's total memory (vLLM's meaning).
What is in use once the weights are loaded (weights, CUDA context, other processes), the
activations measured by a profile run (``worker.memory_profile``), the CUDA graphs' pool and a
fixed slack come off that; the rest holds request states and KV pages. Without an explicit
``max_slots``, up to the largest graph bucket of requests decode together, their states taking
at most half of the rest, so the KV pool keeps at least the other half.

Prefix-cache snapshots (``Capacity.snapshot_slots``) are request states too, kept in slots of
their own: none with the prefix cache off, ``prefix_snapshots`` when given, else on CUDA as many
as fit in a tenth of the cache memory (at most half of what the request states leave, so the KV
pool keeps most of its share), and on CPU two per decode slot. On CUDA they come out of the KV
pages, so the memory total holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from phalanx.protocol.buckets import MAX_GRAPH_BATCH, buckets_up_to
from phalanx.protocol.launch import WorkerLimits
from phalanx.protocol.messages import Capacity
from phalanx.worker.buckets import size_graph_slot_reserve, state_slot_layout
from phalanx.worker.memory_profile import ActivationProfile

# Kept free beyond the measured use: the allocator's fragmentation and cuBLAS/Triton workspaces.
CUDA_SLACK_BYTES = 512 << 20
# NCCL's communicator buffers and the one-shot all-reduce's symmetric memory, made after sizing.
COMMUNICATOR_BYTES = 1 << 30
GIB = 1 << 30
# The share of the cache memory (KV pages and states) auto-sized prefix snapshots take on CUDA.
SNAPSHOT_SHARE = 0.1
# Auto-sized prefix snapshots on CPU, per decode slot.
CPU_SNAPSHOTS_PER_SLOT = 2
# Prompt tokens of one prefill step when none is configured, as vLLM's server picks them: 8192 on
# a GPU of at least 70 GiB but an A100 (where vLLM measured it slower), 2048 elsewhere. On a large
# GPU a longer step keeps the prefill bound by its kernels, not by their launches
# (docs/benchmarks/serve-h200.md).
LARGE_GPU_BYTES = 70 * GIB
LARGE_GPU_BATCH_TOKENS = 8192
DEFAULT_BATCH_TOKENS = 2048


class CapacityError(RuntimeError):
    pass


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's CUDA memory, as sized at startup (bytes)."""

    total: int
    allowed: int  # total × gpu_memory_utilization
    in_use: int  # after loading: weights, CUDA context, other processes
    weights: int
    activations: int
    graphs: int
    slack: int
    state_per_slot: int
    kv_per_page: int

    @property
    def for_caches(self) -> int:
        return self.allowed - self.in_use - self.activations - self.graphs - self.slack


def batch_tokens_for(limits: WorkerLimits, device: torch.device) -> WorkerLimits:
    """``limits`` with ``max_batch_tokens`` as configured, or picked for ``device`` when 0."""
    if limits.max_batch_tokens:
        return limits
    tokens = DEFAULT_BATCH_TOKENS
    if device.type == "cuda":
        large = torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES
        if large and "A100" not in torch.cuda.get_device_name(device):
            tokens = LARGE_GPU_BATCH_TOKENS
    return msgspec.structs.replace(limits, max_batch_tokens=tokens)


def size_capacity(
    limits: WorkerLimits,
    model,
    device: torch.device,
    rank: int,
    cuda_graph: bool = False,
    activations: ActivationProfile | None = None,
) -> tuple[Capacity, MemoryPlan | None]:
    """(this rank's capacity, its memory plan on CUDA). Each request needs two state slots
    (prefill staging and decode) and its KV pages; with CUDA graphs the decode slots are the
    graph slot reserve, sized by the effective bucket (``size_graph_slot_reserve``). The prefix
    snapshots are sized last, and the KV pages get the rest."""
    if device.type != "cuda":
        slots = min(limits.max_slots, MAX_GRAPH_BATCH) if cuda_graph else limits.max_slots
        snapshots = _snapshot_slots(limits, CPU_SNAPSHOTS_PER_SLOT * slots)
        return Capacity(limits.kv_pages, limits.page_size, slots, limits.max_batch_tokens, snapshots), None
    plan = _plan(limits, model, device, cuda_graph, activations or ActivationProfile(0, 0))
    budget = plan.for_caches
    if budget <= 0:
        raise CapacityError(_does_not_fit(rank, limits, plan))
    state = plan.state_per_slot
    requested = limits.max_slots or MAX_GRAPH_BATCH
    if cuda_graph:
        requested = min(requested, MAX_GRAPH_BATCH)
    states_budget = budget // 2 if limits.max_slots == 0 else budget
    if cuda_graph:
        reserve = size_graph_slot_reserve(
            requested, states_budget, state, lambda left: min(requested, max(0, left) // state)
        )
        slots = reserve.max_batch
        state_bytes = reserve.reserve_bytes + (slots + 1) * state  # + a graphed prefill's padding slot
    else:
        slots = min(requested, states_budget // (2 * state))
        state_bytes = 2 * slots * state
    if slots < 1:
        raise CapacityError(
            f"rank {rank}: one request's recurrent state needs {2 * state / GIB:.2f} GiB, but only "
            f"{budget / GIB:.2f} GiB is left for caches ({_describe(limits, plan)})"
        )
    auto_bytes = min(int(budget * SNAPSHOT_SHARE), (budget - state_bytes) // 2)
    snapshots = _snapshot_slots(limits, max(0, auto_bytes) // state)
    state_bytes += snapshots * state
    pages = (budget - state_bytes) // plan.kv_per_page - 1  # one page is the padding page
    if limits.kv_pages:
        pages = min(pages, limits.kv_pages)
    if pages < 1:
        also = f" and {snapshots} prefix snapshots" if snapshots else ""
        raise CapacityError(
            f"rank {rank}: no memory is left for KV pages after {slots} request states{also} "
            f"({_describe(limits, plan)})"
        )
    capacity = Capacity(int(pages), limits.page_size, int(slots), limits.max_batch_tokens, int(snapshots))
    return capacity, plan


def _snapshot_slots(limits: WorkerLimits, auto: int) -> int:
    """Off, as given, or ``auto``."""
    if not limits.prefix_cache:
        return 0
    return limits.prefix_snapshots or auto


def _plan(
    limits: WorkerLimits, model, device: torch.device, cuda_graph: bool, activations: ActivationProfile
) -> MemoryPlan:
    free, total = torch.cuda.mem_get_info(device)
    return MemoryPlan(
        total=total,
        allowed=int(total * limits.gpu_memory_utilization),
        in_use=total - free,
        weights=model.weight_bytes,
        activations=activations.serving,
        # One pool serves every bucket's graph; the largest bucket's decode is its high-water mark.
        # The prefill graphs share another, as large as their largest pass.
        graphs=activations.decode + activations.graphed_prefill if cuda_graph else 0,
        slack=CUDA_SLACK_BYTES + (COMMUNICATOR_BYTES if model.world_size > 1 else 0),
        state_per_slot=model.state_bytes_per_slot(),
        kv_per_page=model.kv_bytes_per_page(limits.page_size),
    )


def _describe(limits: WorkerLimits, plan: MemoryPlan) -> str:
    return (
        f"--gpu-memory-utilization {limits.gpu_memory_utilization:g} allows {plan.allowed / GIB:.1f} "
        f"of the GPU's {plan.total / GIB:.1f} GiB; in use after loading {plan.in_use / GIB:.1f} GiB "
        f"(weights {plan.weights / GIB:.1f} GiB), activations {plan.activations / GIB:.2f} GiB, "
        f"CUDA graphs {plan.graphs / GIB:.2f} GiB"
    )


def _does_not_fit(rank: int, limits: WorkerLimits, plan: MemoryPlan) -> str:
    return (
        f"rank {rank}: the model does not fit: nothing is left for the KV cache and request states "
        f"({_describe(limits, plan)}); raise --gpu-memory-utilization, use more GPUs (--tp), "
        "or lower --max-batch-tokens"
    )


def memory_line(
    capacity: Capacity, plan: MemoryPlan | None, model, cuda_graph: bool, max_context: int
) -> str:
    """The one line a rank logs once its effective capacity is known."""
    layout = state_slot_layout(capacity.max_slots, cuda_graph, capacity.snapshot_slots)
    kv = (capacity.kv_pages + 1) * model.kv_bytes_per_page(capacity.page_size)
    states = layout.snapshot_base * model.state_bytes_per_slot()
    snapshots = layout.snapshot_slots * model.state_bytes_per_slot()
    buckets = buckets_up_to(capacity.max_slots) if cuda_graph else ()
    parts = [
        f"weights {model.weight_bytes / GIB:.2f} GiB",
        f"KV {kv / GIB:.2f} GiB ({capacity.kv_pages:,} pages of {capacity.page_size} tokens)",
        f"request states {states / GIB:.2f} GiB ({capacity.max_slots} slots, recurrent state in "
        f"{str(model.state_dtype).removeprefix('torch.')})",
        f"prefix snapshots {layout.snapshot_slots} ({snapshots / GIB:.2f} GiB)"
        if layout.snapshot_slots
        else "prefix cache off",
        f"max context {max_context:,} tokens",
        f"graph buckets {buckets[0]}-{buckets[-1]}" if buckets else "eager decode",
    ]
    if plan is not None:
        parts.append(f"activations {plan.activations / GIB:.2f} GiB")
        parts.append(f"{plan.allowed / GIB:.1f} of {plan.total / GIB:.1f} GiB allowed")
    return ", ".join(parts)
