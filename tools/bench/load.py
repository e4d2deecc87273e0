"""``phalanx bench load``: peak resident memory of one rank loading its TP shard.

Writes a synthetic bf16 Qwen3.5 checkpoint (sharded safetensors with an index, random values,
Qwen3.5-like geometry scaled to the requested size), then loads one rank's shard in a fresh
subprocess and reports that process's peak RSS (VmHWM) against the checkpoint size. The baseline
(RSS after importing torch and the model code, before loading) is reported too, so the memory the
load itself adds is visible.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phalanx.tools.bench.args import at_least

GIB = 1024**3
MIB = 1024**2

# A 2B-like geometry; layers are added until the checkpoint reaches the requested size.
BASE_TEXT_CONFIG = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 32768,
    "rms_norm_eps": 1e-6,
    "full_attention_interval": 4,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "eos_token_id": 1,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-gb", type=float, default=4.0, help="checkpoint size to write (GiB)")
    parser.add_argument("--tp", type=at_least(1), default=4, help="TP degree (default 4)")
    parser.add_argument("--rank", type=at_least(0), default=0, help="the rank whose load is measured")
    parser.add_argument("--dir", default=None, help="write the checkpoint here and keep it (default: temp)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    if args.dir is not None:
        return _bench(Path(args.dir), args)
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-load-") as tmp:
        return _bench(Path(tmp), args)


def _bench(model_dir: Path, args: argparse.Namespace) -> int:
    started = time.perf_counter()
    size = write_synthetic_checkpoint(model_dir, int(args.size_gb * GIB))
    write_seconds = time.perf_counter() - started
    figures = measure_rank_load(model_dir, tp=args.tp, rank=args.rank)
    figures.update(checkpoint_bytes=size, tp=args.tp, rank=args.rank, write_seconds=round(write_seconds, 1))
    figures["peak_over_checkpoint"] = round(figures["peak_rss_bytes"] / size, 4)
    figures["load_added_over_checkpoint"] = round(
        (figures["peak_rss_bytes"] - figures["baseline_rss_bytes"]) / size, 4
    )
    if args.json:
        print(json.dumps(figures))
    else:
        print(
            f"checkpoint {size / GIB:.2f} GiB, TP={args.tp} rank {args.rank}: "
            f"peak RSS {figures['peak_rss_bytes'] / MIB:.0f} MiB "
            f"({figures['peak_over_checkpoint']:.1%} of the checkpoint), "
            f"baseline before load {figures['baseline_rss_bytes'] / MIB:.0f} MiB, "
            f"load added {(figures['peak_rss_bytes'] - figures['baseline_rss_bytes']) / MIB:.0f} MiB "
            f"({figures['load_added_over_checkpoint']:.1%}), "
            f"rank-local weights {figures['local_weight_bytes'] / MIB:.0f} MiB, "
            f"load {figures['load_seconds']:.1f} s"
        )
    return 0 if figures["peak_over_checkpoint"] < 1 / 3 else 1


def _layer_tensors(config: dict, index: int) -> dict[str, tuple[int, ...]]:
    from phalanx.models.qwen35.config import Qwen35Config
    from phalanx.models.qwen35.sharding import RankLayout, tensor_specs

    parsed = Qwen35Config.from_dicts(config)
    specs = tensor_specs(parsed, RankLayout.build(parsed, 0, 1), include_lm_head=True)
    prefix = f"layers.{index}."
    return {"model." + s.name: s.shape for s in specs if s.name.startswith(prefix)}


def write_synthetic_checkpoint(model_dir: Path, target_bytes: int) -> int:
    """Write config + sharded bf16 safetensors (one file per layer) of at least target_bytes."""
    import torch
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    hidden, vocab = BASE_TEXT_CONFIG["hidden_size"], BASE_TEXT_CONFIG["vocab_size"]
    embed_bytes = 2 * vocab * hidden * 2  # embedding + untied head, bf16
    interval = BASE_TEXT_CONFIG["full_attention_interval"]
    probe = {**BASE_TEXT_CONFIG, "num_hidden_layers": interval}
    group_bytes = sum(
        2 * math.prod(shape) for i in range(interval) for shape in _layer_tensors(probe, i).values()
    )
    layers = interval * max(1, -(-(target_bytes - embed_bytes) // group_bytes))
    config = {**BASE_TEXT_CONFIG, "num_hidden_layers": layers, "tie_word_embeddings": False}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))

    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0

    def save(file_name: str, shapes: dict[str, tuple[int, ...]]) -> None:
        nonlocal total
        tensors = {
            name: torch.empty(shape, dtype=torch.bfloat16).normal_(generator=gen)
            for name, shape in shapes.items()
        }
        for name in ("A_log", "linear_attn.norm.weight"):  # F32 in the real checkpoints
            for key in [k for k in tensors if k.endswith(name)]:
                tensors[key] = tensors[key].float()
        save_file(tensors, str(model_dir / file_name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file_name))

    files = layers + 2
    save(f"model-00001-of-{files:05d}.safetensors", {"model.embed_tokens.weight": (vocab, hidden)})
    for i in range(layers):
        save(f"model-{i + 2:05d}-of-{files:05d}.safetensors", _layer_tensors(config, i))
    save(
        f"model-{files:05d}-of-{files:05d}.safetensors",
        {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)},
    )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


_CHILD = """
import json, math, sys, time
import torch
from phalanx.models.qwen35 import Qwen35Model
from phalanx.models.qwen35.sharding import tensor_specs

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

model_dir, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
baseline = status("VmRSS")
started = time.perf_counter()
model = Qwen35Model.load(model_dir, rank=rank, world_size=tp, dtype=torch.bfloat16)
seconds = time.perf_counter() - started
specs = tensor_specs(model.config, model.layout, include_lm_head=not model.config.tie_word_embeddings)
local = sum(math.prod(s.local_shape) * (4 if s.keep_fp32 else 2) for s in specs)
print(json.dumps({"baseline_rss_bytes": baseline, "peak_rss_bytes": status("VmHWM"),
                  "local_weight_bytes": local, "load_seconds": round(seconds, 2)}))
"""


def measure_rank_load(model_dir: Path, *, tp: int, rank: int) -> dict:
    """Load one rank's shard in a fresh interpreter and return its memory figures."""
    repo_root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model_dir), str(tp), str(rank)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"rank {rank} load subprocess failed (exit {result.returncode}):\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
