"""``phalanx bench gdn``: the Gated DeltaNet decode step of one layer, fused kernel vs split path.

Per batch size and path (``fused``: the single-kernel step; ``split``: the conv kernel, then the
step kernel without its conv; ``dispatch``: what ``gdn_decode_step_triton`` takes; ``copy``: a plain
``copy_`` of the same recurrent state bytes, the attainable figure) the step is timed inside
a CUDA graph of ``--calls`` back-to-back calls, so Python launch cost is excluded. The calls cycle
over enough distinct state tensors (each one layer's worth: [batch, Hv, dk, dv] in the
``--mamba-ssm-cache-dtype``, plus the conv state) that the state streams from HBM rather than L2,
as it does across a model's layers. The traffic figure is 2 x the recurrent state bytes (read
once, written once) over the time per call, against the H200's measured 4.3 TB/s copy bandwidth. Every path runs eagerly before capture, so
compilation and autotuning stay outside the timed graphs.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from phalanx.tools.bench.args import at_least
from phalanx.tools.bench.measure import cuda_time_ms
from phalanx.tools.launch_options import add_state_dtype_argument, chosen_state_dtype

COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (read + write)
L2_FLUSH_BYTES = 256e6  # several times the H200's 60 MB L2
CONV_K = 4
PATHS = ("fused", "split", "dispatch", "copy")


@dataclass(frozen=True)
class Timing:
    batch: int
    path: str
    us_per_call: float
    state_bytes: int
    tile: str

    @property
    def traffic_tb_s(self) -> float:
        return 2 * self.state_bytes / (self.us_per_call * 1e-6) / 1e12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", default="1,8,16,32,64,128,256", help="comma-separated batch sizes")
    parser.add_argument("--paths", default="fused,split,copy", help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--key-heads", type=at_least(1), default=16, help="Hk (4B at TP 1: 16)")
    parser.add_argument("--value-heads", type=at_least(1), default=32, help="Hv (4B at TP 1: 32)")
    parser.add_argument("--head-dim", type=at_least(1), default=128, help="dk = dv")
    parser.add_argument(
        "--calls", type=at_least(1), default=20, help="back-to-back calls per graph (at least)"
    )
    parser.add_argument("--replays", type=at_least(1), default=10, help="timed graph replays per figure")
    parser.add_argument(
        "--layers", type=at_least(1), default=24, help="GDN layers per step, for the per-step column"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    add_state_dtype_argument(parser)


def _step_fn(path: str) -> Callable[..., torch.Tensor]:
    from phalanx.kernels import gdn_step_triton

    return {
        "fused": gdn_step_triton.gdn_decode_step_fused,
        "split": gdn_step_triton.gdn_decode_step_split,
        "dispatch": gdn_step_triton.gdn_decode_step_triton,
    }[path]


def _layer_inputs(batch: int, args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """One layer's step operands; qkv, z, a and b are column slices of one projection, as in the model."""
    hk, hv, d = args.key_heads, args.value_heads, args.head_dim
    conv_dim = 2 * hk * d + hv * d
    bf16 = torch.bfloat16
    proj = torch.randn(batch, conv_dim + hv * d + 2 * hv, device=device).to(bf16)
    return {
        "mixed_qkv": proj[:, :conv_dim],
        "conv_weight": (torch.randn(conv_dim, CONV_K, device=device) * 0.3).to(bf16),
        "z": proj[:, conv_dim : conv_dim + hv * d].view(batch, hv, d),
        "a": proj[:, conv_dim + hv * d : conv_dim + hv * d + hv],
        "b": proj[:, conv_dim + hv * d + hv :],
        "A_log": torch.rand(hv, device=device).log(),
        "dt_bias": torch.randn(hv, device=device).to(bf16),
        "norm_weight": torch.rand(d, device=device) + 0.5,
        "state_slots": torch.randperm(batch, device=device),
    }


