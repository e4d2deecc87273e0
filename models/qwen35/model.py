"""Qwen3.5 text model on one tensor-parallel rank: loading, caches, prefill and batched decode."""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from phalanx.config.replica import recurrent_state_dtype_for
from phalanx.kernels import ops
from phalanx.models.qwen35.batch import DecodeBatch, PrefillBatch
from phalanx.models.qwen35.config import Qwen35Config
from phalanx.models.qwen35.layers import DecoderLayer, StepContext
from phalanx.models.qwen35.parallel import (
    TensorParallel,
    TokenScores,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from phalanx.models.qwen35.sharding import RankLayout, tensor_specs
from phalanx.models.qwen35.weights import Checkpoint, check_tensors, read_slices

log = structlog.get_logger(__name__)


def recurrent_state_dtype(setting: str, dtype: torch.dtype) -> torch.dtype:
    """The linear layers' state dtype for a model of ``dtype`` (``recurrent_state_dtype_for``)."""
    return getattr(torch, recurrent_state_dtype_for(setting, str(dtype).removeprefix("torch.")))


class Qwen35Model:
    """One rank's shard of the model plus its caches; the interface the worker calls."""

    def __init__(
        self,
        config: Qwen35Config,
        layout: RankLayout,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.layout = layout
        self.rank = layout.rank
        self.world_size = layout.world_size
        self.device = device
        self.dtype = dtype
        self.state_dtype = state_dtype  # the linear layers' recurrent state (computed in fp32 either way)
        self.tp = TensorParallel(layout.rank, layout.world_size)
        self.embed = VocabParallelEmbedding(weights["embed_tokens.weight"], layout.vocab_start, self.tp)
        head_weight = (
            weights["embed_tokens.weight"] if config.tie_word_embeddings else weights["lm_head.weight"]
        )
        self.head = VocabParallelHead(head_weight, self.tp)
        self.layers = [
            DecoderLayer(i, weights, config, layout, self.tp) for i in range(config.num_hidden_layers)
        ]
        self.final_norm = weights["norm.weight"]
        self.cos_sin = ops.rope_cache(
            config.max_position_embeddings, config.rotary_dim, config.rope_theta, device
        )
        self.page_size = 0
        self.num_state_slots = 0
        # Every linear layer's states in one tensor each, [layer, slot, ...]: a slot's states over all
        # layers move in one copy (a prefix hit's restore is on its time to first token)
        self._recurrent_states: torch.Tensor | None = None
        self._conv_states: torch.Tensor | None = None
        self.weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
        progress: bool = False,
    ) -> Qwen35Model:
        """Read this rank's slices of the checkpoint in ``model_dir`` and build the model."""
        started = time.perf_counter()
        device = torch.device(device)
        config = Qwen35Config.from_dir(model_dir)
        layout = RankLayout.build(config, rank, world_size)
        specs = tensor_specs(config, layout, include_lm_head=not config.tie_word_embeddings)
        checkpoint = Checkpoint(model_dir)
        # Tied checkpoints normally omit lm_head.weight; tolerate a redundant copy.
        tolerated = ("lm_head.weight",) if config.tie_word_embeddings else ()
        check_tensors(checkpoint, specs, allow_extra=tolerated, rank=rank)
        weights = read_slices(checkpoint, specs, dtype=dtype, device=device, rank=rank, progress=progress)
        model = cls(config, layout, weights, device, dtype, state_dtype)
        log.info(
            "model loaded",
            model_dir=str(model_dir),
            rank=rank,
            world_size=world_size,
            dtype=str(dtype),
            seconds=round(time.perf_counter() - started, 3),
        )
        return model

    # ----- caches -------------------------------------------------------------------------------

    @property
    def _attention_layers(self) -> list:
        return [layer.attention for layer in self.layers if layer.attention is not None]

    @property
    def _linear_layers(self) -> list:
        return [layer.linear_attention for layer in self.layers if layer.linear_attention is not None]

    def kv_bytes_per_page(self, page_size: int) -> int:
        """K and V of one page over every full-attention layer, local KV heads."""
        per_layer = 2 * page_size * self.layout.num_kv_heads * self.config.head_dim
        return len(self._attention_layers) * per_layer * self.dtype.itemsize

    def state_bytes_per_slot(self) -> int:
        """Recurrent (``state_dtype``) plus conv (model dtype) state of one slot over every linear layer."""
        total = 0
        for gdn in self._linear_layers:
            total += gdn.value_heads * gdn.key_dim * gdn.value_dim * self.state_dtype.itemsize
            total += gdn.conv_dim * (gdn.kernel - 1) * self.dtype.itemsize
        return total

    def allocate_cache(self, num_pages_total: int, page_size: int, num_state_slots: int) -> None:
        if num_pages_total < 1 or page_size < 1 or num_state_slots < 1:
            raise ValueError(
                f"rank {self.rank}: allocate_cache needs positive sizes, got pages={num_pages_total}, "
                f"page_size={page_size}, state slots={num_state_slots}"
            )
        for attention in self._attention_layers:
            attention.allocate(num_pages_total, page_size, self.cos_sin)
        linear = self._linear_layers
        if linear:
            recurrent_shape, conv_shape = linear[0].state_shapes(num_state_slots)
            self._recurrent_states = torch.zeros(
                (len(linear), *recurrent_shape), dtype=self.state_dtype, device=self.device
            )
            self._conv_states = torch.zeros((len(linear), *conv_shape), dtype=self.dtype, device=self.device)
            for index, gdn in enumerate(linear):
                gdn.allocate(self._recurrent_states[index], self._conv_states[index])
        self.page_size = page_size
        self.num_state_slots = num_state_slots

    def release_cache(self) -> None:
        """Drop the KV pages and state slots (allocate_cache makes new ones)."""
        for attention in self._attention_layers:
            attention.release()
        for gdn in self._linear_layers:
            gdn.release()
        self._recurrent_states = self._conv_states = None
        self.page_size = 0
        self.num_state_slots = 0

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy recurrent and conv state of every linear layer from one slot to another."""
        self._require_cache("copy_state")
        for slot in (src_slot, dst_slot):
            if not 0 <= slot < self.num_state_slots:
                raise IndexError(f"rank {self.rank}: state slot {slot} outside [0, {self.num_state_slots})")
        if self._recurrent_states is not None and self._conv_states is not None:
            self._recurrent_states[:, dst_slot] = self._recurrent_states[:, src_slot]
            self._conv_states[:, dst_slot] = self._conv_states[:, src_slot]

    def _require_cache(self, phase: str) -> None:
        if self.page_size == 0:
            raise RuntimeError(f"rank {self.rank}: {phase} before allocate_cache")

    # ----- forward ------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits float32 [num_chunks, vocab] at each chunk's last token ([T, vocab] if all_logits)."""
        hidden, residual, cu_seqlens = self._prefill_layers(batch)
        if not all_logits:
            last = cu_seqlens[1:].long() - 1
            hidden, residual = hidden[last], residual[last]
        return self._logits(hidden, residual)

    @torch.inference_mode()
    def prefill_scored(
        self, batch: PrefillBatch, rows: torch.Tensor, targets: torch.Tensor, top_n: int
    ) -> tuple[torch.Tensor, TokenScores]:
        """``prefill``'s logits, and the log-probability of ``targets[i]`` after the batch token
        at ``rows[i]`` with the top ``top_n``, on the vocab shards (``VocabParallelHead.score``)."""
        hidden, residual, cu_seqlens = self._prefill_layers(batch)
        last = cu_seqlens[1:].long() - 1
        logits = self._logits(hidden[last], residual[last])
        rows = rows.to(self.device)
        normed, _ = ops.rms_norm(hidden[rows], self.final_norm, self.config.rms_norm_eps, residual[rows])
        return logits, self.head.score(normed, targets.to(self.device), top_n)

    def _prefill_layers(self, batch: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last layer's output, the residual before it (every token) and the chunk bounds."""
        self._require_cache("prefill")
        varlen = batch.varlen
        page_tables = batch.page_tables.to(self.device)
        self.check_prefill_extent(varlen.ends, page_tables.shape[1])
        self.check_token_ids(batch.token_range)
        positions = varlen.positions
        pages = page_tables[varlen.chunk_of_token.long(), positions // self.page_size].long()
        ctx = StepContext(
            positions=positions,
            kv_slot_ids=pages * self.page_size + positions % self.page_size,
            state_slots=batch.state_slots.to(self.device),
            cu_seqlens=varlen.cu_seqlens,
            starts=varlen.starts,
            page_tables=page_tables,
            has_initial_state=varlen.has_initial_state,
            varlen=varlen,
        )
        hidden, residual = self._layers(batch.tokens.to(self.device), ctx)
        return hidden, residual, varlen.cu_seqlens

    def check_token_ids(self, token_range: tuple[int, int]) -> None:
        low, high = token_range
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"rank {self.rank}: prefill token id {bad} is outside the vocabulary [0, {self.config.vocab_size})"
            )

    def check_prefill_extent(self, ends: tuple[int, ...], table_width: int) -> None:
        """Each chunk's page table must cover its positions, and they must have RoPE entries."""
        for chunk, end in enumerate(ends):
            if end > table_width * self.page_size:
                raise ValueError(
                    f"rank {self.rank}: prefill chunk {chunk} reaches position {end - 1} but its page "
                    f"table has {table_width} pages of {self.page_size}"
                )
            if end > self.config.max_position_embeddings:
                raise ValueError(
                    f"rank {self.rank}: prefill chunk {chunk} reaches position {end - 1}, beyond "
                    f"max_position_embeddings={self.config.max_position_embeddings}"
                )

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits float32 [B, vocab]. Graph-capturable: fixed shapes, no host sync, no value branching."""
        self._require_cache("decode")
        kv_slot_ids, seq_lens = ops.decode_kv_indices(batch.positions, batch.page_table, self.page_size)
        ctx = StepContext(
            positions=batch.positions,
            kv_slot_ids=kv_slot_ids,
            state_slots=batch.state_slots,
            page_tables=batch.page_table,
            seq_lens=seq_lens,
        )
        return self._logits(*self._layers(batch.tokens, ctx))

    def _layers(self, tokens: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last layer's output and the residual stream before it (their sum is the hidden state)."""
        x = self.embed(tokens)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, self.cos_sin)
        return x, residual

    def _logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        normed, _ = ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps, residual)
        return self.head(normed)
