"""Launch flags shared by ``phalanx serve`` and ``phalanx generate``: device, dtype, graphs and
memory, recording, attached ranks, the log flags, the checks both make before paying for a
launch, and the replica config they describe. Their defaults are the config tree's
(``phalanx.config.replica``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import structlog

from phalanx.config.replica import (
    LOG_FORMATS,
    LOG_LEVELS,
    RECURRENT_STATE_DTYPES,
    CacheConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    ReplicaConfig,
    SchedulingConfig,
    Timeouts,
    recurrent_state_dtype_for,
)
from phalanx.executor.model_info import ModelInfoError, read_model_info

log = structlog.get_logger("phalanx.launch")
T = TypeVar("T", int, float)

DEVICE_HELP = "where the ranks run: cuda (one GPU per rank, NCCL) or cpu (gloo)"
DTYPES = ("auto", "bfloat16", "float16", "float32")


def model_dir_problem(model_dir: str | Path) -> str | None:
    """What keeps ``model_dir`` from being served (no such directory, not a directory, no
    tokenizer.json), or None. The ranks check the checkpoint itself when they load it."""
    path = Path(model_dir)
    if not path.exists():
        return f"model directory {model_dir} does not exist"
    if not path.is_dir():
        return f"model path {model_dir} is not a directory"
    if not (path / "tokenizer.json").is_file():
        return f"no tokenizer.json in model directory {model_dir}"
    try:
        read_model_info(path)
    except (ModelInfoError, ValueError) as exc:
        return str(exc)
    return None


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """``--max-slots`` (with vLLM's name ``--max-num-seqs`` beside it), ``--page-size`` and
    ``--max-batch-tokens``: what one step holds, for serve and for a worker alike."""
    parser.add_argument(
        "--max-slots",
        "--max-num-seqs",
        dest="max_slots",
        type=positive_int,
        default=None,
        help=f"requests decoding at once (default: {SchedulingConfig.max_slots} on cpu; on cuda up to 256, "
        "the largest graph bucket, while their states take at most half of the cache memory)",
    )
    parser.add_argument("--page-size", type=int, default=CacheConfig.page_size, help="tokens per KV page")
    parser.add_argument(
        "--max-batch-tokens",
        "--max-num-batched-tokens",
        dest="max_batch_tokens",
        type=positive_int,
        default=SchedulingConfig.max_batch_tokens,
        help="prompt tokens of one prefill step (default: 8192 on a GPU of 70 GiB or more but an A100, "
        "else 2048, as vLLM's server picks)",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Device, dtype, graphs and memory: the flags vLLM users know, with the same meanings."""
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help=f"{DEVICE_HELP} (default: auto, cuda when torch sees a GPU, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights' and activations' dtype (default: auto, the checkpoint's 16-bit dtype on "
        "cuda, bfloat16 for a float32 checkpoint; float32 on cpu)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="decode eagerly (default on cuda: replay one CUDA graph per batch bucket)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=memory_fraction,
        default=CacheConfig.gpu_memory_utilization,
        metavar="F",
        help="fraction of each GPU's memory a rank may use; the KV cache gets what the weights, "
        f"activations and CUDA graphs leave (default: {CacheConfig.gpu_memory_utilization})",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="cap on prompt + output tokens (default: the checkpoint's max_position_embeddings, "
        "bounded by the KV cache)",
    )
    parser.add_argument(
        "--kv-pages",
        type=positive_int,
        default=None,
        help=f"KV pages per rank (default: {CacheConfig.kv_pages} on cpu; on cuda as many as memory allows)",
    )
    add_prefix_cache_arguments(parser)
    add_state_dtype_argument(parser)


def add_state_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """The linear-attention state's dtype, under vLLM's name for it."""
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        dest="recurrent_state_dtype",
        choices=("auto", *RECURRENT_STATE_DTYPES),
        default="auto",
        help="dtype of the Gated DeltaNet layers' recurrent state, stepped in float32 either way: "
        "bfloat16 halves its memory and its traffic at decode (default: auto, the model's: bfloat16 "
        "for a 16-bit model, float32 for a float32 one)",
    )


