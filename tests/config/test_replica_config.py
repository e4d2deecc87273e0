"""The replica's config tree and the PHALANX_* settings: flat and nested construction agree, every
refusal names the field or variable and what it allows, the wire's launch contract is filled from
the tree, and the command line's defaults are the tree's."""

from __future__ import annotations

import pytest

from phalanx.config import settings
from phalanx.config.replica import (
    SECTION_OF,
    CacheConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    ReplicaConfig,
    SchedulingConfig,
    Timeouts,
    recurrent_state_dtype_for,
)
from phalanx.protocol.launch import decode_config, encode_config, rank_config
from phalanx.tools.cli import command_parser
from phalanx.tools.launch_options import state_dtype_setting


def test_flat_fields_land_in_their_sections_and_read_back_flat() -> None:
    flat = ReplicaConfig(model_dir="m", tp=2, kv_pages=64, step_timeout=9.0, log_format="json")
    nested = ReplicaConfig(
        model=ModelConfig("m"),
        parallel=ParallelConfig(tp=2),
        cache=CacheConfig(kv_pages=64),
        timeouts=Timeouts(step_timeout=9.0),
        log=LogConfig(log_format="json"),
    )
    assert flat == nested
    assert (flat.parallel.tp, flat.tp, flat.cache.kv_pages, flat.step_timeout) == (2, 2, 64, 9.0)
    assert flat.scheduling == SchedulingConfig()  # untouched sections keep the tree's defaults
    # a flat field overrides its section's value
    assert ReplicaConfig(model=ModelConfig("m"), parallel=ParallelConfig(tp=4), tp=2).parallel.tp == 2
    assert set(flat.flat()) == set(SECTION_OF) and flat.flat()["model_dir"] == "m"


