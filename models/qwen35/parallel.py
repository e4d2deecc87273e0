"""Tensor-parallel collectives and the vocab-parallel embedding and head.

With world_size 1 nothing here touches torch.distributed. Otherwise the caller has initialised the
default process group (gloo on CPU, NCCL on CUDA). Collectives write into fixed-shape buffers so
that decode stays CUDA-graph capturable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from phalanx.kernels import ops
from phalanx.kernels.bound import BoundLinear
from phalanx.models.qwen35.one_shot import OneShotAllReduce, try_one_shot


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

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of x over ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def all_gather_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """x on each rank -> [world_size, *x.shape], rank r's x at index r."""
        if self.world_size == 1:
            return x[None]
        gathered = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(gathered.unbind(0)), x.contiguous())
        return gathered

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


# Prompt rows scored at once: with a 248k vocabulary their fp32 logits and exponentials take
# ~1 GiB, where a long step's prompt scored whole would take 16 GiB the rank never sized for.
SCORE_ROWS = 512


class TokenScores(NamedTuple):
    """Log-probabilities of given tokens [T], their ranks [T] (1 + how many ids score higher) and
    the top N of each row ([T, N] values and ids, ties by ascending id; None when N is 0)."""

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None


class VocabParallelHead:
    """Logits for this rank's vocab slice, gathered into the full vocabulary (float32) on every rank."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel) -> None:
        self.weight = weight
        self.tp = tp
        self.linear = BoundLinear(weight, fp32_out=True)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear(hidden)
        return self.tp.all_gather_last_dim(local)

    def score(self, hidden: torch.Tensor, targets: torch.Tensor, top_n: int) -> TokenScores:
        """Each row's log-probability of its target token, its rank and its top ``top_n``, computed
        on the vocab shards: only the log-normaliser's parts, the targets' logits and ranks and each
        shard's top N cross between ranks, never a full row of the vocabulary. ``SCORE_ROWS`` rows
        at a time, so a long prompt's scoring stays within the memory a step was sized for."""
        if len(hidden) <= SCORE_ROWS:
            return self._score_rows(hidden, targets, top_n)
        parts = [
            self._score_rows(hidden[at : at + SCORE_ROWS], targets[at : at + SCORE_ROWS], top_n)
            for at in range(0, len(hidden), SCORE_ROWS)
        ]
        return TokenScores(
            *(None if field[0] is None else torch.cat(field) for field in zip(*parts, strict=True))
        )

    def _score_rows(self, hidden: torch.Tensor, targets: torch.Tensor, top_n: int) -> TokenScores:
        local = self.linear(hidden).float()
        shard = local.shape[1]
        first = self.tp.rank * shard
        peak = self.tp.all_reduce_max(local.max(dim=-1).values)
        total = self.tp.all_reduce(torch.exp(local - peak[:, None]).sum(dim=-1))
        normaliser = peak + torch.log(total)
        mine = (targets >= first) & (targets < first + shard)
        picked = local.gather(1, (targets - first).clamp(0, shard - 1)[:, None]).squeeze(1)
        logit = self.tp.all_reduce(torch.where(mine, picked, torch.zeros_like(picked)))
        ranks = self.tp.all_reduce((local > logit[:, None]).sum(dim=-1)) + 1
        chosen = logit - normaliser
        if top_n == 0:
            return TokenScores(chosen, ranks, None, None)
        values, ids = local.topk(min(top_n, shard), dim=-1)
        values = self.tp.all_gather_stacked(values).permute(1, 0, 2).reshape(len(targets), -1)
        ids = self.tp.all_gather_stacked(ids + first).permute(1, 0, 2).reshape(len(targets), -1)
        # sorted by id first, so the stable sort by value keeps equal values in ascending id order
        by_id = torch.argsort(ids, dim=-1, stable=True)
        values, ids = values.gather(1, by_id), ids.gather(1, by_id)
        order = torch.argsort(values, dim=-1, descending=True, stable=True)[:, :top_n]
        return TokenScores(chosen, ranks, values.gather(1, order) - normaliser[:, None], ids.gather(1, order))
