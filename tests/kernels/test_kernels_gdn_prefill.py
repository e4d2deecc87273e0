"""The model's GDN prefill from its conv output (``kernels/gdn_prefill_triton.py``) on CPU under
``TRITON_INTERPRET=1``: the kernel that prepares fla-core's inputs against torch, and the path
without fla-core against ``gdn_prefill_ref``. fla-core itself runs on the GPU only
(``tests/cuda/test_cuda_gdn_prefill.py``).

As in ``test_kernels_triton.py`` the checks run in one child process (this file run as a script).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.support.interpreter_checks import assert_within, report, run_interpreted


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(torch.bfloat16)


def check_gdn_chunk_inputs() -> dict[str, float]:
    from phalanx.kernels.gdn import gdn_gating_ref, split_conv_output
    from phalanx.kernels.gdn_prefill_triton import gdn_chunk_inputs_triton
    from phalanx.kernels.varlen import GDN_CHUNK, Varlen

    hk, dk, hv, dv, g_scale = 2, 16, 4, 8, 1.4426950216
    lens = [70, 1, 64, 9]  # past one 64-token block, a single token, exactly one block, a short one
    tokens = sum(lens)
    mixed = _rand(tokens, 2 * hk * dk + hv * dv + 5)[:, : 2 * hk * dk + hv * dv]  # column slices
    gates = _rand(tokens, 2 * hv + 1, scale=4.0)
    a, b = gates[:, :hv], gates[:, hv : 2 * hv]
    a_log, dt = torch.rand(hv).log(), _rand(hv)
    varlen = Varlen.build(lens, [0, 5, 64, 0], torch.device("cpu"))
    q, k, v, g, beta = gdn_chunk_inputs_triton(mixed, a, b, a_log, dt, hk, dk, varlen, g_scale)
    q_ref, k_ref, v_ref = (t.float() for t in split_conv_output(mixed, hk, dk, hv))
    g_ref, beta_ref = gdn_gating_ref(a, b, a_log, dt)
    cumulative = [block.cumsum(0) for chunk in g_ref.split(lens) for block in chunk.split(GDN_CHUNK)]

    def normalised(x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()

    return {
        "q_normalised": _rel(q, normalised(q_ref)),
        "k_normalised": _rel(k, normalised(k_ref)),
        "v_differs": float(not torch.equal(v, v_ref)),
        "g": _rel(g, torch.cat(cumulative) * g_scale),
        "beta": _rel(beta, beta_ref),
    }


def check_gdn_prefill_without_fla() -> dict[str, float]:
    from phalanx.kernels.gdn import gdn_prefill_ref
    from phalanx.kernels.gdn_prefill_triton import gdn_prefill_triton
    from phalanx.kernels.varlen import Varlen

    lens, starts = [70, 5], [0, 9]
    mixed = _rand(75, 2 * 2 * 16 + 4 * 16)
    a, b = _rand(75, 4, scale=4.0), _rand(75, 4)
    a_log, dt = torch.rand(4).log(), _rand(4)
    state = torch.randn(6, 4, 16, 16) * 0.1
    state_ref = state.clone()
    varlen = Varlen.build(lens, starts, torch.device("cpu"), [(0, 64, 5)])
    args = (mixed, a, b, a_log, dt, 2)
    bounds = (torch.tensor([1, 3]), varlen.cu_seqlens, varlen.has_initial_state)
    errors = {}
    for name, captures in (("recurrent", None), ("captured", varlen)):
        o = gdn_prefill_triton(*args, state, *bounds, captures)
        o_ref = gdn_prefill_ref(*args, state_ref, *bounds, captures and captures.captures)
        errors[f"o_{name}"] = _rel(o, o_ref)
        errors[f"state_{name}"] = _rel(state, state_ref)
    return errors


def check_state_gather_and_store() -> dict[str, float]:
    """fla-core's initial states gathered from the pool (zeros for fresh chunks) and the final and
    captured states stored back, against torch's index ops; slots past one program's block."""
    from phalanx.kernels.gdn_prefill_triton import gather_initial_states, store_final_states
    from phalanx.kernels.varlen import Varlen

    pool = _rand(7, 4, 32, 40)  # 5,120 elements a slot: two programs each
    slots, keep = torch.tensor([4, 1, 6]), torch.tensor([True, False, True])
    kept = pool[slots].float()
    masked = kept * keep[:, None, None, None]
    gathered, all_kept = gather_initial_states(pool, slots, keep), gather_initial_states(pool, slots, None)
    # fla-core chunks 3 + 1 + 1: the captures after 64 and 128 tokens of chunk 0 start its 2nd and 3rd
    varlen = Varlen.build([130, 64, 5], [0, 16, 0], torch.device("cpu"), [(0, 64, 2), (0, 128, 3)])
    # bf16 values in fp32: the interpreter rounds a cast to bf16 toward zero, the GPU to nearest
    final, chunk_states = _rand(3, 4, 32, 40).float(), _rand(5, 4, 32, 40).float()
    captures = varlen.captures
    stored = pool.clone()
    stored[captures.slots] = chunk_states[captures.gdn_chunks].to(pool.dtype)
    stored[slots] = final.to(pool.dtype)
    store_final_states(pool, slots, final, chunk_states, captures)
    fp32_pool = torch.randn(7, 4, 32, 40)
    fp32_stored = fp32_pool.clone()
    fp32_stored[slots] = final
    store_final_states(fp32_pool, slots, final, chunk_states, None)
    return {
        "gathered_masked": float(not torch.equal(gathered, masked)),
        "gathered_all_kept": float(not torch.equal(all_kept, kept)),
        "stored": float(not torch.equal(pool, stored)),
        "stored_fp32_without_captures": float(not torch.equal(fp32_pool, fp32_stored)),
    }


CHECKS: dict[str, Callable[[], dict[str, float]]] = {
    name.removeprefix("check_"): fn for name, fn in list(globals().items()) if name.startswith("check_")
}
# fp32 outputs computed the same way as the reference: tight; the bf16 recurrence's output: bf16.
TOLERANCE = {
    "q_normalised": 1e-5,
    "k_normalised": 1e-5,
    "v_differs": 0.0,
    "g": 1e-5,
    "beta": 1e-5,
    "state_recurrent": 1e-3,
    "state_captured": 1e-3,
    "gathered_masked": 0.0,
    "gathered_all_kept": 0.0,
    "stored": 0.0,
    "stored_fp32_without_captures": 0.0,
}
DEFAULT_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict[str, object]]:
    return run_interpreted(__file__, timeout=240)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_gdn_prefill_kernel_matches_reference(
    name: str, interpreted_results: dict[str, dict[str, object]]
) -> None:
    assert_within(interpreted_results, name, TOLERANCE, DEFAULT_TOLERANCE)


if __name__ == "__main__":
    report(CHECKS)
