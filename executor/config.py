"""How to launch a replica: model, TP degree, device, limits, timeouts, transport."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.protocol.logs import level_number, renderer_for


@dataclass(frozen=True)
class ExecutorConfig:
    model_dir: str
    tp: int = 1
    device: str = "cpu"  # "cpu" (gloo, eager) or "cuda" (NCCL)
    dtype: str = ""  # "" picks float32 on CPU, bfloat16 on CUDA
    max_slots: int = 16  # 0 on CUDA: up to the largest graph bucket, as memory allows
    kv_pages: int = 512  # per rank, excluding the padding page; 0 on CUDA: as many as fit
    gpu_memory_utilization: float = 0.9  # CUDA: the fraction of each GPU's memory a rank may use
    page_size: int = 16
    max_batch_tokens: int = 2048
    step_timeout: float = 300.0
    startup_timeout: float = 120.0  # Ready from every rank, then dist init, then the first Ping
    dist_init_timeout: float = 60.0  # each rank's startup watchdog
    shutdown_timeout: float = 30.0
    cuda_graph: bool = False  # decode from per-bucket CUDA graphs (on CPU: eager static buffers)
    precapture_timeout: float = 600.0  # the decode graph pre-capture sweep's watchdog (aborts)
    transport: str = "ipc"  # "ipc" (private runtime dir) or "tcp"
    host: str = "127.0.0.1"  # tcp: the interface to bind
    port: int = 0  # tcp: 0 picks a free port
    attach: bool = False  # True: ranks are started elsewhere (torchrun) and connect over tcp
    heartbeat_timeout: float = 2.0  # attached ranks: silence longer than this means dead
    log_level: str = "info"
    log_format: str = "console"  # "console" or "json" (protocol.logs), for the coordinator and ranks
    record: str | None = None  # append every frame sent and received to this trace (phalanx replay)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be at least 1, got {self.tp}")
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {self.transport!r}")
        if self.attach and self.transport != "tcp":
            raise ValueError("attached ranks (started by torchrun/SLURM) need transport 'tcp'")
        for name in ("page_size", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_slots < 0 or (self.max_slots == 0 and self.device != "cuda"):
            raise ValueError(
                f"max_slots must be positive (0 means 'as many as fit' on cuda only), got {self.max_slots}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be above 0 and at most 1, got {self.gpu_memory_utilization:g}"
            )
        if self.kv_pages < 0 or (self.kv_pages == 0 and self.device != "cuda"):
            raise ValueError(
                f"kv_pages must be positive (0 means 'as many as fit' on cuda only), got {self.kv_pages}"
            )
        renderer_for(self.log_format)  # raises ValueError naming the formats
        level_number(self.log_level)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        for name in (
            "step_timeout",
            "startup_timeout",
            "dist_init_timeout",
            "shutdown_timeout",
            "precapture_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
