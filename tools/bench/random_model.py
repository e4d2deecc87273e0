"""A Qwen3.5 model of a named geometry with random weights made on the device, for the benches
(no download, no files): whole at TP 1, or one rank's shard of the same global model; and the
weight bytes one of its decode steps reads."""

from __future__ import annotations

import dataclasses
import zlib

import torch

from phalanx.tools.geometries import config_dict, random_tensor


def random_weights(config, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor a TP = 1 rank loads, random, under the loader's keys, shapes and dtypes
    (specs fused into one tensor, such as gate|up, are concatenated in spec order, as it does)."""
    from phalanx.models.qwen35.sharding import RankLayout, tensor_specs

    gen = torch.Generator(device=device).manual_seed(seed)
    layout = RankLayout.build(config, 0, 1)
    parts: dict[str, list[torch.Tensor]] = {}
    for spec in tensor_specs(config, layout, include_lm_head=not config.tie_word_embeddings):
        parts.setdefault(spec.key, []).append(random_tensor(spec, gen, device, dtype))
    return {key: group[0] if len(group) == 1 else torch.cat(group) for key, group in parts.items()}


def build_random_model(
    geometry: str,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    state_dtype: torch.dtype = torch.float32,
):
    """A ``Qwen35Model`` of the named geometry with random weights made on ``device``."""
    from phalanx.models.qwen35 import Qwen35Config, Qwen35Model
    from phalanx.models.qwen35.sharding import RankLayout

    config = Qwen35Config.from_dicts(config_dict(geometry), source=f"geometry {geometry}")
    weights = random_weights(config, device, dtype, seed)
    return Qwen35Model(config, RankLayout.build(config, 0, 1), weights, device, dtype, state_dtype)


def weight_bytes_per_step(model) -> int:
    """Bytes of every weight one decode step reads: all layers, the final norm and the LM head
    (the embedding gathers only B rows; a tied head is counted once, as the head)."""
    seen: set[int] = set()
    total = 0
    tensors = [model.final_norm, model.head.weight]
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        for part in (layer.attention, layer.linear_attention, layer.mlp):
            if part is not None:
                tensors += [
                    t
                    for k, t in vars(part).items()
                    if isinstance(t, torch.Tensor) and not k.endswith(("cache", "state"))
                ]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def sharded_random_weights(config, layout, device: torch.device, dtype: torch.dtype, seed: int):
    """This rank's slices of one global random model: the same global tensors at every TP degree.

    Each whole checkpoint tensor comes from a generator seeded by ``seed`` and the tensor's name
    (on CUDA, identical GPUs give identical tensors), then only the rank's ranges are kept, and
    specs fused into one tensor are concatenated in spec order, as the loader does.
    """
    from phalanx.models.qwen35.sharding import tensor_specs

    parts: dict[str, list[torch.Tensor]] = {}
    for spec in tensor_specs(config, layout, include_lm_head=not config.tie_word_embeddings):
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
        whole = random_tensor(dataclasses.replace(spec, ranges=None), gen, device, dtype)
        if spec.ranges is None:
            local = whole
        else:
            pieces = [whole.narrow(spec.dim, lo, hi - lo) for lo, hi in spec.ranges]
            local = torch.cat(pieces, dim=spec.dim) if len(pieces) > 1 else pieces[0].contiguous()
        del whole
        parts.setdefault(spec.key, []).append(local)
    return {key: group[0] if len(group) == 1 else torch.cat(group) for key, group in parts.items()}


def build_sharded_model(
    geometry: str,
    rank: int,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    state_dtype: torch.dtype = torch.float32,
):
    """Rank ``rank`` of ``world_size`` of the named geometry's random model."""
    from phalanx.models.qwen35 import Qwen35Config, Qwen35Model
    from phalanx.models.qwen35.sharding import RankLayout

    config = Qwen35Config.from_dicts(config_dict(geometry), source=f"geometry {geometry}")
    layout = RankLayout.build(config, rank, world_size)
    weights = sharded_random_weights(config, layout, device, dtype, seed)
    return Qwen35Model(config, layout, weights, device, dtype, state_dtype)
