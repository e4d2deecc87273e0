"""Checkpoint loading: prefixes, sharded files, skipped towers, dtypes, per-rank slices, errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from phalanx.models.qwen35 import PrefillBatch, Qwen35Model, WeightError
from phalanx.models.qwen35.layers import fold_norm_weight

Tensors = dict[str, torch.Tensor]


def rewrite(src: Path, dst: Path, edit: Callable[[Tensors], Tensors], shards: int = 1) -> Path:
    """Copy a checkpoint with its tensors edited, as one file or several with an index."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    tensors = edit(load_file(src / "model.safetensors"))
    if shards == 1:
        save_file(tensors, dst / "model.safetensors")
        return dst
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name].contiguous() for name in names[i::shards]}
        save_file(part, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def multimodal_layout(tensors: Tensors) -> Tensors:
    """Text weights under model.language_model., plus vision-tower and MTP tensors to be skipped."""
    out = {
        (name if name == "lm_head.weight" else "model.language_model." + name[len("model.") :]): t
        for name, t in tensors.items()
    }
    out["model.visual.patch_embed.proj.weight"] = torch.ones(8, 3, 2, 2)
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(24, 8)
    out["mtp.fc.weight"] = torch.ones(64, 128)
    out["mtp.layers.0.mlp.gate_proj.weight"] = torch.ones(128, 64)
    return out


def prefill_logits(model_dir: Path, **load_args) -> torch.Tensor:
    model = Qwen35Model.load(model_dir, **load_args)
    model.allocate_cache(8, 16, 2)
    return model.prefill(PrefillBatch.build([(list(range(40)), 0, 0, [1, 2, 3])]), all_logits=True)


@pytest.mark.parametrize("shards", [1, 3])
def test_language_model_prefix_sharded_and_skipped_towers(
    tiny_model_dir: Path, tmp_path: Path, shards: int
) -> None:
    moved = rewrite(tiny_model_dir, tmp_path / "mm", multimodal_layout, shards=shards)
    assert (moved / "model.safetensors.index.json").exists() == (shards > 1)
    assert torch.equal(prefill_logits(moved), prefill_logits(tiny_model_dir))


def test_tied_checkpoint_with_redundant_lm_head(tiny_model_dir_tied: Path, tmp_path: Path) -> None:
    def add_head(t: Tensors) -> Tensors:
        return {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()}

    with_head = rewrite(tiny_model_dir_tied, tmp_path / "tied", add_head)
    assert torch.equal(prefill_logits(with_head), prefill_logits(tiny_model_dir_tied))


def drop(name: str) -> Callable[[Tensors], Tensors]:
    return lambda t: {k: v for k, v in t.items() if k != name}


def replace(name: str, value: torch.Tensor) -> Callable[[Tensors], Tensors]:
    return lambda t: {**t, name: value}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            drop("model.layers.0.linear_attn.A_log"),
            "missing tensor model.layers.0.linear_attn.A_log (expected shape [8])",
        ),
        (drop("lm_head.weight"), "missing tensor lm_head.weight (expected shape [512, 64])"),
        (
            replace("model.layers.1.self_attn.k_proj.weight", torch.zeros(32, 64)),
            "tensor model.layers.1.self_attn.k_proj.weight has shape [32, 64] in the checkpoint, expected [64, 64]",
        ),
        (
            replace("model.layers.2.linear_attn.conv1d.weight", torch.zeros(256, 1, 3)),
            "tensor model.layers.2.linear_attn.conv1d.weight has shape [256, 1, 3] in the checkpoint, expected [256, 1, 4]",
        ),
        (
            replace("model.layers.0.mlp.extra.weight", torch.zeros(3)),
            "unexpected tensor model.layers.0.mlp.extra.weight with shape [3]",
        ),
    ],
)
def test_weight_errors_name_tensor_and_shapes(
    tiny_model_dir: Path, tmp_path: Path, edit: Callable[[Tensors], Tensors], message: str
) -> None:
    broken = rewrite(tiny_model_dir, tmp_path / "broken", edit)
    with pytest.raises(WeightError) as err:
        Qwen35Model.load(broken)
    assert message in str(err.value)
    assert str(err.value).startswith("rank 0: checkpoint in ")


def test_no_checkpoint_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightError, match="no model.safetensors or model.safetensors.index.json"):
        Qwen35Model.load(tmp_path)


def test_gdn_decay_and_norm_stay_fp32_in_bf16_model(tiny_model_dir: Path) -> None:
    model = Qwen35Model.load(tiny_model_dir, dtype=torch.bfloat16)
    model.allocate_cache(4, 16, 2)
    for layer in model.layers:
        if layer.linear_attention is not None:
            gdn = layer.linear_attention
            assert gdn.A_log.dtype == gdn.norm.dtype == gdn.recurrent_state.dtype == torch.float32
            assert gdn.in_weight.dtype == gdn.dt_bias.dtype == gdn.conv_state.dtype == torch.bfloat16
        else:
            assert layer.attention.qkv_weight.dtype == layer.attention.k_cache.dtype == torch.bfloat16
    logits = model.prefill(PrefillBatch.build([(list(range(20)), 0, 0, [0, 1])]))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def rows(t: torch.Tensor, start: int, count: int, width: int = 1, offset: int = 0) -> torch.Tensor:
    return t[offset + start * width : offset + (start + count) * width]


