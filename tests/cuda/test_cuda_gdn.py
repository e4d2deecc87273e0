"""The GDN decode step on the GPU at the 4B geometry (TP 1): the fused kernel, the split path and
the dispatch against ``gdn_decode_step_ref``, eager and inside CUDA graphs.

bf16 output: relative error ≤ 1e-2; fp32 recurrent state ≤ 1e-3; conv state bit-exact; state
slots outside the batch untouched. The reference runs on the same GPU tensors (plain torch)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.support.gpu_checks import rand, rel  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
OUT_TOL = 1e-2
STATE_TOL = 1e-3
CONV_K = 4
GEOMETRY_4B = (16, 32, 128, 128)  # Hk, Hv, dk, dv at TP 1
GEOMETRY_4B_TP8 = (2, 4, 128, 128)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def step_inputs(
    batch: int, geometry: tuple[int, int, int, int] = GEOMETRY_4B, state_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Operands as the layer passes them: qkv, z, a and b are column slices of one projection."""
    hk, hv, dk, dv = geometry
    conv_dim = 2 * hk * dk + hv * dv
    slots = 2 * batch + 3
    proj = rand(batch, conv_dim + hv * dv + 2 * hv)
    return {
        "mixed_qkv": proj[:, :conv_dim],
        "conv_weight": rand(conv_dim, CONV_K, scale=0.3),
        "conv_state": rand(slots, conv_dim, CONV_K - 1),
        "z": proj[:, conv_dim : conv_dim + hv * dv].view(batch, hv, dv),
        "a": proj[:, conv_dim + hv * dv : conv_dim + hv * dv + hv],
        "b": proj[:, conv_dim + hv * dv + hv :],
        "A_log": torch.rand(hv, device=DEV).log(),
        "dt_bias": rand(hv),
        "norm_weight": torch.rand(dv, device=DEV) + 0.5,
        "state": (torch.randn(slots, hv, dk, dv, device=DEV) * 0.1).to(state_dtype),
        "state_slots": torch.randperm(slots, device=DEV)[:batch],
    }


_NAMES = ("mixed_qkv", "conv_weight", "conv_state", "z", "a", "b", "A_log", "dt_bias", "norm_weight")


