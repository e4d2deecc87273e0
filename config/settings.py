"""Every ``PHALANX_*`` environment variable phalanx reads, read here and nowhere else.

A value outside the allowed ones is a ValueError naming the variable and what it allows. Each
reader reads the environment when called; the caller decides when (``kernels/ops.py`` picks its
linears once, at import, so a change after import has no effect there).

========================  ====================  ==============================================================
variable                  values (default)      what it does
========================  ====================  ==============================================================
PHALANX_LINEAR            auto|cublas|triton    decode linears on cuda: ``auto`` races the tuned Triton
                          (auto)                kernel against cuBLAS per shape (up to 64 rows, cuBLAS
                                                above); the others force one side. Read at import.
PHALANX_GDN               split|fused (split)   the Gated DeltaNet decode step: conv kernel then delta
                                                rule (``split``), or the conv inside it (``fused``).
                                                Read at import.
PHALANX_PDL               1|0 (1)               ``0`` turns off programmatic dependent launch (Hopper and
                                                later). Read at the first launch.
PHALANX_ALL_REDUCE        auto|nccl (auto)      ``nccl`` turns off the symmetric-memory one-shot
                                                all-reduce TP uses for small messages. Read at load.
PHALANX_COMPILE_WORKERS   N >= 0 (a share of    kernel compile processes per rank in the warm-up; ``0``
                          the cores, <= 16)     compiles serially. Read at the warm-up.
PHALANX_SECRET            16+ bytes (none)      the shared secret of ranks started elsewhere (``--attach``,
                                                ``phalanx worker``): the TCP control plane's key.
PHALANX_COORDINATOR       tcp://HOST:PORT       ``phalanx worker``'s default ``--coordinator``.
PHALANX_API_KEY           a key (none)          ``phalanx serve``'s default ``--api-key``.
PHALANX_TEST_FAULT        a fault list (none)   test-only fault injection in the ranks
                                                (``worker/faults.py``, docs/debugging.md). Never in production.
========================  ====================  ==============================================================
"""

from __future__ import annotations

import os

LINEAR = "PHALANX_LINEAR"
GDN = "PHALANX_GDN"
PDL = "PHALANX_PDL"
ALL_REDUCE = "PHALANX_ALL_REDUCE"
COMPILE_WORKERS = "PHALANX_COMPILE_WORKERS"
SECRET = "PHALANX_SECRET"
COORDINATOR = "PHALANX_COORDINATOR"
API_KEY = "PHALANX_API_KEY"
TEST_FAULT = "PHALANX_TEST_FAULT"

LINEAR_BACKENDS = ("auto", "cublas", "triton")
GDN_PATHS = ("split", "fused")
ALL_REDUCE_PATHS = ("auto", "nccl")
SECRET_MIN_BYTES = 16


def _text(name: str) -> str:
    return os.environ.get(name, "").strip()


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """The variable's value, lower case, or the first choice when unset or empty."""
    value = _text(name).lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def linear_backend() -> str:
    return _choice(LINEAR, LINEAR_BACKENDS)


def gdn_path() -> str:
    return _choice(GDN, GDN_PATHS)


def pdl_allowed() -> bool:
    return _choice(PDL, ("1", "0")) == "1"


def all_reduce_path() -> str:
    return _choice(ALL_REDUCE, ALL_REDUCE_PATHS)


def compile_workers() -> int | None:
    """The configured compile workers per rank, or None (unset: the caller's share of the cores)."""
    text = _text(COMPILE_WORKERS)
    if not text:
        return None
    try:
        workers = int(text)
    except ValueError:
        workers = -1
    if workers < 0:
        raise ValueError(f"{COMPILE_WORKERS}={text!r} is not a whole number of 0 or more")
    return workers


def shared_secret() -> bytes:
    """``PHALANX_SECRET``, required by a TCP control plane with ranks started elsewhere."""
    secret = os.environ.get(SECRET, "").encode()
    if len(secret) < SECRET_MIN_BYTES:
        raise ValueError(
            f"the TCP control plane with ranks started elsewhere needs a shared secret: set {SECRET} "
            f"(at least {SECRET_MIN_BYTES} bytes) for the coordinator and every rank"
        )
    return secret


def coordinator_address() -> str | None:
    return _text(COORDINATOR) or None


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def injected_faults() -> str:
    """The test-only fault list, "" when unset (parsed and checked by ``worker.faults``)."""
    return os.environ.get(TEST_FAULT, "")
