"""Tensor-parallel collectives and the vocab-parallel embedding and head.

With world_size 1 nothing here touches torch.distributed. Otherwise the caller has initialised the
default process group (gloo on CPU, NCCL on CUDA). Collectives write into fixed-shape buffers so
that decode stays CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels import ops
from kernels.bound import BoundLinear
from models.qwen35.one_shot import OneShotAllReduce, try_one_shot


class TensorParallel:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.one_shot: OneShotAllReduce | None = None
        # Set while a rank measures its activations before the process group exists: collectives
        # are skipped (their outputs keep their shapes), so the numbers are garbage but the memory real.
        self.local_only = False

    def enable_one_shot(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Route small all-reduces through symmetric memory where the GPUs allow it (after the
        process group exists, before any CUDA graph is captured)."""
        self.one_shot = try_one_shot(dtype, device, self.rank, self.world_size)
        return self.one_shot is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over ranks: the returned tensor (x itself on the NCCL/gloo path)."""
        if self.world_size == 1 or self.local_only:
            return x
        if self.one_shot is not None and self.one_shot.fits(tuple(x.shape), x.dtype):
            return self.one_shot(x)
        dist.all_reduce(x)
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> None:
        """Overwrite x on every rank with rank 0's x."""
        if self.world_size > 1 and not self.local_only:
            dist.broadcast(x, src=0)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, V/t] on each rank -> [N, V], rank r's part at columns [r V/t, (r+1) V/t)."""
        if self.world_size == 1:
            return x
        gathered = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        if self.local_only:
            return gathered.permute(1, 0, 2).reshape(x.shape[0], -1)
        dist.all_gather(list(gathered.unbind(0)), x.contiguous())
        return gathered.permute(1, 0, 2).reshape(x.shape[0], -1)


class RowParallelLinear:
    """all_reduce(x @ w.T) for a weight split along K (bound to it: ``kernels/bound.py``). On the
    one-shot path the linear writes its partial straight into the symmetric buffer, with no
    staging copy."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel) -> None:
        self.weight = weight
        self.tp = tp
        self.linear = BoundLinear(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        shape = (x.shape[0], self.weight.shape[0])
        if tp.world_size == 1 or tp.local_only or tp.one_shot is None or not tp.one_shot.fits(shape, x.dtype):
            return tp.all_reduce(self.linear(x))
        return tp.one_shot.reduce(ops.linear(x, self.weight, out=tp.one_shot.stage(shape)))


class VocabParallelEmbedding:
    """Each rank holds vocab rows [vocab_start, vocab_start + V/t); lookups are summed over ranks."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, tp: TensorParallel) -> None:
        self.weight = weight
        self.vocab_start = vocab_start
        self.tp = tp

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = ops.embedding(tokens, self.weight, self.vocab_start)
        return embedded if self.tp.world_size == 1 else self.tp.all_reduce(embedded)


class VocabParallelHead:
    """Logits for this rank's vocab slice, gathered into the full vocabulary (float32) on every rank."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel) -> None:
        self.weight = weight
        self.tp = tp
        self.linear = BoundLinear(weight, fp32_out=True)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear(hidden)
        return self.tp.all_gather_last_dim(local)