def state_dtype_setting(args: argparse.Namespace) -> str:
    """``--mamba-ssm-cache-dtype`` as the config holds it: "" for auto."""
    return "" if args.recurrent_state_dtype == "auto" else args.recurrent_state_dtype


def chosen_state_dtype(args: argparse.Namespace, model_dtype: str) -> str:
    """The recurrent state's dtype name that ``--mamba-ssm-cache-dtype`` picks for a model of ``model_dtype``."""
    return recurrent_state_dtype_for(state_dtype_setting(args), model_dtype)


def add_prefix_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """``--no-prefix-cache`` and ``--prefix-snapshots``, for serve and for a worker alike."""
    parser.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="prefill every prompt whole (default: requests that share a prompt prefix reuse its cached "
        "KV pages and linear-attention state)",
    )
    parser.add_argument(
        "--prefix-snapshots",
        type=positive_int,
        default=None,
        metavar="N",
        help="prefix-cache state snapshots per rank, each the size of a request's state (default: on cuda "
        "as many as a tenth of the cache memory holds, taken from the KV pages; 2 per slot on cpu)",
    )


def checked_number(text: str, convert: Callable[[str], T], valid: Callable[[T], bool], expected: str) -> T:
    """``text`` converted, or an argparse error ``must be EXPECTED, got 'TEXT'`` (the flags' types)."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def memory_fraction(text: str) -> float:
    """``--gpu-memory-utilization``: above 0, at most 1."""
    return checked_number(text, float, lambda value: 0 < value <= 1, "above 0 and at most 1")


def positive_int(text: str) -> int:
    return checked_number(text, int, lambda value: value >= 1, "a positive integer")


def positive_float(text: str) -> float:
    return checked_number(text, float, lambda value: 0 < value < math.inf, "a positive number")


@dataclass(frozen=True)
class LaunchChoice:
    """What the flags and the machine decide for a launch (see ``replica_config``)."""

    device: str
    dtype: str  # a torch dtype name
    cuda_graph: bool
    kv_pages: int  # 0 on cuda: as many as fit
    max_slots: int  # 0 on cuda: as many as memory and the graph buckets allow
    max_model_len: int  # 0: the checkpoint's
    gpu_memory_utilization: float
    prefix_cache: bool
    prefix_snapshots: int  # 0: sized by each rank
    recurrent_state_dtype: str


def choose_launch(args: argparse.Namespace, model_dir: Path, max_slots: int | None = None) -> LaunchChoice:
    """Resolve auto device and dtype, graphs and memory defaults; ValueError for a bad value
    (``--max-model-len`` above the checkpoint's context)."""
    info = read_model_info(model_dir)
    device = args.device if args.device != "auto" else detect_device()
    if args.max_model_len is not None and args.max_model_len > info.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {args.max_model_len} exceeds the checkpoint's context of "
            f"{info.max_position_embeddings} tokens (max_position_embeddings in {model_dir}/config.json)"
        )
    if args.prefix_snapshots is not None and not args.prefix_cache:
        raise ValueError("--prefix-snapshots sizes the prefix cache, which --no-prefix-cache turns off")
    cuda = device == "cuda"
    dtype = resolve_dtype(args.dtype, device, info.dtype)
    return LaunchChoice(
        device=device,
        dtype=dtype,
        cuda_graph=cuda and not args.enforce_eager,
        kv_pages=args.kv_pages if args.kv_pages is not None else (0 if cuda else CacheConfig.kv_pages),
        max_slots=max_slots if max_slots is not None else (0 if cuda else SchedulingConfig.max_slots),
        max_model_len=args.max_model_len or 0,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_cache=args.prefix_cache,
        prefix_snapshots=args.prefix_snapshots or 0,
        recurrent_state_dtype=chosen_state_dtype(args, dtype),
    )