def _state_sets(
    batch: int, args: argparse.Namespace, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    hk, hv, d = args.key_heads, args.value_heads, args.head_dim
    state_dtype = getattr(torch, chosen_state_dtype(args, "bfloat16"))
    state_bytes = batch * hv * d * d * state_dtype.itemsize
    count = max(1, math.ceil(L2_FLUSH_BYTES / state_bytes))
    conv_dim = 2 * hk * d + hv * d
    return [
        (
            torch.randn(batch, conv_dim, CONV_K - 1, device=device).to(torch.bfloat16),
            (torch.randn(batch, hv, d, d, device=device) * 0.1).to(state_dtype),
        )
        for _ in range(count)
    ]


def time_path(batch: int, path: str, args: argparse.Namespace, device: torch.device) -> Timing:
    x = _layer_inputs(batch, args, device)
    sets = _state_sets(batch, args, device)
    calls = max(args.calls, len(sets))
    if path == "copy":
        # The reference row: the recurrent state's bytes read once and written once, nothing else.
        destination = torch.empty_like(sets[0][1])

        def one(i: int) -> torch.Tensor:
            return destination.copy_(sets[i % len(sets)][1])

    else:
        step = _step_fn(path)

        def one(i: int) -> torch.Tensor:
            conv_state, state = sets[i % len(sets)]
            return step(
                x["mixed_qkv"],
                x["conv_weight"],
                conv_state,
                x["z"],
                x["a"],
                x["b"],
                x["A_log"],
                x["dt_bias"],
                x["norm_weight"],
                1e-6,
                state,
                x["state_slots"],
            )

    for i in range(len(sets)):  # compile, autotune (split) and touch every set outside the graph
        one(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            one(i)
    graph.replay()
    torch.cuda.synchronize()
    times = [ms * 1e3 / calls for ms in cuda_time_ms(graph.replay, args.replays)]
    del graph
    return Timing(
        batch,
        path,
        statistics.median(times),
        sets[0][1].numel() * sets[0][1].element_size(),
        _tile(batch, path, args),
    )


def _tile(batch: int, path: str, args: argparse.Namespace) -> str:
    from phalanx.kernels import gdn_step_triton
    from phalanx.kernels.gdn_tiles import tuning_bucket

    if path == "copy":
        return "torch copy_ of the state"
    conv = path == "fused" or (path == "dispatch" and gdn_step_triton.GDN_PATH == "fused")
    heads = (args.key_heads, args.value_heads, args.head_dim, args.head_dim, conv)
    tiles = {
        tile
        for key, tile in gdn_step_triton.TUNED.tiles.items()
        if key[0] == tuning_bucket(batch) and key[1:6] == heads
    }
    return ", ".join(f"BV={bv} warps={w}" for bv, w in sorted(tiles)) or "untuned"


def _row(t: Timing, layers: int) -> str:
    return (
        f"| {t.batch} | {t.path} | {t.us_per_call:.1f} | {t.traffic_tb_s:.2f} "
        f"| {t.traffic_tb_s * 1e12 / COPY_BANDWIDTH:.0%} | {t.us_per_call * layers / 1e3:.2f} | {t.tile} |"
    )


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("phalanx bench gdn: needs a CUDA GPU (none is visible)")
        return 2
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        print(f"phalanx bench gdn: unknown path(s) {', '.join(unknown)}; choose from {', '.join(PATHS)}")
        return 2
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    rows = []
    for batch in (int(b) for b in args.batch.split(",") if b):
        for path in paths:
            rows.append(time_path(batch, path, args, device))
            print(f"measured: {_row(rows[-1], args.layers)}", flush=True)
            torch.cuda.empty_cache()
    print(
        f"GDN decode step, one layer: Hk {args.key_heads}, Hv {args.value_heads}, dk = dv {args.head_dim}, "
        f"bf16 activations, {chosen_state_dtype(args, 'bfloat16')} state, CUDA graph of >= {args.calls} calls ({torch.cuda.get_device_name()})"
    )
    print(f"| batch | path | us / layer | state TB/s | of 4.3 TB/s | ms / {args.layers} layers | tile |")
    print("|---|---|---|---|---|---|---|")
    for t in rows:
        print(_row(t, args.layers))
    return 0
