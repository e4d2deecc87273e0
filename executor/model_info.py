"""What the scheduler needs to know about the model, read from config.json in the coordinator.

This deliberately does not import the model package (torch): the coordinator stays light.
Fields are read from ``text_config`` first, then the top level, as released Qwen3.5 checkpoints
put them in either place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelInfoError(ValueError):
    pass


# The dense Qwen3.5 text models, as released (with a vision tower that is skipped) or text-only.
SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    model_type: str
    dtype: str = ""  # the checkpoint's torch dtype name ("bfloat16" …), "" if config.json names none


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def read_model_info(model_dir: str | Path) -> ModelInfo:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelInfoError(f"no config.json in model directory {model_dir}")
    raw = json.loads(config_path.read_text())
    check_architecture(raw, config_path)
    text = raw.get("text_config") or {}

    def field(key: str) -> Any:
        value = text.get(key, raw.get(key))
        if value is None:
            raise ModelInfoError(f"{config_path}: missing {key}")
        return value

    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    eos: list[int] = []
    for token in _ids(generation.get("eos_token_id")) + _ids(
        text.get("eos_token_id", raw.get("eos_token_id"))
    ):
        if token not in eos:
            eos.append(token)
    if not eos:
        raise ModelInfoError(f"{config_path}: no eos_token_id in generation_config.json or config.json")
    return ModelInfo(
        vocab_size=int(field("vocab_size")),
        eos_token_ids=tuple(eos),
        max_position_embeddings=int(field("max_position_embeddings")),
        model_type=str(text.get("model_type", raw.get("model_type", ""))),
        dtype=str(
            text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or ""
        ),
    )


def check_architecture(raw: dict[str, Any], config_path: Path) -> None:
    """Refuse, in one sentence, a config.json that is not a dense Qwen3.5 text model (another
    architecture, the MoE variants); a config that names neither field is taken as Qwen3.5."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if isinstance(architectures, str):
        architectures = [architectures]
    known = any(name in SUPPORTED_ARCHITECTURES for name in architectures)
    if (architectures and not known) or (model_type is not None and model_type not in SUPPORTED_MODEL_TYPES):
        found = ", ".join(map(str, architectures)) or "no architecture"
        raise ModelInfoError(
            f"{config_path} describes {found} (model_type {model_type!r}), which phalanx does not "
            f"serve: it serves the dense Qwen3.5 text models ({', '.join(SUPPORTED_ARCHITECTURES)}; "
            f"model_type {' or '.join(SUPPORTED_MODEL_TYPES)})"
        )
