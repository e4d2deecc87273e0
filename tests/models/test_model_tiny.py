"""The tiny checkpoint builder: HF-loadable model and tokenizer, deterministic per seed."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from phalanx.models.tiny import SPECIAL_TOKENS, build_tiny_model
from phalanx.tools.cli import main as phalanx


def test_tokenizer_files(tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert raw.get_vocab_size() <= config["vocab_size"]
    ids = {token: raw.token_to_id(token) for token in SPECIAL_TOKENS}
    assert None not in ids.values()
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    encoded = tokenizer(text).input_ids
    assert encoded[0] == ids["<|im_start|>"] and encoded.count(ids["<|im_end|>"]) == 2
    assert tokenizer.decode(encoded) == text
    assert tokenizer.eos_token_id == ids["<|im_end|>"]
    assert raw.encode("<think>\nThe sea</think>").ids[0] == ids["<think>"]


def test_conventions_randomised(tiny_model_dir: Path) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")
    assert tensors["model.layers.0.input_layernorm.weight"].abs().min() > 0  # (1 + w) norm, init 0
    assert tensors["model.layers.1.self_attn.q_norm.weight"].std() > 0.1
    assert (tensors["model.layers.0.linear_attn.norm.weight"] != 1).all()  # plain w norm, init 1
    assert tensors["model.layers.2.linear_attn.dt_bias"].std() > 0.1
    assert tensors["model.layers.2.linear_attn.A_log"].std() > 0.1


def test_deterministic_per_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", tied=False, seed=0)
    other = build_tiny_model(tmp_path / "other", tied=False, seed=5)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_make_tiny_model_command(tmp_path: Path) -> None:
    assert phalanx(["make-tiny-model", str(tmp_path / "m"), "--tied", "--seed", "3"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(tmp_path / "m" / "model.safetensors")