def detect_device() -> str:
    """``--device auto``: cuda when torch sees a GPU, else cpu; the log says which and why."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        log.info("device auto: cuda", gpus=count, name=torch.cuda.get_device_name(0))
        return "cuda"
    reason = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU visible to torch"
    log.info("device auto: cpu", reason=reason)
    return "cpu"


def resolve_dtype(flag: str, device: str, checkpoint: str) -> str:
    """``--dtype auto``: the checkpoint's 16-bit dtype on cuda (bfloat16 for a float32 or unnamed
    one, as the Triton kernels are tuned for 16-bit weights); float32 on cpu, where the torch
    reference ops run."""
    if flag != "auto":
        return flag
    if device != "cuda":
        return "float32"
    return checkpoint if checkpoint in ("bfloat16", "float16") else "bfloat16"


def add_log_arguments(parser: argparse.ArgumentParser, level: bool = True) -> None:
    """``--log-format``, and ``--log-level`` unless the command has its own way to set it."""
    if level:
        parser.add_argument(
            "--log-level",
            choices=LOG_LEVELS,
            default=LogConfig.log_level,
            help="the lowest level logged, by the coordinator, every rank and the HTTP server",
        )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=LogConfig.log_format,
        help="console: one short aligned line per record; json: one JSON object per line (log shippers)",
    )


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record", help="append every protocol frame to this trace (see phalanx replay; default: none)"
    )
    parser.add_argument(
        "--no-pipeline",
        dest="pipeline",
        action="store_false",
        help="read each decode step's result before sending the next (default: the next step is "
        "sent first, so the GPU never waits for the round trip)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=Timeouts.startup_timeout,
        help="seconds the ranks may take to load, compile and profile before serving; a rank that "
        f"dies fails the start at once (default: {Timeouts.startup_timeout:g})",
    )
    parser.add_argument(
        "--attach",
        metavar="tcp://HOST:PORT",
        type=_attach_address,
        help="do not spawn ranks: bind here and wait for --tp ranks started elsewhere "
        "(torchrun/SLURM running `phalanx worker --coordinator tcp://HOST:PORT`); "
        "both sides need the same PHALANX_SECRET (default: spawn the ranks here)",
    )


def parse_attach_address(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); anything else is a ValueError naming the flag."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"--attach expects tcp://HOST:PORT, got {address!r}")
    return parts.hostname, port


def _attach_address(address: str) -> tuple[str, int]:
    try:
        return parse_attach_address(address)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def replica_config(
    args: argparse.Namespace, model_dir: Path, tp: int, choice: LaunchChoice, **fields: Any
) -> ReplicaConfig:
    """The replica these flags launch; ``fields`` are a command's own flags by their flat names
    (``page_size=...``). A ValueError names a value the config refuses (``tp`` below 1 …)."""
    attach = args.attach is not None
    host, port = args.attach if attach else (ParallelConfig.host, ParallelConfig.port)
    return ReplicaConfig(
        model=ModelConfig(str(model_dir), choice.dtype, choice.max_model_len, choice.cuda_graph),
        parallel=ParallelConfig(
            tp, choice.device, "tcp" if attach else ParallelConfig.transport, host, port, attach
        ),
        cache=CacheConfig(
            kv_pages=choice.kv_pages,
            gpu_memory_utilization=choice.gpu_memory_utilization,
            prefix_cache=choice.prefix_cache,
            prefix_snapshots=choice.prefix_snapshots,
            recurrent_state_dtype=choice.recurrent_state_dtype,
        ),
        scheduling=SchedulingConfig(max_slots=choice.max_slots, pipeline=args.pipeline),
        log=LogConfig(args.log_level, args.log_format, args.record),
        startup_timeout=args.startup_timeout,
        **fields,
    )
