"""The model's GDN prefill on the GPU at the 4B geometry (TP 1): the kernel that prepares
fla-core's inputs, then fla-core's chunked forward from host chunk bounds, against
``gdn_prefill_ref``. bf16 output: relative error <= 1e-2; fp32 states <= 1e-3."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.support.gpu_checks import rand, rel  # noqa: E402

DEV = torch.device("cuda")
OUT_TOL = 1e-2
STATE_TOL = 1e-3
HK, HV, DK, DV = 16, 32, 128, 128
CONV_DIM = 2 * HK * DK + HV * DV


@pytest.mark.parametrize(
    ("lens", "starts", "captures"),
    [
        ([300, 1, 64, 100], [0, 7, 64, 0], [(0, 64, 1), (0, 256, 3), (3, 64, 4)]),
        ([128], [4096], [(0, 64, 1)]),  # a prefix hit: every chunk continues its slot's state
    ],
    ids=["mixed", "all-continue"],
)
def test_gdn_prefill_fused_inputs_and_fla_core(
    lens: list[int], starts: list[int], captures: list[tuple[int, int, int]]
) -> None:
    """The model's GDN prefill (fused inputs kernel, fla-core's forward from host chunk bounds,
    captures on the way) against the reference chain, chunks continuing and starting fresh."""
    from phalanx.kernels.gdn import gdn_prefill_ref
    from phalanx.kernels.gdn_prefill_triton import fla_core_available, gdn_prefill_triton
    from phalanx.kernels.varlen import Varlen

    if not fla_core_available():
        pytest.skip("fla-core is not installed")
    from fla.ops.utils import cache
    from triton.runtime.autotuner import Autotuner

    # its config cache off (the default), fla-core's launches skip that cache's per-launch key
    assert cache.FLA_CACHE_MODE.value != "disabled" or cache.CachedAutotuner.run is Autotuner.run
    torch.manual_seed(0)
    tokens = sum(lens)
    mixed = rand(tokens, CONV_DIM + 2 * HV + HV * DV)[:, :CONV_DIM]  # a slice, as the layer's is
    gates = rand(tokens, 2 * HV)
    a, b = gates[:, :HV], gates[:, HV:]
    a_log, dt = torch.rand(HV, device=DEV).log(), rand(HV)
    start_state = torch.randn(8, HV, DK, DV, device=DEV) * 0.1
    state_ref = start_state.clone()
    slots = torch.tensor([5, 0, 7, 2][: len(lens)], device=DEV)
    varlen = Varlen.build(lens, starts, DEV, captures)
    args = (mixed, a, b, a_log, dt, HK)
    bounds = (slots, varlen.cu_seqlens, varlen.has_initial_state)
    o_ref = gdn_prefill_ref(*args, state_ref, *bounds, varlen.captures)
    # twice: fla-core's kernels go through their autotuners first, then launch the kept configs
    for run in ("first", "again"):
        state = start_state.clone()
        o = gdn_prefill_triton(*args, state, *bounds, varlen)
        assert rel(o, o_ref) <= OUT_TOL, run
        assert rel(state, state_ref) <= STATE_TOL, run
        for _, _, slot in captures:  # the captured states, one by one
            assert rel(state[slot], state_ref[slot]) <= STATE_TOL, run
