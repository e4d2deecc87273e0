"""The README's "Serve a real model" section holds: the commands it shows run on the demo model
where they need no GPU (the GPU ones parse), the hub-id refusal reads as shown, and its memory and
TP table agrees with the model code for every size."""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from phalanx.models.qwen35.config import ConfigError, Qwen35Config
from phalanx.models.qwen35.sharding import RankLayout, tensor_specs
from phalanx.tools.cli import command_parser
from phalanx.tools.geometries import config_dict
from tests.support.live_server import REPO, serve_process

GIB, MIB = 1 << 30, 1 << 20


def _section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("\n## Serve a real model\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _blocks(kind: str) -> list[list[str]]:
    return [
        block.strip().splitlines() for block in re.findall(rf"```{kind}\n(.*?)```", _section(), re.DOTALL)
    ]


def _phalanx_commands() -> list[list[str]]:
    lines = [line for block in _blocks("bash") for line in block]
    assert any(line.startswith("huggingface-cli download Qwen/Qwen3.5-") for line in lines)
    return [shlex.split(line)[1:] for line in lines if line.startswith("phalanx ")]


def _on_the_demo_model(args: list[str], model_dir: Path) -> list[str]:
    return [str(model_dir) if arg.startswith("~/models/") else arg for arg in args]


def test_the_hub_id_refusal_reads_as_shown() -> None:
    ((command, *expected),) = _blocks("console")
    args = shlex.split(command.removeprefix("$ "))
    assert args[:2] == ["phalanx", "serve"]
    done = subprocess.run(
        [sys.executable, "-m", "phalanx.tools", *args[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and (done.stdout + done.stderr).splitlines() == expected


def test_the_gpu_commands_parse() -> None:
    gpu = [args for args in _phalanx_commands() if "cuda" in args]
    assert len(gpu) == 2 and any("--tensor-parallel-size" in args for args in gpu)
    for name, *rest in gpu:
        parsed = command_parser(name).parse_args(rest)
        assert parsed.device == "cuda"


def test_the_cpu_commands_run_on_the_demo_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    cpu = [_on_the_demo_model(args, tiny_model_dir) for args in _phalanx_commands() if "cuda" not in args]
    assert [args[0] for args in cpu] == ["generate", "serve"]
    generate, serve = cpu
    done = subprocess.run(
        [sys.executable, "-m", "phalanx.tools", *generate],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0 and done.stdout.strip() and done.stderr == "", done.stderr[-3000:]
    with serve_process(serve[1:], tmp_path / "serve.log") as served:
        models = httpx.get(served.url + "/v1/models", timeout=10).json()
        assert [model["id"] for model in models["data"]] == [tiny_model_dir.name]


def _table() -> dict[str, list[str]]:
    rows = [line for line in _section().splitlines() if re.match(r"^\| \d", line)]
    return {row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:-1]] for row in rows}


@pytest.mark.parametrize("geometry", ["0.8b", "2b", "4b", "9b", "27b"])
def test_the_memory_and_tp_table_agrees_with_the_model_code(geometry: str) -> None:
    config = Qwen35Config.from_dicts(config_dict(geometry))
    row = _table()[geometry.upper()]
    layout = RankLayout.build(config, 0, 1)
    specs = tensor_specs(config, layout, include_lm_head=not config.tie_word_embeddings)
    params = sum(math.prod(spec.local_shape) for spec in specs)
    assert row[1] == f"{params * 2 / GIB:.1f} GiB" and row[2] == f"{params * 4 / GIB:.1f} GiB"
    full = config.layer_types.count("full_attention")
    assert row[0] == f"{config.num_hidden_layers} ({full} / {config.num_hidden_layers - full})"
    kv_per_1k = 2 * config.num_key_value_heads * config.head_dim * full * 1024
    assert row[3] == f"{kv_per_1k * 2 // MIB} / {kv_per_1k * 4 // MIB} MiB"
    linear = config.num_hidden_layers - full
    elements = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    conv = config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * 2
    bf16, fp32 = (linear * (elements * size + conv) / MIB for size in (2, 4))
    assert row[4] == f"{bf16:.1f} / {fp32:.1f} MiB"
    degrees = []
    for tp in range(1, 9):
        try:
            config.validate_tp(tp)
            degrees.append(str(tp))
        except ConfigError:
            pass
    assert row[5] == ", ".join(degrees)