def gdn_segments(t: torch.Tensor, rank: int, hk: int, hv: int) -> torch.Tensor:
    """This rank's q heads, k heads (after 4 q heads of 16) and v heads (after 4 k heads)."""
    return torch.cat(
        [rows(t, rank * hk, hk, 16), rows(t, rank * hk, hk, 16, 64), rows(t, rank * hv, hv, 16, 128)]
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices(tiny_model_dir: Path, world_size: int) -> None:
    """Each rank's fused weights are exactly its heads' rows / columns of the HF tensors, the
    input projections' columns times their pre-norm's (1 + w)."""

    def folded(weight: torch.Tensor, norm: str) -> torch.Tensor:
        weight = weight.clone()
        fold_norm_weight(weight, full[norm])
        return weight

    full = load_file(tiny_model_dir / "model.safetensors")
    heads, kv_heads, hk, hv = 4 // world_size, 1, 4 // world_size, 8 // world_size
    inter, vocab = 128 // world_size, 512 // world_size
    for rank in range(world_size):
        model = Qwen35Model.load(tiny_model_dir, rank=rank, world_size=world_size)
        kv_head = rank * 2 // world_size  # 2 KV heads: sharded at TP 2, replicated in pairs at TP 4
        attn = model.layers[1].attention
        p = "model.layers.1.self_attn."
        expected_qkv = torch.cat(
            [
                rows(full[p + "q_proj.weight"], rank * heads, heads, 64),  # [q | gate] per head
                rows(full[p + "k_proj.weight"], kv_head, kv_heads, 32),
                rows(full[p + "v_proj.weight"], kv_head, kv_heads, 32),
            ]
        )
        assert torch.equal(attn.qkv_weight, folded(expected_qkv, "model.layers.1.input_layernorm.weight"))
        assert torch.equal(
            attn.o_weight, full[p + "o_proj.weight"][:, rank * heads * 32 : (rank + 1) * heads * 32]
        )

        gdn = model.layers[0].linear_attention
        p = "model.layers.0.linear_attn."
        qkv, conv = full[p + "in_proj_qkv.weight"], full[p + "conv1d.weight"][:, 0]

        expected_in = torch.cat(
            [
                gdn_segments(qkv, rank, hk, hv),
                rows(full[p + "in_proj_z.weight"], rank * hv, hv, 16),
                rows(full[p + "in_proj_b.weight"], rank * hv, hv),
                rows(full[p + "in_proj_a.weight"], rank * hv, hv),
            ]
        )
        assert torch.equal(gdn.in_weight, folded(expected_in, "model.layers.0.input_layernorm.weight"))
        assert torch.equal(gdn.conv_weight, gdn_segments(conv, rank, hk, hv))
        assert torch.equal(gdn.A_log, rows(full[p + "A_log"], rank * hv, hv))
        assert torch.equal(gdn.dt_bias, rows(full[p + "dt_bias"], rank * hv, hv))
        assert torch.equal(gdn.norm, full[p + "norm.weight"])
        assert torch.equal(
            gdn.out_weight, full[p + "out_proj.weight"][:, rank * hv * 16 : (rank + 1) * hv * 16]
        )

        mlp = model.layers[0].mlp
        p = "model.layers.0.mlp."
        expected_gate_up = torch.cat(
            [
                rows(full[p + "gate_proj.weight"], rank * inter, inter),
                rows(full[p + "up_proj.weight"], rank * inter, inter),
            ]
        )
        assert torch.equal(
            mlp.gate_up_weight, folded(expected_gate_up, "model.layers.0.post_attention_layernorm.weight")
        )
        assert torch.equal(
            mlp.down_weight, full[p + "down_proj.weight"][:, rank * inter : (rank + 1) * inter]
        )
        assert torch.equal(model.embed.weight, rows(full["model.embed_tokens.weight"], rank * vocab, vocab))
        assert torch.equal(model.head.weight, rows(full["lm_head.weight"], rank * vocab, vocab))


def test_rank_reads_only_its_slices(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte a TP=4 rank reads from the checkpoint ends up in its own weights."""
    import phalanx.models.qwen35.weights as weights

    read_elements: dict[str, int] = {}
    real_safe_open = weights.safe_open

    class RecordingSlice:
        def __init__(self, name: str, inner) -> None:  # noqa: ANN001 (safetensors PySafeSlice)
            self.name, self.inner = name, inner

        def get_shape(self) -> list[int]:
            return self.inner.get_shape()

        def __getitem__(self, index):  # noqa: ANN001, ANN204
            part = self.inner[index]
            read_elements[self.name] = read_elements.get(self.name, 0) + part.numel()
            return part

    class RecordingFile:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self) -> RecordingFile:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_slice(self, name: str) -> RecordingSlice:
            return RecordingSlice(name, self.inner.get_slice(name))

    monkeypatch.setattr(weights, "safe_open", RecordingFile)
    Qwen35Model.load(tiny_model_dir, rank=1, world_size=4)
    full = load_file(tiny_model_dir / "model.safetensors")
    replicated = ("norm.weight", "layernorm.weight")
    for name, tensor in full.items():
        expected = tensor.numel() if name.endswith(replicated) else tensor.numel() // 4
        if ".self_attn.k_proj" in name or ".self_attn.v_proj" in name:
            expected = tensor.numel() // 2  # 2 KV heads replicated over 4 ranks: one whole head
        assert read_elements[name] == expected, name
