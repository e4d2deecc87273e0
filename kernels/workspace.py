"""Per-device scratch buffers that only grow, and never inside a CUDA-graph capture.

Kernels that hand partial results between their programs (split-K's partial tiles, the fused GDN
step's per-head outputs) keep them in one workspace per device, shared by every launch: launches
on a stream run one after another (under PDL a kernel waits for the one before it to finish before
touching memory). Arrival counters are zeroed once and left at zero by every launch. A workspace
grows outside capture only (the graph sweep's warm-up meets every shape first), and a grown-out
buffer set is kept alive, as graphs captured earlier still point at it.
"""

from __future__ import annotations

import torch


class GrowOnlyWorkspace:
    """Buffers of fixed dtypes per device, each at least as long as the largest length asked for.
    ``zeroed`` says, per buffer, whether it starts as zeros (arrival counters) or uninitialised."""

    def __init__(self, what: str, dtypes: tuple[torch.dtype, ...], zeroed: tuple[bool, ...]) -> None:
        if len(dtypes) != len(zeroed):
            raise ValueError(f"{what}: {len(dtypes)} dtypes but {len(zeroed)} zeroed flags")
        self.what = what
        self.dtypes = dtypes
        self.zeroed = zeroed
        self.current: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._outgrown: list[tuple[torch.Tensor, ...]] = []

    def get(
        self, device: torch.device, lengths: tuple[int, ...], needed_for: str
    ) -> tuple[torch.Tensor, ...]:
        """The buffers on ``device``, grown to ``lengths`` elements where shorter. ``needed_for``
        names the shape in the error raised when growing would happen inside a capture."""
        current = self.current.get(device)
        if current is not None and all(t.numel() >= n for t, n in zip(current, lengths, strict=True)):
            return current
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.what} for {needed_for} first needed inside CUDA-graph capture: "
                "run one eager step of this batch bucket before capture"
            )
        if current is not None:
            self._outgrown.append(current)
            lengths = tuple(max(n, t.numel()) for t, n in zip(current, lengths, strict=True))
        self.current[device] = tuple(
            (torch.zeros if zero else torch.empty)(n, dtype=dtype, device=device)
            for n, dtype, zero in zip(lengths, self.dtypes, self.zeroed, strict=True)
        )
        return self.current[device]
