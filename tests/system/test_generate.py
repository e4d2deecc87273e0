"""``phalanx generate``: the demo model path at TP=2 against transformers, and refusals before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from phalanx.protocol.messages import FED_TOKEN, NO_FEED, Decode, Prefill
from phalanx.protocol.trace import read_trace
from phalanx.tools.cli import main
from phalanx.tools.launch_options import model_dir_problem


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "no-pipeline"])
def test_generate_with_the_demo_model_at_tp2_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], pipelined: bool
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prompt = "The quick brown fox"
    trace = tmp_path / "generate.trace"
    flags = [] if pipelined else ["--no-pipeline"]
    code = main(
        [
            "generate",
            "--tp",
            "2",
            "--prompt",
            prompt,
            "--max-tokens",
            "7",
            "--json",
            "--record",
            str(trace),
            *flags,
        ]
    )
    assert code == 0
    # Pipelined, every decode step feeds the token the ranks sampled, the first one the prefill's
    # (its chunk names the slot the token is kept for).
    steps = {
        e.seq: e.message.body
        for e in read_trace(trace).entries
        if isinstance(e.message.body, (Prefill, Decode))
    }
    bodies = [body for _, body in sorted(steps.items())]
    fed = [row.token == FED_TOKEN for body in bodies if isinstance(body, Decode) for row in body.rows]
    assert len(fed) == 6 and fed == [pipelined] * 6
    feeds = {chunk.feed_slot for body in bodies if isinstance(body, Prefill) for chunk in body.chunks}
    assert feeds == ({0} if pipelined else {NO_FEED})
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model_dir = tmp_path / "phalanx" / "tiny-demo"
    assert (model_dir / "config.json").is_file()  # built on first use into the user's cache dir

    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt_ids = tokenizer.encode(prompt).ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=7, do_sample=False)
    expected = out[0, len(prompt_ids) :].tolist()
    eos = set(model.generation_config.eos_token_id)
    assert result["token_ids"] == expected
    assert result["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert result["finish_reason"] == ("stop" if expected[-1] in eos else "length")


def test_generate_refuses_a_prompt_over_the_context_before_launching(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = ",".join(["5"] * 2048)
    code = main(["generate", "--model", str(tiny_model_dir), "--prompt-ids", ids, "--max-tokens", "1"])
    assert code == 2
    assert (
        "prompt of 2048 tokens plus max_tokens 1 exceeds the model context of 2048 tokens"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers, got '1,x'"),
        (
            ["--prompt", b"ab\xffc".decode("utf-8", "surrogateescape")],  # as Python reads such argv bytes
            "--prompt is not UTF-8 text: its character 2 is a byte that decodes to nothing",
        ),
        (["--prompt-ids", "1", "--top-p", "1.5"], r"top_p must be in (0, 1], got 1.5"),
        (
            ["--prompt-ids", "1", "--max-tokens", "0"],
            "max_tokens must be an integer in [1, 2147483647], got 0",
        ),
    ],
)
def test_generate_refuses_bad_flags(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["generate", "--model", str(tiny_model_dir), *flags]) == 2
    assert message in capsys.readouterr().err


def test_launch_commands_name_what_is_wrong_with_the_model_directory(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing, a_file, empty = tmp_path / "missing", tmp_path / "weights.bin", tmp_path / "empty"
    a_file.write_bytes(b"")
    empty.mkdir()
    cases = [
        (missing, f"model directory {missing} does not exist"),
        (a_file, f"model path {a_file} is not a directory"),
        (empty, f"no tokenizer.json in model directory {empty}"),
    ]
    for model_dir, message in cases:
        assert main(["generate", "--model", str(model_dir), "--prompt", "hi"]) == 2
        assert f"phalanx generate: error: {message}" in capsys.readouterr().err
        assert main(["serve", "--model", str(model_dir)]) == 2
        assert f"phalanx serve: error: {message}" in capsys.readouterr().err
    assert model_dir_problem(tiny_model_dir) is None
