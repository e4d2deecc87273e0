"""``phalanx make-random-model DIR --geometry 4b``: a Qwen3.5 checkpoint of a real size with random
weights, laid out as the released ones are.

``config.json`` nests the text model under ``text_config`` of a
``Qwen3_5ForConditionalGeneration`` (top-level ``tie_word_embeddings``, the rope block with its
mrope fields), the text weights are named ``model.language_model.*`` with ``lm_head.weight`` at the
top for the untied sizes, and a vision-tower tensor and an MTP-head tensor are present, as in the
released files, for the loader to skip. The tokenizer is the tiny demo's (the model's vocabulary is
padded beyond it, as real checkpoints pad theirs). Benchmarks and the GPU tests serve these
directories; ``--layers`` keeps the sizes' widths at a smaller depth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from phalanx.tools.geometries import GEOMETRIES, ROPE, random_tensor

TEXT_PREFIX = "model.language_model."
# Not part of the text model: the loader must skip them.
SKIPPED_TENSORS = {"model.visual.patch_embed.proj.weight": (16, 3, 2, 16, 16), "mtp.fc.weight": (16, 32)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    parser.add_argument(
        "--geometry", choices=sorted(GEOMETRIES), default="4b", help="model size (default: 4b)"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: the size's own; a multiple of 4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where weights are drawn"
    )


def run(args: argparse.Namespace) -> int:
    try:
        size = write_random_checkpoint(
            args.geometry, args.dir, torch.device(args.device), args.seed, args.layers
        )
    except (OSError, ValueError) as exc:
        print(f"phalanx make-random-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.geometry} ({size / 2**30:.2f} GiB of weights) to {args.dir}")
    return 0


def released_config(geometry: str, layers: int | None = None) -> dict[str, object]:
    """config.json of ``geometry`` in the released checkpoints' nesting."""
    text = dict(GEOMETRIES[geometry])
    tied = bool(text.pop("tie_word_embeddings"))
    if layers is not None:
        if layers < 4 or layers % 4:
            raise ValueError(
                f"--layers must be a positive multiple of 4 (one attention layer in 4), got {layers}"
            )
        text["num_hidden_layers"] = layers
    text.update(
        model_type="qwen3_5_text",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        attn_output_gate=True,
        rope_parameters=dict(ROPE, mrope_section=[11, 11, 10], mrope_interleaved=True),
        dtype="bfloat16",
        eos_token_id=2,
    )
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": tied,
        "text_config": text,
        "vision_config": {"depth": 1},
        "dtype": "bfloat16",
    }


def write_random_checkpoint(
    geometry: str, out_dir: Path, device: torch.device, seed: int = 0, layers: int | None = None
) -> int:
    """Write config, generation config, weights and tokenizer; returns the text weights' bytes."""
    from safetensors.torch import save_file

    from phalanx.models.qwen35 import Qwen35Config
    from phalanx.models.qwen35.sharding import RankLayout, tensor_specs
    from phalanx.models.qwen35.weights import TOP_LEVEL
    from phalanx.models.tiny import _write_tokenizer

    raw = released_config(geometry, layers)
    config = Qwen35Config.from_dicts(raw, source=f"geometry {geometry}")
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for spec in tensor_specs(
        config, RankLayout.build(config, 0, 1), include_lm_head=not config.tie_word_embeddings
    ):
        name = spec.name if spec.name in TOP_LEVEL else TEXT_PREFIX + spec.name
        tensors[name] = random_tensor(spec, gen, device, torch.bfloat16).cpu()
    text_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    for name, shape in SKIPPED_TENSORS.items():
        tensors[name] = torch.zeros(shape, dtype=torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos_ids = _write_tokenizer(out_dir)
    raw["text_config"]["eos_token_id"] = eos_ids[0]
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    save_file(tensors, str(out_dir / "model.safetensors"))
    return text_bytes
