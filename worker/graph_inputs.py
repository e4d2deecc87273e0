"""The static decode inputs a rank's graphs read, and how each step's rows get into them.

Tokens, positions and state slots are the rows of one ``[3, top]`` device buffer, beside a
``[top, max_pages]`` page table; both have pinned host twins, filled through numpy views (a step's
staging is on the critical path of every decode step, and a numpy slice assignment costs a
fraction of a torch op). Padding rows (the bucket's rows past the batch) get token 0, position 0,
a free state slot and the padding page.

A row staged with a negative token (``FED_TOKEN``, a pipelined step) takes its token on the device
from ``fed_tokens`` at its state slot, where the previous step's sampled token was written.

Two ways from the host buffers to the device ones:

- **In the graph** (CUDA graphs): the graph's first kernel reads the pinned buffers itself
  (``kernels/host_staging_triton.py``), so a step costs no copy call and no event. Before the host
  refills the buffers it checks that the previous step's kernel has acknowledged reading them (a
  pinned word the kernel writes); if not, it synchronises the device first.
- **By copies** (CPU, or CUDA without graphs): two host-to-device copies a step, and an event that
  the next step waits on before it reuses the pinned buffers.

The way back, in the graph: the step's greedy tokens land in a pinned ring (``landing``, two
halves, the step's sequence number parity picks one), written by the graph's last kernel, so rank
0 reads them once the step's event has completed, with no copy call (``LandedTokens``). A
pipelined rank reads a step's tokens before it launches the step after next, which is the next to
write the same half; the number stored beside the tokens proves it.
"""

from __future__ import annotations

import numpy as np
import torch

from phalanx.kernels.host_staging_triton import (
    HEADER_ACK,
    HEADER_COLUMNS,
    HEADER_SEQ,
    HEADER_SIZE,
    feed_tokens,
    load_staged_triton,
)
from phalanx.models.qwen35 import DecodeBatch
from phalanx.worker.errors import WorkerStateError

# Page-table views kept for reuse, one per (bucket, width) seen; widths grow a page at a time.
TABLE_VIEWS_KEPT = 256


