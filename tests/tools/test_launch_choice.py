"""What ``serve`` and ``generate`` decide before a launch: device and dtype defaults, CUDA graphs
on by default on CUDA, memory flags, and the one-sentence refusals that leave no process behind."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from phalanx.tools.cli import main
from phalanx.tools.launch_options import add_model_arguments, choose_launch, resolve_dtype


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser.parse_args(list(flags))


def _checkpoint(tmp_path: Path, **config: object) -> Path:
    raw = {"vocab_size": 64, "max_position_embeddings": 256, "eos_token_id": 1, **config}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def _refused(command: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``phalanx COMMAND FLAG VALUE`` exits 2 (argparse's refusal); returns its stderr."""
    extra = ["--prompt", "x"] if command == "generate" else []
    with pytest.raises(SystemExit) as exit_info:
        main([command, flag, value, *extra])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_cuda_defaults_are_graphs_all_memory_and_the_checkpoint_s_dtype(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path, torch_dtype="bfloat16")
    choice = choose_launch(_args("--device", "cuda"), model)
    assert (choice.device, choice.dtype, choice.cuda_graph) == ("cuda", "bfloat16", True)
    assert (choice.kv_pages, choice.max_slots, choice.max_model_len) == (0, 0, 0)
    assert choice.gpu_memory_utilization == 0.9
    eager = choose_launch(_args("--device", "cuda", "--enforce-eager", "--max-model-len", "128"), model)
    assert not eager.cuda_graph and eager.max_model_len == 128


def test_cpu_defaults_are_eager_float32_and_fixed_sizes(tmp_path: Path) -> None:
    choice = choose_launch(_args("--device", "cpu"), _checkpoint(tmp_path, torch_dtype="bfloat16"))
    assert (choice.device, choice.dtype, choice.cuda_graph) == ("cpu", "float32", False)
    assert (choice.kv_pages, choice.max_slots) == (512, 16)


def test_the_prefix_cache_is_on_by_default_and_sized_by_the_ranks(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path)
    choice = choose_launch(_args("--device", "cpu"), model)
    assert (choice.prefix_cache, choice.prefix_snapshots) == (True, 0)
    off = choose_launch(_args("--device", "cpu", "--no-prefix-cache"), model)
    given = choose_launch(_args("--device", "cpu", "--prefix-snapshots", "64"), model)
    assert (off.prefix_cache, given.prefix_snapshots) == (False, 64)
    with pytest.raises(ValueError) as refused:
        choose_launch(_args("--no-prefix-cache", "--prefix-snapshots", "8"), model)
    assert (
        str(refused.value) == "--prefix-snapshots sizes the prefix cache, which --no-prefix-cache turns off"
    )


def test_auto_device_follows_what_torch_sees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    model = _checkpoint(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_launch(_args(), model).device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a GPU")
    assert choose_launch(_args(), model).device == "cuda"


@pytest.mark.parametrize(
    ("flag", "checkpoint", "device", "expected"),
    [
        ("auto", "bfloat16", "cuda", "bfloat16"),
        ("auto", "float16", "cuda", "float16"),
        ("auto", "float32", "cuda", "bfloat16"),
        ("auto", "", "cuda", "bfloat16"),
        ("auto", "bfloat16", "cpu", "float32"),
        ("float16", "bfloat16", "cuda", "float16"),
    ],
)
def test_dtype_auto_is_the_checkpoint_s_16_bit_dtype_on_cuda(
    flag: str, checkpoint: str, device: str, expected: str
) -> None:
    assert resolve_dtype(flag, device, checkpoint) == expected


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "half"])
def test_a_memory_fraction_outside_0_to_1_is_refused(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert f"argument --gpu-memory-utilization: must be above 0 and at most 1, got '{value}'" in (
        _refused(command, "--gpu-memory-utilization", value, capsys)
    )


def test_max_model_len_above_the_checkpoint_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _checkpoint(tmp_path)
    assert main(["serve", "--model", str(model), "--device", "cpu", "--max-model-len", "300"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"phalanx serve: error: --max-model-len 300 exceeds the checkpoint's context of 256 tokens "
        f"(max_position_embeddings in {model}/config.json)"
    )
    code = main(
        ["generate", "--model", str(model), "--device", "cpu", "--max-model-len", "300", "--prompt-ids", "1"]
    )
    assert code == 2
    assert "--max-model-len 300 exceeds the checkpoint's context of 256 tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "found"),
    [
        (
            {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"},
            "Qwen3_5MoeForConditionalGeneration (model_type 'qwen3_5_moe')",
        ),
        (
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
            "LlamaForCausalLM (model_type 'llama')",
        ),
        ({"model_type": "mistral"}, "no architecture (model_type 'mistral')"),
    ],
)
def test_another_architecture_is_named_in_one_sentence_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, object], found: str
) -> None:
    model = _checkpoint(tmp_path, **config)
    assert main(["serve", "--model", str(model), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"phalanx serve: error: {model}/config.json describes {found}, which phalanx does not serve: "
        "it serves the dense Qwen3.5 text models (Qwen3_5ForConditionalGeneration, "
        "Qwen3_5ForCausalLM; model_type qwen3_5 or qwen3_5_text)"
    )


def test_released_and_text_only_qwen35_configs_are_accepted(tmp_path: Path) -> None:
    from phalanx.executor.model_info import read_model_info

    released = _checkpoint(
        tmp_path,
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        text_config={"model_type": "qwen3_5_text", "dtype": "bfloat16"},
    )
    assert read_model_info(released).dtype == "bfloat16"


def test_the_startup_timeout_defaults_to_600_s_and_is_carried_to_the_replica(tmp_path: Path) -> None:
    from phalanx.tools.launch_options import add_launch_arguments, add_log_arguments, replica_config

    parser = argparse.ArgumentParser()
    for add in (add_model_arguments, add_launch_arguments, add_log_arguments):
        add(parser)
    model = _checkpoint(tmp_path)

    def timeout(*flags: str) -> float:
        args = parser.parse_args(["--device", "cpu", *flags])
        config = replica_config(args, model, 1, choose_launch(args, model))
        return config.timeouts.startup_timeout

    assert (timeout(), timeout("--startup-timeout", "1500")) == (600.0, 1500.0)


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan", "soon"])
def test_a_startup_timeout_that_is_not_a_positive_number_is_refused(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert f"argument --startup-timeout: must be a positive number, got '{value}'" in (
        _refused(command, "--startup-timeout", value, capsys)
    )
