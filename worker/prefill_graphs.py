"""CUDA graphs for a short prefill of one chunk: a prefix-cache hit's suffix, a short prompt.

Such a pass is bound by its host launches (~800 kernels for a few ms of GPU work,
docs/benchmarks/prefill-h200.md); replayed from a graph it costs the GPU's time only. A chunk of
L tokens runs in the graph of the smallest bucket T >= L: its batch is the chunk and a padding
chunk of S - L tokens (S = T + 64), which starts fresh in the reserved padding state slot and
writes its K/V to the padding page, so every kernel sees an ordinary two-chunk batch and none
needs to know about the padding. What a graph's shapes depend on is fixed per graph (``GraphKey``):
the token count S, fla-core's chunk count (one more when L is not a multiple of 64) and the number
of state captures (0 or 1). The inputs live in one int64 buffer that the graph reads, cut into the
batch's views and cast by the graph's own first ops, and filled by one copy before each replay.

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
PADDING = GDN_CHUNK  # the padding chunk's least length
GRAPHED_PREFILL_TOKENS = GRAPH_TOKENS[-1] + PADDING  # the largest graphed pass (its memory is planned)


@dataclass(frozen=True)
class GraphKey:
    tokens: int  # the bucket T; the batch holds T + PADDING tokens
    aligned: bool  # the chunk's length is a multiple of GDN_CHUNK
    captures: int  # state captures in the pass (0 or 1)

    @property
    def total(self) -> int:
        return self.tokens + PADDING


class PrefillGraphRunner:
    """Padded single-chunk prefills from fixed buffers, replayed from CUDA graphs on the GPU."""

    def __init__(self, model, device: torch.device, *, pad_slot: int, pad_page: int, max_pages: int) -> None:
        self.model = model
        self.device = device
        self.pad_slot = pad_slot
        self.pad_page = pad_page
        self.max_pages = max_pages
        positions = max_pages * model.page_size
        self.buckets = tuple(t for t in GRAPH_TOKENS if t + PADDING <= positions)
        self.keys = [
            GraphKey(t, aligned, m) for t in self.buckets for aligned in (True, False) for m in (0, 1)
            if m == 0 or t > GDN_CHUNK  # a capture falls 64 or more tokens into its chunk
        ]  # fmt: skip
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
                key = GraphKey(bucket, tokens % GDN_CHUNK == 0, captures)
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
            length = key.tokens if key.aligned else key.tokens - 1
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
        slots = key.total
        table = slots + 2
        bounds = table + 2 * self.max_pages
        return 0, slots, table, bounds

    def _stage(
        self, key: GraphKey, tokens: list[int], start: int, slot: int, pages: list[int],
        captures: list[tuple[int, int]],
    ) -> VarlenLayout:  # fmt: skip
        """Writes the padded batch into the buffer (one copy); returns its layout."""
        length = len(tokens)
        layout = VarlenLayout.plan(
            [length, key.total - length], [start, 0], [(0, offset, to) for offset, to in captures]
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
        return dataclasses.replace(layout, longest=key.total, continues=True, continues_all=False)

    def _body(self, key: GraphKey, layout: VarlenLayout) -> torch.Tensor:
        """The padded pass from the buffer: logits [2, vocab] (the chunk's, then the padding's)."""
        tokens_at, slots_at, table_at, bounds_at = self._offsets(key)
        buffer = self._buffer
        batch = PrefillBatch(
            tokens=buffer[tokens_at : tokens_at + key.total],
            state_slots=buffer[slots_at : slots_at + 2],
            page_tables=buffer[table_at:bounds_at].view(2, self.max_pages).to(torch.int32),
            varlen=Varlen.from_packed(buffer[bounds_at:], layout),
            token_range=(0, 0),  # checked by the caller: the buffer's ids are not on the host
        )
        return self.model.prefill(batch)


def _varlen_size(key: GraphKey) -> int:
    """Packed int64 values of a two-chunk batch's bounds (``VarlenLayout``) for ``key``."""
    fla_chunks = key.tokens // GDN_CHUNK + (1 if key.aligned else 2)
    return 3 + 2 + 2 * key.total + 2 * fla_chunks + 3 * key.captures