class DecodeInputs:
    """One rank's static decode buffers for buckets up to ``top`` rows and ``max_pages`` pages a row."""

    def __init__(
        self,
        top: int,
        max_pages: int,
        padding_page: int,
        device: torch.device,
        in_graph: bool,
        state_slots: int | None = None,
    ) -> None:
        """``state_slots``: how many state slots rows (padding rows too) may name; ``top`` if None."""
        self.padding_page = padding_page
        self.device = device
        self.in_graph = in_graph
        self.rows = torch.zeros((3, top), dtype=torch.int64, device=device)
        self.tokens, self.positions, self.slots = self.rows.unbind(0)
        self.slots.copy_(torch.arange(top))
        self.fed_tokens = torch.zeros(state_slots or top, dtype=torch.int64, device=device)
        self.page_table = torch.full((top, max_pages), padding_page, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host_rows = torch.zeros((3, top), dtype=torch.int64, pin_memory=pin)
        # The first bucket x width entries hold a step's compact [bucket, width] page table.
        self._host_table = torch.zeros(top * max_pages, dtype=torch.int32, pin_memory=pin)
        self._host_rows_np = self._host_rows.numpy()
        self._table_views: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}
        self._copied: torch.cuda.Event | None = None  # copy mode: set after each step's copies
        # Graph mode: the staging kernel's copy of the step number, and the greedy tokens' ring.
        self.step: torch.Tensor | None = None
        self.landing: torch.Tensor | None = None
        if in_graph:
            self._header = torch.zeros(HEADER_SIZE, dtype=torch.int64, pin_memory=True)
            self._header_np = self._header.numpy()
            self._arrivals = torch.zeros(1, dtype=torch.int32, device=device)
            self.step = torch.zeros(1, dtype=torch.int64, device=device)
            self.landing = torch.full((2, 1 + top), -1, dtype=torch.int64, pin_memory=True)

    def stage(self, rows: np.ndarray, padding: list[int], table: np.ndarray, bucket: int) -> int:
        """Writes ``n`` rows (``rows`` [3, n]: tokens, positions, state slots), ``bucket - n`` padding
        rows taking the slots ``padding``, and the rows' ``[n, width]`` page table; returns the
        staged width (at least 1). In copy mode the device buffers hold them once this returns (in
        stream order); in graph mode once the graph's first kernel (``load``) has run. As few numpy
        calls as the rows allow: each is on the step's critical path."""
        n, width = rows.shape[1], table.shape[1]  # width <= max_pages: the runner checks it
        self._wait_until_reusable()
        host_rows = self._host_rows_np
        host_rows[:, :n] = rows
        if n < bucket:
            host_rows[:2, n:bucket] = 0
            host_rows[2, n:bucket] = padding
        # Device columns past the staged width keep older (valid) page ids: a kernel reads only up
        # to the row's position. Padding rows sit at position 0 and read the padding page.
        columns = max(width, 1)
        staged, host_table, device_table = self._table_view(bucket, columns)
        staged[:n, :width] = table
        if n < bucket:
            staged[n:] = self.padding_page
        if self.in_graph:
            self._header_np[HEADER_COLUMNS] = columns
            self._header_np[HEADER_SEQ] += 1  # last: the step is staged
        else:
            self._copy_to_device(host_table, device_table)
            if n and host_rows[0, :n].min() < 0:
                self.tokens[:n] = feed_tokens(self.tokens[:n], self.slots[:n], self.fed_tokens)
        return columns

    def stage_padding(self, bucket: int, padding: list[int]) -> None:
        """Every row padding (what the pre-capture sweep runs), taking the slots ``padding``."""
        self.stage(np.zeros((3, 0), dtype=np.int64), padding, np.zeros((0, 1), dtype=np.int32), bucket)

    def load(self, bucket: int) -> None:
        """Graph mode: launch the kernel that moves the staged rows of ``bucket`` onto the device
        (captured as a graph's first node; run eagerly before an eager step). Copy mode: nothing."""
        if self.in_graph:
            load_staged_triton(
                self._header,
                self._host_rows,
                self._host_table,
                self.rows,
                self.page_table,
                self._arrivals,
                self.fed_tokens,
                self.step,
                bucket,
            )

    def landed(self, rows: int) -> LandedTokens:
        """Where the greedy tokens of the step staged last land (graph mode)."""
        if self.landing is None:
            raise ValueError("landed tokens exist in graph mode only")
        return LandedTokens(self.landing, int(self._header_np[HEADER_SEQ]), rows)

    def batch(self, bucket: int, pages: int) -> DecodeBatch:
        """The static buffers' first ``bucket`` rows and ``pages`` page-table columns."""
        return DecodeBatch(
            tokens=self.tokens[:bucket],
            positions=self.positions[:bucket],
            state_slots=self.slots[:bucket],
            page_table=self.page_table[:bucket, :pages],
        )

    def _wait_until_reusable(self) -> None:
        """Blocks until nothing on the GPU still reads the pinned buffers of the previous step."""
        if self.in_graph:
            if self._header_np[HEADER_ACK] != self._header_np[HEADER_SEQ]:
                # Its graph has not run its first kernel yet (or the step was never replayed).
                torch.cuda.synchronize(self.device)
                self._header_np[HEADER_ACK] = self._header_np[HEADER_SEQ]
        elif self._copied is not None:
            self._copied.synchronize()

    def _copy_to_device(self, host_table: torch.Tensor, device_table: torch.Tensor) -> None:
        # All three rows in one contiguous copy (6 KB at most; columns past the bucket are unused).
        self.rows.copy_(self._host_rows, non_blocking=True)
        device_table.copy_(host_table, non_blocking=True)
        if self.device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def _table_view(self, bucket: int, columns: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """A [bucket, columns] page table's pinned staging (as numpy, which the host writes, and as
        a tensor, which copy mode copies from) and its device view, made once each: the step pays a
        dictionary lookup, not a slice and a reshape."""
        views = self._table_views.get((bucket, columns))
        if views is None:
            if len(self._table_views) >= TABLE_VIEWS_KEPT:  # widths grow with the context
                self._table_views.clear()
            host = self._host_table[: bucket * columns].view(bucket, columns)
            views = (host.numpy(), host, self.page_table[:bucket, :columns])
            self._table_views[(bucket, columns)] = views
        return views


class LandedTokens:
    """One graph step's greedy tokens in the pinned ring: ``landing[seq % 2]`` is [seq, tokens...]
    once the step's work on the GPU has completed."""

    def __init__(self, landing: torch.Tensor, seq: int, rows: int) -> None:
        self.landing, self.seq, self.rows = landing, seq, rows

    def read(self) -> list[int]:
        """The ``rows`` tokens (call after the step's event has completed)."""
        half = self.landing[self.seq % 2, : 1 + self.rows].tolist()
        if half[0] != self.seq:
            raise WorkerStateError(
                f"greedy tokens of decode step {self.seq} were overwritten by step {half[0]} "
                "before rank 0 read them"
            )
        return half[1:]
