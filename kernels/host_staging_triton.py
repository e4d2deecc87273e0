"""A decode graph's first kernel: the step's inputs read straight from pinned host memory.

The host writes a graph step's rows (tokens, positions, state slots) and page table into pinned
buffers. Copying those to the graph's static device buffers took two host-to-device copy calls and
an event record per step, host time all on the step's critical path, since the GPU has nothing
else to do meanwhile (measured: docs/benchmarks/kernel-choices-h200.md). This kernel is captured
as the graph's first node instead. Pinned memory is mapped into the GPU's address space (unified addressing), so it
reads the buffers over PCIe as the replay runs (``.cv`` loads: never a cached copy, the host
rewrites them between replays) and writes the static buffers; a step's host work is filling the
buffers and the replay.

The pinned header (int64) carries what changes with every step besides the rows:

- ``HEADER_SEQ``: the step's sequence number, written last by the host;
- ``HEADER_COLUMNS``: the page-table width staged this step (the host table is ``[bucket, columns]``,
  compact); the device table is ``[top, max_pages]``, and columns past ``columns`` keep what they
  held (valid page ids: kernels read a row's pages only up to its position);
- ``HEADER_ACK``: set to the sequence number by the last program to finish, after every program's
  reads: once the host sees it, the buffers may be refilled (``worker/graph_inputs.py``).

The sequence number is also stored on the device (``step``), for the graph's later kernels: the
greedy pick lands each step's tokens in the half of a pinned ring its parity names.

A row whose staged token is negative (``FED_TOKEN``, a pipelined step) takes its token from the
device buffer ``fed`` at the row's state slot: the token the previous step sampled there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from phalanx.kernels.launch import pdl_enabled

HEADER_SEQ, HEADER_COLUMNS, HEADER_ACK = 0, 1, 2
HEADER_SIZE = 4
_BLOCK = 128  # page ids a program copies per loop step


@triton.jit
def _load_staged_kernel(
    header_ptr, host_rows_ptr, host_table_ptr, rows_ptr, table_ptr, arrivals_ptr, fed_ptr, step_ptr, top,
    max_pages,
    SEQ: tl.constexpr, COLUMNS: tl.constexpr, ACK: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # The graph's first kernel: nothing to wait for. Letting the next kernel (PDL) launch now
    # means it is resident, past its own early reads, when this one ends.
    if USE_PDL:
        gdc_launch_dependents()
    row = tl.program_id(0)
    columns = tl.load(header_ptr + COLUMNS, cache_modifier=".cv")
    # Read now, beside the width: the host wrote it before the replay, and a read over PCIe at
    # the end would add a round trip (~1 µs) to the step's critical path.
    seq = tl.load(header_ptr + SEQ, cache_modifier=".cv")
    token = tl.load(host_rows_ptr + row, cache_modifier=".cv")
    slot = tl.load(host_rows_ptr + 2 * top + row, cache_modifier=".cv")
    fed = tl.load(fed_ptr + slot, mask=token < 0, other=0)
    tl.store(rows_ptr + row, tl.where(token < 0, fed, token))
    tl.store(rows_ptr + top + row, tl.load(host_rows_ptr + top + row, cache_modifier=".cv"))
    tl.store(rows_ptr + 2 * top + row, slot)
    if row == 0:
        tl.store(step_ptr, seq)
    offsets = tl.arange(0, BLOCK)
    for first in range(0, columns, BLOCK):
        cols = first + offsets
        mask = cols < columns
        pages = tl.load(host_table_ptr + row * columns + cols, mask=mask, cache_modifier=".cv")
        tl.store(table_ptr + row * max_pages + cols, pages, mask=mask)
    # The last program to arrive, after every program has read its share, tells the host.
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(header_ptr + ACK, seq, cache_modifier=".wt")
        tl.store(arrivals_ptr, 0)


def load_staged_triton(
    header: torch.Tensor,
    host_rows: torch.Tensor,
    host_table: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    arrivals: torch.Tensor,
    fed: torch.Tensor,
    step: torch.Tensor,
    bucket: int,
) -> None:
    """Copies the first ``bucket`` columns of ``host_rows`` [3, top] into ``rows`` [3, top] (a
    negative token replaced by ``fed`` [slots] at the row's slot) and the compact
    ``[bucket, header[HEADER_COLUMNS]]`` page table at the start of ``host_table`` into ``table``
    [top, max_pages], stores ``header[HEADER_SEQ]`` in ``step`` [1] (int64, on the device), then
    acknowledges it in ``header[HEADER_ACK]``. ``arrivals`` is an int32 counter on the device,
    zero between launches."""
    top, max_pages = rows.shape[1], table.shape[1]
    if host_rows.shape != rows.shape or not rows.is_contiguous() or not table.is_contiguous():
        raise ValueError(
            f"staging buffers do not match: host rows {tuple(host_rows.shape)}, rows {tuple(rows.shape)}, "
            f"table {tuple(table.shape)} (both contiguous)"
        )
    if not 1 <= bucket <= top or table.shape[0] != top:
        raise ValueError(f"staging bucket {bucket} outside 1..{top} or table rows {table.shape[0]} != {top}")
    _load_staged_kernel[(bucket,)](
        header, host_rows, host_table, rows, table, arrivals, fed, step, top, max_pages,
        SEQ=HEADER_SEQ, COLUMNS=HEADER_COLUMNS, ACK=HEADER_ACK, BLOCK=_BLOCK, USE_PDL=pdl_enabled(),
        num_warps=1,
    )  # fmt: skip


def feed_tokens(tokens: torch.Tensor, slots: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
    """``tokens`` with every negative entry (``FED_TOKEN``) replaced by ``fed`` at its slot."""
    return torch.where(tokens < 0, fed[slots.clamp(0, fed.shape[0] - 1)], tokens)
