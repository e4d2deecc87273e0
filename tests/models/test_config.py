"""Qwen35Config: reading HF model directories and validating a TP degree (errors asserted by text)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.models.qwen35 import ConfigError, Qwen35Config

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "eos_token_id": 7,
}


def write(tmp_path: Path, config: dict, generation: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_tiny_model_config(tiny_model_dir: Path) -> None:
    config = Qwen35Config.from_dir(tiny_model_dir)
    assert config.layer_types == ("linear_attention", "full_attention", "linear_attention", "full_attention")
    assert config.rotary_dim == 8
    assert config.rope_theta == 1e7
    assert not config.tie_word_embeddings
    assert config.linear_conv_dim == 2 * 4 * 16 + 8 * 16
    assert config.eos_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    assert Qwen35Config.from_dir(Path(str(tiny_model_dir))).vocab_size == 512


def test_text_config_nesting_with_top_level_fallback(tmp_path: Path) -> None:
    text = {k: v for k, v in TEXT.items() if k != "max_position_embeddings"}
    raw = {
        "model_type": "qwen3_5",
        "text_config": {**text, "full_attention_interval": 4},
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "eos_token_id": 9,
    }
    config = Qwen35Config.from_dir(write(tmp_path, raw, {"eos_token_id": [5, 7]}))
    assert config.tie_word_embeddings
    assert config.max_position_embeddings == 4096
    # full_attention_interval 4 (layer_types absent): full attention at 3 and 7.
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [3, 7]
    # generation config first, then the text config's, then the top level's, without repeats
    assert config.eos_token_ids == (5, 7)


def test_eos_from_config_without_generation_config(tmp_path: Path) -> None:
    assert Qwen35Config.from_dir(write(tmp_path, TEXT)).eos_token_ids == (7,)


def test_legacy_rope_fields(tmp_path: Path) -> None:
    raw = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    raw.update(rope_theta=5e6, partial_rotary_factor=0.5)
    config = Qwen35Config.from_dir(write(tmp_path, raw))
    assert (config.rope_theta, config.rotary_dim) == (5e6, 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "missing required field hidden_size"),
        ({"num_attention_heads": 0}, "field num_attention_heads=0 must be a positive integer"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types has 3 entries but num_hidden_layers=8"),
        ({"layer_types": ["linear_attention"] * 7 + ["mamba"]}, "layer_types[7]='mamba' is not"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        (
            {"linear_num_value_heads": 6},
            "linear_num_value_heads=6 is not a multiple of linear_num_key_heads=4",
        ),
        ({"eos_token_id": None}, "no eos_token_id"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "rope_type='yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_config_errors(tmp_path: Path, change: dict, message: str) -> None:
    raw = {k: v for k, v in {**TEXT, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        Qwen35Config.from_dir(write(tmp_path, raw))
    assert message in str(err.value)
    assert "config.json" in str(err.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json in model directory"):
        Qwen35Config.from_dir(tmp_path)


def config_with(**fields: int) -> Qwen35Config:
    return Qwen35Config.from_dicts({**TEXT, **fields})


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tiny_geometry_allows_tp(tp: int) -> None:
    config_with().validate_tp(tp)  # KV heads (2) replicated at TP 4


@pytest.mark.parametrize(
    ("fields", "tp", "message"),
    [
        ({}, 3, "num_attention_heads=4 is not divisible by TP degree 3"),
        (
            {"num_attention_heads": 8, "linear_num_key_heads": 2},
            4,
            "linear_num_key_heads=2 is not divisible by TP degree 4",
        ),
        (
            {"linear_num_value_heads": 12, "num_attention_heads": 12, "num_key_value_heads": 6},
            4,
            "num_key_value_heads=6 is not divisible by TP degree 4",
        ),
        ({"intermediate_size": 130}, 4, "intermediate_size=130 is not divisible by TP degree 4"),
        ({"vocab_size": 510}, 4, "vocab_size=510 is not divisible by TP degree 4"),
        (
            {
                "num_attention_heads": 12,
                "num_key_value_heads": 4,
                "linear_num_key_heads": 6,
                "linear_num_value_heads": 12,
                "intermediate_size": 132,
                "vocab_size": 516,
            },
            6,
            "num_key_value_heads=4 cannot be replicated over TP degree 6",
        ),
        ({}, 0, "TP degree must be at least 1, got 0"),
    ],
)
def test_tp_errors_name_field_value_and_degree(fields: dict, tp: int, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_with(**fields).validate_tp(tp)
    assert message in str(err.value)
