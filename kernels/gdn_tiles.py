"""The [dk, BV] state tiles of the GDN decode step kernel: their tuning space and the tuned pick per batch.

The decode step kernel (``kernels/gdn_step_triton.py``) splits the recurrent state over dv into
tiles of width BV, run with a warp count; both are tuned per batch bucket. Tuning runs the in-place
step many times, so it runs on scratch state rows, never on live state, and never inside a CUDA
graph capture: a bucket first met there borrows the tile of the nearest tuned bucket of the same
heads (its binary is already compiled), else a default.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import structlog
import triton

from phalanx.kernels.launch import next_pow2, sm_count
from phalanx.kernels.parallel_compile import precompiling

log = structlog.get_logger(__name__)

# (BV, num_warps): at dk = 128 every config holds 16..128 fp32 state elements per thread; narrow
# tiles make more, smaller programs, wide ones fewer reductions per byte. (32, 1) and (64, 2) won
# batches 16 and 64 with a bf16 state (docs/benchmarks/kernel-choices-h200.md).
TUNING_SPACE = (
    (8, 1),
    (8, 2),
    (16, 1),
    (16, 2),
    (16, 4),
    (32, 1),
    (32, 2),
    (32, 4),
    (32, 8),
    (64, 2),
    (64, 4),
    (64, 8),
    (128, 8),
)
# For a shape first met inside a CUDA-graph capture with no tuned neighbour.
DEFAULT_TILE = (32, 4)
# Batch buckets whose tile is set, not tuned (nor pruned). Timed alone, the tuner sees a tile's
# latency but not its footprint: under PDL the next kernel (out_proj) becomes resident, and
# requests its first weights, only as this one's programs leave the SMs. At batch 1 the tuner's
# picks vary between processes and make whole steps slower than (64, 4), the fastest tile in
# whole steps (measured: docs/benchmarks/kernel-choices-h200.md).
FIXED_TILES: dict[int, Tile] = {1: (64, 4)}
# Under TRITON_INTERPRET=1 (no timing): narrow, so the CPU tests' dv = 32 spans two programs.
INTERPRET_TILE = (16, 4)
# Tuning runs on scratch state rows (never on live state); batches above this reuse its choice,
# which bounds the scratch at MAX_TUNING_ROWS requests' state (128 MiB at the 4B geometry).
MAX_TUNING_ROWS = 64

Tile = tuple[int, int]


def tuning_bucket(batch: int) -> int:
    """The autotuning key's batch: the graph bucket (power of two), capped at MAX_TUNING_ROWS."""
    return min(next_pow2(max(batch, 1)), MAX_TUNING_ROWS)


@functools.cache
def launch_options(tile: Tile) -> dict[str, object]:
    """The launch options exactly as the autotuner passes them, so a tuned tile's binary is reused
    (made once per tile: every eager decode step launches with them). Callers must not modify it."""
    return triton.Config({}, num_warps=tile[1]).all_kwargs()


def _prune_configs(
    configs: list[triton.Config], named_args: dict[str, object], **kwargs: object
) -> list[triton.Config]:
    """Drops tiles wider than dv (all-masked columns) and, at small batches, tiles that give fewer
    programs than the GPU has SMs; keeps at least the narrowest. The autotuner times each tile
    alone, after a flush: there a few wide programs can look as fast as many narrow ones, while in
    a decode step, under the kernel before it, they leave most SMs idle (on the H200, batch 1 once
    tuned to 32 programs of BV = 128)."""

    def arg(name: str) -> int:
        return int(kwargs.get(name, named_args.get(name, 0)))  # type: ignore[call-overload]

    dv, rows = arg("DV"), arg("HV") * arg("tuning_bucket")
    device = named_args["state_ptr"].device  # type: ignore[union-attr]
    sms = sm_count(device) if device.type == "cuda" else 1
    fitting = [
        c for c in configs if c.kwargs["BV"] <= next_pow2(dv) and rows * -(-dv // c.kwargs["BV"]) >= sms
    ]
    return fitting or [min(configs, key=lambda c: c.kwargs["BV"])]


def _short_bench(fn: object, quantiles: tuple[float, ...]) -> list[float]:
    # 10 ms per config (a median of ~60 runs at batch 64, hundreds at batch 1): the sweep tunes up
    # to 11 configs for each of 7 buckets, so the window is the sweep's cost (docs/benchmarks/kernel-choices-h200.md).
    return triton.testing.do_bench(fn, warmup=5, rep=10, quantiles=quantiles)


# Older Triton releases have no do_bench hook; they then bench with their defaults (slower sweep).
_BENCH = {"do_bench": _short_bench} if "do_bench" in inspect.signature(triton.autotune).parameters else {}


def autotuned(kernel: object, key: list[str]) -> object:
    """``kernel`` (a ``@triton.jit`` with a ``BV`` constexpr and a ``DV`` argument) autotuned over
    TUNING_SPACE per ``key``; its candidates compile in parallel in the graph sweep's warm-up."""
    return triton.autotune(
        configs=[triton.Config({"BV": bv}, num_warps=w) for bv, w in TUNING_SPACE],
        key=key,
        prune_configs_by={"early_config_prune": precompiling(kernel, _prune_configs)},
        **_BENCH,
    )(kernel)


class TunedTiles:
    """One kernel's tuned tile per key, (bucket, Hk, Hv, dk, dv, ..., dtype, device). A miss tunes
    on scratch rows (``tune``), never on live state; a hit launches the tile directly, outside the
    autotuner. The tile is a speed choice only: the launch keys its binary on every argument."""

    def __init__(self, kernel: str, fixed: dict[int, Tile] | None = None) -> None:
        self.kernel = kernel
        self.fixed = fixed or {}
        self.tiles: dict[tuple[object, ...], Tile] = {}
        self._untuned_in_capture_logged: set[tuple[object, ...]] = set()

    def tile(self, key: tuple[object, ...], capturing: bool, tune: Callable[[], Tile]) -> Tile:
        """The tile for ``key``: fixed for its bucket, tuned before (or now, by ``tune``, on
        scratch rows), or borrowed inside a capture."""
        tile = self.tiles.get(key)
        if tile is None:
            fixed = self.fixed.get(key[0])  # type: ignore[call-overload]
            if fixed is not None:
                self.tiles[key] = fixed
                log.info(f"{self.kernel} tile fixed", bucket=key[0], heads=key[1:3], tile=fixed)
                return fixed
            tile = self.for_capture(key) if capturing else self.record(key, tune())
        return tile

    def record(self, key: tuple[object, ...], tile: Tile) -> Tile:
        self.tiles[key] = tile
        log.info(f"{self.kernel} tuned", bucket=key[0], heads=key[1:3], tile=tile)
        return tile

    def for_capture(self, key: tuple[object, ...]) -> Tile:
        """A tile for a batch bucket first met inside a graph capture, where benchmarking would
        break the capture: the tile tuned for the nearest bucket of the same heads (its kernel is
        already compiled; the smaller bucket on a tie), else the default one."""
        nearest = sorted(
            (abs(math.log2(k[0]) - math.log2(key[0])), k[0], tile)
            for k, tile in self.tiles.items()
            if k[1:] == key[1:]
        )
        tile = nearest[0][2] if nearest else DEFAULT_TILE
        if key not in self._untuned_in_capture_logged:
            self._untuned_in_capture_logged.add(key)
            log.warning(f"{self.kernel} untuned at graph capture", bucket=key[0], heads=key[1:3], tile=tile)
        return tile
