"""Qwen3.5 text-model configuration read from a Hugging Face model directory.

Released checkpoints nest the text fields under ``text_config`` (``Qwen3_5ForConditionalGeneration``)
and keep a few keys (``tie_word_embeddings``, ``max_position_embeddings``) only at the top level; a
text-only checkpoint (``Qwen3_5ForCausalLM``) has everything at the top level. Every field is read
from ``text_config`` first, then from the top level.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class ConfigError(ValueError):
    """The model directory's configuration is unusable (or unusable at the requested TP degree)."""


@dataclass(frozen=True)
class Qwen35Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    rope_theta: float
    partial_rotary_factor: float
    eos_token_ids: tuple[int, ...]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Qwen35Config:
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"no config.json in model directory {model_dir}")
        raw = json.loads(config_path.read_text())
        generation_path = model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        return cls.from_dicts(raw, generation, source=str(config_path))

    @classmethod
    def from_dicts(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, *, source: str = "config"
    ) -> Qwen35Config:
        fields = _Fields(raw, source)
        config = cls(
            hidden_size=fields.positive_int("hidden_size"),
            intermediate_size=fields.positive_int("intermediate_size"),
            num_hidden_layers=fields.positive_int("num_hidden_layers"),
            num_attention_heads=fields.positive_int("num_attention_heads"),
            num_key_value_heads=fields.positive_int("num_key_value_heads"),
            head_dim=fields.positive_int("head_dim"),
            linear_num_key_heads=fields.positive_int("linear_num_key_heads"),
            linear_num_value_heads=fields.positive_int("linear_num_value_heads"),
            linear_key_head_dim=fields.positive_int("linear_key_head_dim"),
            linear_value_head_dim=fields.positive_int("linear_value_head_dim"),
            linear_conv_kernel_dim=fields.positive_int("linear_conv_kernel_dim", default=4),
            vocab_size=fields.positive_int("vocab_size"),
            rms_norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
            max_position_embeddings=fields.positive_int("max_position_embeddings"),
            layer_types=_layer_types(fields),
            rope_theta=float(_rope_field(fields, "rope_theta", 10000.0)),
            partial_rotary_factor=float(_rope_field(fields, "partial_rotary_factor", 0.25)),
            eos_token_ids=_eos_token_ids(fields, generation or {}),
        )
        config._check_structure(source)
        activation = fields.get("hidden_act", "silu")
        if activation != "silu":
            raise ConfigError(f"{source}: hidden_act={activation!r} is not supported (only 'silu')")
        return config

    def _check_structure(self, source: str) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"{source}: linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        rotary = self.head_dim * self.partial_rotary_factor
        if rotary != int(rotary) or int(rotary) % 2 or not 0 < rotary <= self.head_dim:
            raise ConfigError(
                f"{source}: partial_rotary_factor={self.partial_rotary_factor} with head_dim="
                f"{self.head_dim} gives rotary dim {rotary}, which must be a positive even integer"
            )

    def validate_tp(self, tp: int) -> None:
        """Raise ConfigError unless every sharded dimension divides by the TP degree ``tp``."""
        if tp < 1:
            raise ConfigError(f"TP degree must be at least 1, got {tp}")
        for name in (
            "num_attention_heads",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "intermediate_size",
            "vocab_size",
        ):
            value = getattr(self, name)
            if value % tp:
                raise ConfigError(f"{name}={value} is not divisible by TP degree {tp}")
        kv = self.num_key_value_heads
        if kv >= tp and kv % tp:
            raise ConfigError(f"num_key_value_heads={kv} is not divisible by TP degree {tp}")
        if kv < tp and tp % kv:
            raise ConfigError(
                f"num_key_value_heads={kv} cannot be replicated over TP degree {tp}: "
                f"TP degree {tp} must be a multiple of num_key_value_heads={kv}"
            )


class _Fields:
    """Looks a key up in ``text_config`` first, then at the top level."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        text = raw.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config must be an object, got {type(text).__name__}")
        self.layers = [text or {}, raw]
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        for layer in self.layers:
            if layer.get(key) is not None:
                return layer[key]
        return default

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise ConfigError(f"{self.source}: missing required field {key}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{self.source}: field {key}={value!r} must be a positive integer")
        return value


def _layer_types(fields: _Fields) -> tuple[str, ...]:
    num_layers = fields.positive_int("num_hidden_layers")
    layer_types = fields.get("layer_types")
    if layer_types is None:
        interval = fields.positive_int("full_attention_interval", default=4)
        return tuple(
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
        )
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"{fields.source}: layer_types has {len(layer_types)} entries but num_hidden_layers={num_layers}"
        )
    for i, kind in enumerate(layer_types):
        if kind not in (FULL_ATTENTION, LINEAR_ATTENTION):
            raise ConfigError(
                f"{fields.source}: layer_types[{i}]={kind!r} is not "
                f"{FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}"
            )
    return tuple(layer_types)


def _rope_field(fields: _Fields, key: str, default: float) -> Any:
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    if rope.get("rope_type", "default") not in ("default", "mrope"):
        raise ConfigError(
            f"{fields.source}: rope_type={rope['rope_type']!r} is not supported (only 'default')"
        )
    if rope.get(key) is not None:
        return rope[key]
    return fields.get(key, default)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _eos_token_ids(fields: _Fields, generation: dict[str, Any]) -> tuple[int, ...]:
    """Generation config ids first (they are what generation stops on), then the model config's."""
    ids: list[int] = []
    for token_id in _as_id_list(generation.get("eos_token_id")) + _as_id_list(fields.get("eos_token_id")):
        if token_id not in ids:
            ids.append(token_id)
    if not ids:
        raise ConfigError(f"{fields.source}: no eos_token_id in generation_config.json or the model config")
    return tuple(ids)
