"""The attention layer's per-token preamble as one op (torch reference).

``norm_rope_write_kv`` = the (1 + w) RMSNorm of every q and k head, partial RoPE on both, and the
paged write of the rotated k and of v: the chain of ``kernels/norms.py``, ``kernels/rope.py`` and
``kernels/kv_cache.py`` ops between the QKV projection and the attention. On CUDA
``rope_kv_triton.py`` runs it as one kernel (seven launches and two copies fewer per layer).

Shapes: q [T, H, D], k / v [T, Hkv, D] (any strides with a contiguous last dim), q_norm / k_norm
[D], positions [T] int64, cos_sin [max_pos, rotary_dim] fp32, caches [pages, page_size, Hkv, D],
slot_ids [T] int64. Returns the normalised, rotated q [T, H, D]; the caches are written in place.
"""

from __future__ import annotations

import torch

from phalanx.kernels.kv_cache import write_kv_ref
from phalanx.kernels.norms import rms_norm_ref
from phalanx.kernels.rope import apply_rope_ref


def norm_rope_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    tokens, heads, dim = q.shape
    q = rms_norm_ref(q.reshape(-1, dim), q_norm, eps)[0].view(tokens, heads, dim)
    k = rms_norm_ref(k.reshape(-1, dim), k_norm, eps)[0].view(tokens, -1, dim)
    write_kv_ref(apply_rope_ref(k, positions, cos_sin), v, k_cache, v_cache, slot_ids)
    return apply_rope_ref(q, positions, cos_sin)