def test_unknown_fields_and_bad_values_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="ReplicaConfig has no field 'executor_options'"):
        ReplicaConfig(model_dir="m", executor_options={})
    with pytest.raises(AttributeError, match="ReplicaConfig has no field 'nope'"):
        _ = ReplicaConfig(model_dir="m").nope
    refusals = [
        ({"tp": 0}, "tp must be at least 1, got 0"),
        ({"device": "tpu"}, "device must be one of cpu, cuda, got 'tpu'"),
        ({"transport": "udp"}, "transport must be one of ipc, tcp, got 'udp'"),
        ({"attach": True}, "attached ranks (started by torchrun/SLURM) need transport 'tcp'"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be above 0 and at most 1, got 1.5"),
        ({"page_size": 0}, "page_size must be positive, got 0"),
        ({"max_slots": 0}, "max_slots must be positive (0 means 'as many as fit' on cuda only), got 0"),
        ({"kv_pages": 0}, "kv_pages must be positive (0 means 'as many as fit' on cuda only), got 0"),
        ({"step_timeout": 0.0}, "step_timeout must be positive, got 0.0"),
        ({"log_level": "loud"}, "log level must be one of debug, info, warning, error, got 'loud'"),
        ({"prefix_snapshots": -1}, "prefix_snapshots must be 0 (sized by each rank) or more, got -1"),
        ({"max_batch_tokens": -1}, "max_batch_tokens must be 0 (picked by each rank) or more, got -1"),
        (
            {"recurrent_state_dtype": "float16"},
            "recurrent_state_dtype must be one of float32, bfloat16, got 'float16'",
        ),
        (
            {"prefix_cache": False, "prefix_snapshots": 8},
            "prefix_snapshots 8 given with the prefix cache off",
        ),
    ]
    for fields, message in refusals:
        with pytest.raises(ValueError) as refused:
            ReplicaConfig(model_dir="m", **fields)
        assert str(refused.value) == message, fields
    assert ReplicaConfig(model_dir="m", device="cuda", kv_pages=0, max_slots=0).cache.kv_pages == 0


def test_the_launch_contract_is_filled_from_the_tree() -> None:
    spawned = ReplicaConfig(model_dir="m", tp=2, kv_pages=64, startup_timeout=50.0, cuda_graph=True)
    contract = decode_config(encode_config(rank_config(spawned, 1, 1, "ipc:///x", 7, b"\x01" * 32)))
    assert (contract.rank, contract.world_size, contract.epoch, contract.auth_key) == (1, 2, 7, "01" * 32)
    assert (contract.limits.kv_pages, contract.limits.page_size, contract.cuda_graph) == (64, 16, True)
    assert (contract.gate_timeout, contract.heartbeat_interval) == (50.0, 0.0)  # no heartbeats when spawned
    assert (contract.limits.prefix_cache, contract.limits.prefix_snapshots) == (True, 0)
    off = rank_config(ReplicaConfig(model_dir="m", prefix_cache=False), 0, 0, "ipc:///x", 7, None)
    given = rank_config(ReplicaConfig(model_dir="m", prefix_snapshots=5), 0, 0, "ipc:///x", 7, None)
    assert (off.limits.prefix_cache, given.limits.prefix_snapshots) == (False, 5)
    assert off.limits.recurrent_state_dtype == ""  # the model's: each rank resolves it
    bf16 = rank_config(
        ReplicaConfig(model_dir="m", recurrent_state_dtype="bfloat16"), 0, 0, "ipc:///x", 7, None
    )
    assert decode_config(encode_config(bf16)).limits.recurrent_state_dtype == "bfloat16"
    attached = ReplicaConfig(model_dir="m", transport="tcp", attach=True)
    contract = rank_config(attached, 0, 0, "tcp://h:1", 0, None)
    assert (contract.gate_timeout, contract.heartbeat_interval) == (
        Timeouts.gate_timeout,
        Timeouts.heartbeat_interval,
    )
    assert contract.auth_key == ""


def test_the_command_line_defaults_are_the_tree_s() -> None:
    serve = command_parser("serve").parse_args([])
    assert (serve.page_size, serve.max_batch_tokens, serve.step_timeout) == (
        CacheConfig.page_size,
        SchedulingConfig.max_batch_tokens,
        Timeouts.step_timeout,
    )
    assert serve.gpu_memory_utilization == CacheConfig.gpu_memory_utilization
    assert (serve.prefix_cache, serve.prefix_snapshots) == (CacheConfig.prefix_cache, None)
    worker = command_parser("worker").parse_args(["--model", "m"])
    assert (worker.prefix_cache, worker.prefix_snapshots) == (CacheConfig.prefix_cache, None)
    off = command_parser("worker").parse_args(["--model", "m", "--no-prefix-cache"])
    assert off.prefix_cache is False
    assert serve.recurrent_state_dtype == worker.recurrent_state_dtype == "auto"
    assert state_dtype_setting(serve) == CacheConfig.recurrent_state_dtype == ""
    assert [recurrent_state_dtype_for("", dtype) for dtype in ("float32", "bfloat16", "float16")] == [
        "float32",
        "bfloat16",
        "bfloat16",
    ]
    assert recurrent_state_dtype_for("float32", "bfloat16") == "float32"
    bf16 = command_parser("serve").parse_args(["--mamba-ssm-cache-dtype", "bfloat16"])
    assert bf16.recurrent_state_dtype == "bfloat16"
    assert (worker.dist_init_timeout, worker.gate_timeout, worker.coordinator_grace) == (
        Timeouts.dist_init_timeout,
        Timeouts.gate_timeout,
        Timeouts.coordinator_grace,
    )


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PHALANX_LINEAR", "magma", "PHALANX_LINEAR='magma' is not one of auto, cublas, triton"),
        ("PHALANX_GDN", "both", "PHALANX_GDN='both' is not one of split, fused"),
        ("PHALANX_PDL", "off", "PHALANX_PDL='off' is not one of 1, 0"),
        ("PHALANX_ALL_REDUCE", "mpi", "PHALANX_ALL_REDUCE='mpi' is not one of auto, nccl"),
        (
            "PHALANX_COMPILE_WORKERS",
            "many",
            "PHALANX_COMPILE_WORKERS='many' is not a whole number of 0 or more",
        ),
    ],
)
def test_a_setting_outside_its_values_names_the_variable_and_the_values(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    readers = {
        "PHALANX_LINEAR": settings.linear_backend,
        "PHALANX_GDN": settings.gdn_path,
        "PHALANX_PDL": settings.pdl_allowed,
        "PHALANX_ALL_REDUCE": settings.all_reduce_path,
        "PHALANX_COMPILE_WORKERS": settings.compile_workers,
    }
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as refused:
        readers[name]()
    assert str(refused.value) == message


def test_settings_defaults_and_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "PHALANX_LINEAR",
        "PHALANX_GDN",
        "PHALANX_PDL",
        "PHALANX_ALL_REDUCE",
        "PHALANX_COMPILE_WORKERS",
    ):
        monkeypatch.delenv(name, raising=False)
    assert (settings.linear_backend(), settings.gdn_path(), settings.pdl_allowed()) == ("auto", "split", True)
    assert (settings.all_reduce_path(), settings.compile_workers()) == ("auto", None)
    monkeypatch.setenv("PHALANX_LINEAR", " Triton ")
    monkeypatch.setenv("PHALANX_PDL", "0")
    monkeypatch.setenv("PHALANX_COMPILE_WORKERS", "0")
    assert (settings.linear_backend(), settings.pdl_allowed(), settings.compile_workers()) == (
        "triton",
        False,
        0,
    )
