"""How much one rank can hold: from the configured limits on CPU, from free memory on CUDA."""

from __future__ import annotations

import torch

from protocol.messages import Capacity
from worker.buckets import MAX_GRAPH_BATCH, size_graph_slot_reserve
from worker.config import WorkerLimits

# Kept free on CUDA for activations, the prefill scratch and the allocator. Capacity is sized
# before the process group exists, so the fraction also leaves room for NCCL's communicator
# buffers and for CUDA graphs' private pools (together a few GiB on a 141 GB GPU).
CUDA_RESERVE_BYTES = 512 << 20
CUDA_MEMORY_FRACTION = 0.9
MIB = 1 << 20


class CapacityError(RuntimeError):
    pass


def size_capacity(
    limits: WorkerLimits, model, device: torch.device, rank: int, cuda_graph: bool = False
) -> Capacity:
    """Each request needs two state slots (prefill staging and decode) and its KV pages.

    With CUDA graphs the decode slots are the graph slot reserve, sized by the effective bucket
    (``worker.buckets.size_graph_slot_reserve``), and the batch is at most the largest bucket.
    """
    max_slots = min(limits.max_slots, MAX_GRAPH_BATCH) if cuda_graph else limits.max_slots
    if device.type != "cuda":
        return Capacity(limits.kv_pages, limits.page_size, max_slots, limits.max_batch_tokens)
    free, _total = torch.cuda.mem_get_info(device)
    budget = int(free * CUDA_MEMORY_FRACTION) - CUDA_RESERVE_BYTES
    per_request_state = 2 * model.state_bytes_per_slot()
    if cuda_graph:
        state = model.state_bytes_per_slot()
        reserve = size_graph_slot_reserve(
            max_slots, max(0, budget), state, lambda left: min(max_slots, max(0, left) // state)
        )
        slots = reserve.max_batch
        # The graph reserve holds the decode slots (and the spare ones up to the bucket).
        budget -= reserve.reserve_bytes - slots * state
    else:
        slots = min(max_slots, max(0, budget) // per_request_state)
    if slots < 1:
        raise CapacityError(
            f"rank {rank} has {free // MIB} MiB free, but one request's recurrent state needs "
            f"{per_request_state // MIB} MiB beyond the {CUDA_RESERVE_BYTES // MIB} MiB reserve and "
            f"the {1 - CUDA_MEMORY_FRACTION:.0%} kept for the communicator"
        )
    budget -= slots * per_request_state
    pages = budget // model.kv_bytes_per_page(limits.page_size) - 1  # one page is the padding page
    if limits.kv_pages:
        pages = min(pages, limits.kv_pages)
    if pages < 1:
        raise CapacityError(f"rank {rank} has no memory left for KV pages after {slots} request states")
    return Capacity(int(pages), limits.page_size, int(slots), limits.max_batch_tokens)
