"""What launches a replica, as one typed tree: each default is written here once, and the command
line, the engine, the executor and the launch contract handed to every rank all read it.

``ReplicaConfig(model=ModelConfig("m"), parallel=ParallelConfig(tp=2))`` builds the tree section by
section; ``ReplicaConfig(model_dir="m", tp=2)`` names fields flat and each lands in its section
(field names are unique across sections), and ``config.tp`` reads ``config.parallel.tp``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEVICES = ("cpu", "cuda")
TRANSPORTS = ("ipc", "tcp")
LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
RECURRENT_STATE_DTYPES = ("float32", "bfloat16")


def recurrent_state_dtype_for(setting: str, model_dtype: str) -> str:
    """The linear-attention state's dtype: ``setting``, or for "" the model's (bfloat16 for a 16-bit
    model, as vLLM's ``auto``). A bf16 state halves the traffic of a large decode batch's largest
    read and keeps the golden tolerances (docs/benchmarks/decode-h200.md); it is stepped in fp32."""
    return setting or ("float32" if model_dtype == "float32" else "bfloat16")


_AS_MANY_AS_FIT = "{name} must be positive (0 means 'as many as fit' on cuda only), got {value}"


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    """ValueError ``WHAT must be one of A, B, got 'VALUE'`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}")


def _check_positive(section: object, *names: str) -> None:
    for name in names:
        if getattr(section, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(section, name)}")


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str  # a Hugging Face layout directory (a Path is kept as its text)
    dtype: str = ""  # a torch dtype name; "" picks float32 on cpu, bfloat16 on cuda
    max_model_len: int = 0  # prompt + output tokens at most; 0: the checkpoint's max_position_embeddings
    cuda_graph: bool = False  # decode from per-bucket CUDA graphs (on cpu: eager static buffers)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", str(self.model_dir))
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be 0 (the checkpoint's) or more, got {self.max_model_len}")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # ranks, one GPU each on cuda
    device: str = "cpu"  # "cpu" (gloo, torch reference ops) or "cuda" (NCCL, Triton)
    transport: str = "ipc"  # "ipc" (a private runtime directory) or "tcp"
    host: str = "127.0.0.1"  # tcp: the interface the coordinator binds
    port: int = 0  # tcp: 0 picks a free port
    attach: bool = False  # ranks are started elsewhere (torchrun, SLURM) and connect over tcp

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be at least 1, got {self.tp}")
        _check_choice("device", self.device, DEVICES)
        _check_choice("transport", self.transport, TRANSPORTS)
        if self.attach and self.transport != "tcp":
            raise ValueError("attached ranks (started by torchrun/SLURM) need transport 'tcp'")


@dataclass(frozen=True)
class CacheConfig:
    kv_pages: int = 512  # per rank, besides the padding page; 0 on cuda: as many as fit
    page_size: int = 16  # tokens per KV page
    gpu_memory_utilization: float = 0.9  # cuda: the fraction of each GPU's memory a rank may use
    prefix_cache: bool = True  # reuse the KV pages and linear-attention state of cached prompt prefixes
    prefix_snapshots: int = 0  # state snapshots per rank; 0: sized by the rank (phalanx.worker.capacity)
    recurrent_state_dtype: str = ""  # the linear-attention state's; "": as recurrent_state_dtype_for picks

    def __post_init__(self) -> None:
        _check_positive(self, "page_size")
        if self.recurrent_state_dtype:
            _check_choice("recurrent_state_dtype", self.recurrent_state_dtype, RECURRENT_STATE_DTYPES)
        if self.kv_pages < 0:
            raise ValueError(_AS_MANY_AS_FIT.format(name="kv_pages", value=self.kv_pages))
        if self.prefix_snapshots < 0:
            raise ValueError(
                f"prefix_snapshots must be 0 (sized by each rank) or more, got {self.prefix_snapshots}"
            )
        if self.prefix_snapshots and not self.prefix_cache:
            raise ValueError(f"prefix_snapshots {self.prefix_snapshots} given with the prefix cache off")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be above 0 and at most 1, got {self.gpu_memory_utilization:g}"
            )


@dataclass(frozen=True)
class SchedulingConfig:
    max_slots: int = 16  # requests decoding at once; 0 on cuda: up to the largest graph bucket that fits
    # prompt tokens of one prefill step; 0: as the rank picks (phalanx.worker.capacity.batch_tokens_for)
    max_batch_tokens: int = 0
    pipeline: bool = True  # send each decode step before reading the last one's result
    prefix_snapshot_interval: int = 1024  # prompt tokens between prefix-cache state snapshots (whole pages)

    def __post_init__(self) -> None:
        _check_positive(self, "prefix_snapshot_interval")
        if self.max_batch_tokens < 0:
            raise ValueError(
                f"max_batch_tokens must be 0 (picked by each rank) or more, got {self.max_batch_tokens}"
            )
        if self.max_slots < 0:
            raise ValueError(_AS_MANY_AS_FIT.format(name="max_slots", value=self.max_slots))


@dataclass(frozen=True)
class Timeouts:
    """Seconds. The spawned ranks' side of the startup and the attached ranks' liveness too."""

    step_timeout: float = 300.0  # one step's replies from every rank
    # Ready from every rank, then dist init, then the first Ping. A fresh machine compiles and
    # autotunes every kernel of the memory profile before Ready (over 120 s for a 4B-wide model on
    # an H200) and a large checkpoint may load from a slow disk; a rank that dies is caught at once
    # by its exit, so this bounds only a hung one (vLLM waits 600 s for its engine core too).
    startup_timeout: float = 600.0
    dist_init_timeout: float = 60.0  # each rank's startup watchdog (it aborts the rank)
    precapture_timeout: float = 600.0  # the decode graph pre-capture sweep's watchdog
    shutdown_timeout: float = 30.0  # Shutdown's acknowledgements, then every rank is killed
    idle_ping_interval: float = 5.0  # an idle engine pings the ranks this often, to notice a dead one
    heartbeat_timeout: float = 2.0  # attached ranks: silence longer than this means dead
    heartbeat_interval: float = 0.5  # attached ranks: how often they send a heartbeat
    gate_timeout: float = 600.0  # attached ranks: how long they wait for Go or Cancel
    coordinator_grace: float = 10.0  # a rank exits after this long without its coordinator

    def __post_init__(self) -> None:
        _check_positive(self, *(f.name for f in dataclasses.fields(self)))


@dataclass(frozen=True)
class LogConfig:
    log_level: str = "info"  # the lowest level the coordinator and every rank log
    log_format: str = "console"  # "console" or "json" (protocol.logs)
    record: str | None = None  # append every frame sent and received to this trace (phalanx replay)

    def __post_init__(self) -> None:
        _check_choice("log format", self.log_format, LOG_FORMATS)
        _check_choice("log level", self.log_level, LOG_LEVELS)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "cache": CacheConfig,
    "scheduling": SchedulingConfig,
    "timeouts": Timeouts,
    "log": LogConfig,
}
# Every field's section, by the field's flat name (unique: checked here, at import).
SECTION_OF: dict[str, str] = {
    f.name: section for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)
}
if len(SECTION_OF) != sum(len(dataclasses.fields(kind)) for kind in SECTIONS.values()):
    raise TypeError("a field name appears in two sections of ReplicaConfig")


@dataclass(frozen=True, init=False)
class ReplicaConfig:
    """The root: one replica's model, parallelism, cache, scheduling, timeouts and logs."""

    model: ModelConfig
    parallel: ParallelConfig
    cache: CacheConfig
    scheduling: SchedulingConfig
    timeouts: Timeouts
    log: LogConfig

    def __init__(self, **given: Any) -> None:
        """Sections by name (``parallel=ParallelConfig(tp=2)``), fields by their flat names
        (``tp=2``), or both: a flat field overrides its section's value."""
        flat: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, value in given.items():
            if name not in SECTIONS:
                if name not in SECTION_OF:
                    raise TypeError(f"ReplicaConfig has no field {name!r}")
                flat[SECTION_OF[name]][name] = value
        for section, kind in SECTIONS.items():
            base = given.get(section)
            value = kind(**flat[section]) if base is None else dataclasses.replace(base, **flat[section])
            object.__setattr__(self, section, value)
        self._check_across_sections()

    def __getattr__(self, name: str) -> Any:
        """A field by its flat name: ``config.step_timeout`` is ``config.timeouts.step_timeout``."""
        section = SECTION_OF.get(name)
        if section is None:
            raise AttributeError(f"ReplicaConfig has no field {name!r}")
        return getattr(getattr(self, section), name)

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name (what a trace records as its launch settings)."""
        return {name: getattr(getattr(self, section), name) for name, section in SECTION_OF.items()}

    def _check_across_sections(self) -> None:
        """0 means "as many as fit", which only cuda measures."""
        if self.parallel.device == "cuda":
            return
        for name, value in (("max_slots", self.scheduling.max_slots), ("kv_pages", self.cache.kv_pages)):
            if value == 0:
                raise ValueError(_AS_MANY_AS_FIT.format(name=name, value=value))
