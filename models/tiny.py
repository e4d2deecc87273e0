"""A tiny random Qwen3.5 checkpoint plus a tiny tokenizer, so tests and the demo need no download.

The model is built by transformers itself (``Qwen3_5ForCausalLM``) and saved with
``save_pretrained``, so the files carry exactly the Hugging Face names and layout. Norm weights,
``dt_bias`` and ``A_log`` are randomised: with their default initial values a wrong convention
((1 + w) vs w, exp vs log decay) would go unnoticed. The geometry divides by TP 1, 2 and 4 and has
GDN value heads != key heads, mixed layer types and KV heads that are replicated at TP 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
TOKENIZER_VOCAB = 384  # byte alphabet + merges + specials
MODEL_VOCAB = 512  # padded beyond the tokenizer, like the real checkpoints (divisible by 4)
# Shared with `phalanx bench decode --geometry tiny`.
TINY_GEOMETRY: dict[str, int] = dict(
    vocab_size=MODEL_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)

CHAT_TEMPLATE = (
    # tools as Qwen offers them: a system turn listing each tool's JSON inside <tools>
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one inside <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Small English corpus for the byte-level BPE: enough text for a few hundred merges.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A tensor parallel runtime splits every layer of a
language model across several devices, and each device keeps only its own slice of the weights.
Once upon a time there was a small model that lived on a laptop. It answered questions about the
weather, the sea, the mountains and the stars. People asked it what the capital of France is, and
it said Paris. They asked it to count to ten: one, two, three, four, five, six, seven, eight, nine,
ten. The model liked numbers and stories, and it liked to think before it answered.
Hello! How are you today? I am fine, thank you. What would you like to talk about? Let us talk
about the history of computing, about machines that learn, and about the people who build them.
In the beginning, computers were large rooms full of wires. Later they became small enough to fit
in a pocket. Today, a single graphics card can run a model with billions of parameters, and many
cards together can serve thousands of users at the same time. The scheduler decides which request
runs next, the workers run the model, and the coordinator collects the answers.
Water boils at one hundred degrees. The sun rises in the east and sets in the west. Cats and dogs
are common pets. Rivers flow into the sea. Trees grow from small seeds into tall forests.
"""


def build_tiny_model(out_dir: str | Path, *, tied: bool, seed: int = 0) -> Path:
    """Write config, generation config, safetensors weights and tokenizer files into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_ids = _write_tokenizer(out)
    _write_model(out, tied=tied, seed=seed, eos_ids=tokenizer_ids)
    return out


def tiny_text_config(*, tied: bool, eos_ids: list[int] | None = None):  # -> Qwen3_5TextConfig
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **TINY_GEOMETRY,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        tie_word_embeddings=tied,
        max_position_embeddings=2048,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        eos_token_id=eos_ids,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )


def _write_model(out: Path, *, tied: bool, seed: int, eos_ids: list[int]) -> None:
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    config = tiny_text_config(tied=tied, eos_ids=eos_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config).eval()
        _randomise_conventions(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_ids, do_sample=False).save_pretrained(out)


@torch.no_grad()
def _randomise_conventions(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Move weights away from their initial values so that a wrong convention changes the logits."""

    def uniform(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
        return torch.rand(t.shape, generator=gen, dtype=torch.float32) * (high - low) + low

    for name, param in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):  # plain w, initialised to 1
            param.copy_(uniform(param, 0.5, 1.5))
        elif name.endswith("norm.weight"):  # (1 + w) norms, initialised to 0
            param.copy_(uniform(param, -0.5, 0.5))
        elif name.endswith("dt_bias"):
            param.copy_(uniform(param, -1.0, 1.0))
        elif name.endswith("A_log"):
            param.copy_(uniform(param, -2.0, 1.5))


def _write_tokenizer(out: Path) -> list[int]:
    """Train a byte-level BPE on the embedded corpus; return the eos ids [<|im_end|>, <|endoftext|>]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS], trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))

    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "special": token not in ("<think>", "</think>"),
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for token, token_id in special_ids.items()
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]]
