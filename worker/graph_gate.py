"""Whether decode can run as CUDA graphs on this device and model, and saying once when not."""

from __future__ import annotations

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger("phalanx.graphs")

_GATE_LOGGED: set[str] = set()


def graph_blocker(model: object, device: torch.device) -> str | None:
    """Why decode on this device and model cannot be captured, or None when it can."""
    if device.type != "cuda":
        return f"device {device.type} has no CUDA graphs"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if dist.is_initialized() and dist.get_world_size() > 1:
        backend = dist.get_backend()
        if backend != "nccl":
            return f"collectives over {backend} cannot be captured in a CUDA graph"
    # A model whose decode kernels cannot be captured for its geometry says why here.
    model_reason = getattr(model, "decode_graph_blocker", None)
    if callable(model_reason):
        reason = model_reason()
        if reason:
            return str(reason)
    return None


def log_gate_once(reason: str, rank: int) -> None:
    """Warn that decode stays eager, once per reason in this process."""
    if reason in _GATE_LOGGED:
        return
    _GATE_LOGGED.add(reason)
    log.warning("CUDA graph requested but decode stays eager on static buffers", reason=reason, rank=rank)