def call(step: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return step(*(inputs[n] for n in _NAMES), 1e-6, inputs["state"], inputs["state_slots"])


def state_tol(state_dtype: torch.dtype) -> float:
    """A bf16 state is stored rounded after each step: it agrees with the reference within that."""
    return STATE_TOL if state_dtype == torch.float32 else 1e-2


def with_state_copies(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**inputs, "conv_state": inputs["conv_state"].clone(), "state": inputs["state"].clone()}


def assert_matches(
    y: torch.Tensor,
    got: dict[str, torch.Tensor],
    y_ref: torch.Tensor,
    ref: dict[str, torch.Tensor],
    state_tol: float = STATE_TOL,
) -> None:
    assert rel(y, y_ref) <= OUT_TOL, f"output relative error {rel(y, y_ref):.3g}"
    assert torch.equal(got["conv_state"], ref["conv_state"]), "conv state differs"
    assert rel(got["state"], ref["state"]) <= state_tol, (
        f"state relative error {rel(got['state'], ref['state']):.3g}"
    )
    spare = torch.ones(got["state"].shape[0], dtype=torch.bool, device=DEV)
    spare[got["state_slots"]] = False
    assert torch.equal(got["state"][spare], ref["state"][spare]), "a slot outside the batch changed"


def _step(path: str) -> Callable[..., torch.Tensor]:
    from phalanx.kernels import gdn_step_triton

    return {
        "dispatch": gdn_step_triton.gdn_decode_step_triton,
        "fused": gdn_step_triton.gdn_decode_step_fused,
        "split": gdn_step_triton.gdn_decode_step_split,
    }[path]


@pytest.mark.parametrize("path", ["dispatch", "fused", "split"])
@pytest.mark.parametrize("batch", [1, 16, 64, 256])
def test_decode_step_matches_reference(path: str, batch: int) -> None:
    from phalanx.kernels.gdn_step import gdn_decode_step_ref

    inputs = step_inputs(batch)
    ref = with_state_copies(inputs)
    y = call(_step(path), inputs)
    y_ref = call(gdn_decode_step_ref, ref)
    assert_matches(y, inputs, y_ref, ref)


@pytest.mark.parametrize("path", ["fused", "split"])
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("state_dtype", [torch.float32, BF16], ids=["fp32-state", "bf16-state"])
def test_two_steps_in_a_row_match_reference(path: str, batch: int, state_dtype: torch.dtype) -> None:
    """The second step reads the conv and recurrent state the first one wrote. A bf16 state is
    stepped in fp32 and stored rounded, as the reference does: the two agree within bf16 rounding."""
    from phalanx.kernels.gdn_step import gdn_decode_step_ref

    inputs = step_inputs(batch, state_dtype=state_dtype)
    ref = with_state_copies(inputs)
    for _ in range(2):
        y = call(_step(path), inputs)
        y_ref = call(gdn_decode_step_ref, ref)
    assert_matches(y, inputs, y_ref, ref, state_tol(state_dtype))


@pytest.mark.parametrize("path", ["fused", "split"])
@pytest.mark.parametrize(
    ("geometry", "eager_batch", "graph_batch"),
    [(GEOMETRY_4B, 64, 64), (GEOMETRY_4B_TP8, 16, 32)],
    ids=["bucket-tuned-before-capture", "bucket-first-met-in-capture"],
)
def test_step_in_cuda_graph(
    path: str, geometry: tuple[int, int, int, int], eager_batch: int, graph_batch: int
) -> None:
    """Captured after an eager warm-up (the graph sweep's order); a bucket never run eagerly
    borrows the nearest tuned bucket's tile inside the capture (no benchmarking there). Two
    replays match two reference steps and, where the bucket was tuned before capture (so eager and
    graph run the same tile), equal the eager launches bit for bit."""
    from phalanx.kernels.gdn_step import gdn_decode_step_ref

    step = _step(path)
    call(step, step_inputs(eager_batch, geometry))
    inputs = step_inputs(graph_batch, geometry)
    start = with_state_copies(inputs)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        y = call(step, inputs)
    inputs["conv_state"].copy_(start["conv_state"])
    inputs["state"].copy_(start["state"])
    eager = with_state_copies(start)
    for _ in range(2):
        graph.replay()
        y_eager = call(step, eager)
        y_ref = call(gdn_decode_step_ref, start)
    torch.cuda.synchronize()
    assert_matches(y, inputs, y_ref, start)
    if eager_batch == graph_batch:
        assert torch.equal(y, y_eager) and torch.equal(inputs["state"], eager["state"]), (
            "replay differs from eager"
        )


@pytest.mark.parametrize("tile", [(128, 8), (128, 4)])
def test_split_step_with_whole_head_tile(tile: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A tile as wide as dv (each program norms its own value head, no workspace, no counter),
    set as the batch-1 pick: matches the reference, and two steps in a row too."""
    from phalanx.kernels import gdn_step_triton
    from phalanx.kernels.gdn_step import gdn_decode_step_ref

    inputs = step_inputs(1)
    hk, hv, dk, dv = GEOMETRY_4B
    key = (1, hk, hv, dk, dv, False, inputs["mixed_qkv"].dtype, inputs["state"].device)
    monkeypatch.setitem(gdn_step_triton.TUNED.tiles, key, tile)
    ref = with_state_copies(inputs)
    for _ in range(2):
        y = call(gdn_step_triton.gdn_decode_step_split, inputs)
        y_ref = call(gdn_decode_step_ref, ref)
    assert_matches(y, inputs, y_ref, ref)


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16], ids=["fp32-state", "bf16-state"])
def test_batch_1_split_step_takes_the_fixed_tile(state_dtype: torch.dtype) -> None:
    """Batch 1's tile is set, not tuned (``kernels/gdn_tiles.FIXED_TILES``), for either state
    dtype, and matches the reference."""
    from phalanx.kernels import gdn_step_triton
    from phalanx.kernels.gdn_step import gdn_decode_step_ref
    from phalanx.kernels.gdn_tiles import FIXED_TILES

    inputs = step_inputs(1, state_dtype=state_dtype)
    hk, hv, dk, dv = GEOMETRY_4B
    key = (1, hk, hv, dk, dv, False, inputs["mixed_qkv"].dtype, state_dtype, inputs["state"].device)
    ref = with_state_copies(inputs)
    y = call(gdn_step_triton.gdn_decode_step_split, inputs)
    assert gdn_step_triton.TUNED.tiles[key] == FIXED_TILES[1]
    assert_matches(y, inputs, call(gdn_decode_step_ref, ref), ref, state_tol(state_dtype))
