"""CUDA graphs for a short prefill of one chunk: a prefix-cache hit's suffix, a short prompt.

Such a pass is bound by its host launches (~800 kernels for a few ms of GPU work,
docs/benchmarks/prefill-h200.md); replayed from a graph it costs the GPU's time only. A chunk of
L tokens runs in the graph of the smallest bucket T >= L. A chunk of exactly T tokens is the batch
alone; a shorter one sits beside a padding chunk of T - L tokens, which starts fresh in the
reserved padding state slot and writes its K/V to the padding page, so every kernel sees an
ordinary batch of T tokens and none needs to know about the padding (no padding chunk of its own
for a full bucket: at 128 + 64 rows cuBLAS took 1.2 ms more than at 128, prefill-h200.md). What a
graph's shapes depend on is fixed per graph (``GraphKey``): the token count T, whether the chunk
fills it, fla-core's chunk count (one more when L is not a multiple of 64) and the number of state
captures (0 or 1). The inputs live in one int64 buffer that the graph reads, cut into the batch's
views and cast by the graph's own first ops, and filled by one copy before each replay.

On CPU the same buffers run eagerly (no graphs), so the CPU tests check the padded pass against
the plain one. One rank only (TP 1): graphs with collectives are captured by the pre-capture sweep.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import structlog
import torch

from phalanx.kernels.varlen import GDN_CHUNK, Varlen, VarlenLayout
from phalanx.models.qwen35 import PrefillBatch

log = structlog.get_logger("phalanx.prefill_graphs")

GRAPH_TOKENS = (64, 128, 256, 512)  # the buckets of a chunk's length
GRAPHED_PREFILL_TOKENS = GRAPH_TOKENS[-1]  # the largest graphed pass (its memory is planned)


@dataclass(frozen=True)
class GraphKey:
    tokens: int  # the bucket T: the batch's token count
    aligned: bool  # the chunk's length is a multiple of GDN_CHUNK
    captures: int  # state captures in the pass (0 or 1)
    padded: bool = True  # the chunk is shorter than T, and a padding chunk fills the rest

    @property
    def chunks(self) -> int:
        return 2 if self.padded else 1


class PrefillGraphRunner:
    """Padded single-chunk prefills from fixed buffers, replayed from CUDA graphs on the GPU."""

    def __init__(self, model, device: torch.device, *, pad_slot: int, pad_page: int, max_pages: int) -> None:
        self.model = model
        self.device = device
        self.pad_slot = pad_slot
        self.pad_page = pad_page
        self.max_pages = max_pages
        positions = max_pages * model.page_size
        self.buckets = tuple(t for t in GRAPH_TOKENS if t <= positions)
        # (aligned, padded): a chunk of T tokens, a shorter multiple of 64, any other length
        shapes = ((True, False), (True, True), (False, True))
        keys = [GraphKey(t, a, m, p) for t in self.buckets for a, p in shapes for m in (0, 1)]
        below = dict(zip(self.buckets, (0, *self.buckets), strict=False))  # each bucket's predecessor
        # a key serves a chunk longer than the bucket below, and a capture falls 64 or more tokens into it
        self.keys = [k for k in keys if _longest(k) > max(below[k.tokens], GDN_CHUNK if k.captures else 0)]
        size = max((self._offsets(key)[-1] + _varlen_size(key) for key in self.keys), default=0)
        self._buffer = torch.zeros(size, dtype=torch.int64, device=device)
        # the buffer's host side, pinned once: pinning a fresh block for every pass took ~1 ms of host time
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy read it
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def key_for(self, tokens: int, start: int, pages: int, captures: int) -> GraphKey | None:
        """The graph a chunk of ``tokens`` at ``start`` over ``pages`` pages with ``captures``
        state captures runs in, if any."""
        if captures > 1 or pages > self.max_pages:
            return None
        for bucket in self.buckets:
            if tokens <= bucket:
                key = GraphKey(bucket, tokens % GDN_CHUNK == 0, captures, tokens < bucket)
                return key if key in self.keys else None
        return None

    def prefill(
        self, key: GraphKey, tokens: list[int], start: int, slot: int, pages: list[int],
        captures: list[tuple[int, int]],
    ) -> torch.Tensor:  # fmt: skip
        """Logits [1, vocab] at the chunk's last token; ``captures``: (offset, state slot)."""
        self.model.check_prefill_extent((start + len(tokens),), len(pages))
        self.model.check_token_ids((min(tokens), max(tokens)))
        layout = self._stage(key, tokens, start, slot, pages, captures)
        graph = self._graphs.get(key)
        if graph is None:
            return self._body(key, layout)[:1]
        graph[0].replay()
        return graph[1][:1].clone()  # the next replay overwrites the graph's output

    def capture(self) -> None:
        """Warm up and capture every key's graph (on CUDA; on CPU nothing is captured)."""
        if self.device.type != "cuda" or self._graphs:
            return
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for key in self.keys:
            length = _longest(key)
            captures = [(GDN_CHUNK, self.pad_slot)] * key.captures
            layout = self._stage(key, [0] * length, 0, self.pad_slot, [self.pad_page], captures)
            for _ in range(2):  # compiles and tunes every kernel for these shapes
                self._body(key, layout)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._body(key, layout)
            self._graphs[key] = (graph, logits)
        log.info("prefill graphs captured", graphs=len(self._graphs), buckets=list(self.buckets),
                 seconds=round(time.perf_counter() - started, 2))  # fmt: skip

    def _offsets(self, key: GraphKey) -> tuple[int, int, int, int]:
        """Where the token ids, state slots, page table and chunk bounds start in the buffer."""
        slots = key.tokens
        table = slots + 2
        bounds = table + 2 * self.max_pages
        return 0, slots, table, bounds

    def _stage(
        self, key: GraphKey, tokens: list[int], start: int, slot: int, pages: list[int],
        captures: list[tuple[int, int]],
    ) -> VarlenLayout:  # fmt: skip
        """Writes the batch (a short chunk padded) into the buffer (one copy); returns its layout."""
        length = len(tokens)
        padding = key.tokens - length
        layout = VarlenLayout.plan(
            [length, padding] if padding else [length],
            [start, 0] if padding else [start],
            [(0, offset, to) for offset, to in captures],
        )
        if self._copied is not None:
            self._copied.synchronize()  # the previous pass's copy has read the host block
        tokens_at, slots_at, table_at, bounds_at = self._offsets(key)
        host = self._host.numpy()
        host[tokens_at : tokens_at + length] = tokens
        host[tokens_at + length : slots_at] = 0
        host[slots_at:table_at] = (slot, self.pad_slot)
        table = host[table_at:bounds_at].reshape(2, self.max_pages)
        table[0, : len(pages)] = pages
        table[0, len(pages) :] = pages[0]
        table[1] = self.pad_page
        end = bounds_at + len(layout.packed)
        host[bounds_at:end] = layout.packed
        self._buffer[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        # A key's graph is captured once for every start and length it serves, so the host facts
        # its kernels branch on are the key's: the pass always gathers the chunks' states and
        # masks the fresh ones (the padding chunk always is), even for a chunk that starts at 0.
        return dataclasses.replace(layout, longest=key.tokens, continues=True, continues_all=False)

    def _body(self, key: GraphKey, layout: VarlenLayout) -> torch.Tensor:
        """The pass from the buffer: logits [chunks, vocab] (the chunk's, then any padding's)."""
        tokens_at, slots_at, table_at, bounds_at = self._offsets(key)
        buffer = self._buffer
        batch = PrefillBatch(
            tokens=buffer[tokens_at : tokens_at + key.tokens],
            state_slots=buffer[slots_at : slots_at + key.chunks],
            page_tables=buffer[table_at:bounds_at].view(2, self.max_pages)[: key.chunks].to(torch.int32),
            varlen=Varlen.from_packed(buffer[bounds_at:], layout),
            token_range=(0, 0),  # checked by the caller: the buffer's ids are not on the host
        )
        return self.model.prefill(batch)


def _longest(key: GraphKey) -> int:
    """The longest chunk ``key`` serves."""
    return key.tokens - (0 if not key.padded else GDN_CHUNK if key.aligned else 1)


def _varlen_size(key: GraphKey) -> int:
    """Packed int64 values of the batch's bounds (``VarlenLayout``) for ``key``."""
    fla_chunks = key.tokens // GDN_CHUNK + (0 if key.aligned else 1)
    return (key.chunks + 1) + key.chunks + 2 * key.tokens + 2 * fla_chunks + 3 * key.captures
