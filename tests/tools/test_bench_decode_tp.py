"""``phalanx bench decode --tp``'s multi-rank path on CPU (gloo): the shards are slices of one global
random model, and two spawned ranks produce the table, the ratios and TP 1's logits."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from phalanx.models.qwen35 import Qwen35Config
from phalanx.models.qwen35.sharding import RankLayout
from phalanx.tools.bench import decode as bench_decode
from phalanx.tools.bench.random_model import sharded_random_weights

CPU = torch.device("cpu")


def _shards(world_size: int) -> list[dict[str, torch.Tensor]]:
    config = Qwen35Config.from_dicts(bench_decode.config_dict("tiny"), source="geometry tiny")
    return [
        sharded_random_weights(config, RankLayout.build(config, rank, world_size), CPU, torch.float32, 5)
        for rank in range(world_size)
    ]


def test_tp2_shards_are_the_slices_of_the_tp1_tensors() -> None:
    (whole,), halves = _shards(1), _shards(2)
    assert whole.keys() == halves[0].keys() == halves[1].keys()
    for key, dim in [
        ("embed_tokens.weight", 0),
        ("lm_head.weight", 0),
        ("layers.0.mlp.down_proj.weight", 1),
        ("layers.3.self_attn.o_proj.weight", 1),
        ("layers.0.linear_attn.out_proj.weight", 1),
        ("layers.0.linear_attn.A_log", 0),
    ]:
        joined = torch.cat([halves[0][key], halves[1][key]], dim=dim)
        assert torch.equal(joined, whole[key]), f"{key}: TP 2 shards joined along dim {dim} != TP 1 tensor"
    for key in ("norm.weight", "layers.1.input_layernorm.weight", "layers.0.linear_attn.norm.weight"):
        assert torch.equal(halves[1][key], whole[key]), f"{key}: a replicated tensor differs at TP 2"
    # Fused gate|up: each rank's rows are its gate slice then its up slice of the same global tensors.
    inter = whole["layers.0.mlp.down_proj.weight"].shape[1]
    gate, up = whole["layers.0.mlp.gate_up_proj.weight"].split(inter)
    rank1 = halves[1]["layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(rank1, torch.cat([gate[inter // 2 :], up[inter // 2 :]])), "rank 1's fused gate|up"


def test_warmup_steps_are_zero_or_more() -> None:
    assert bench_decode.warmup_steps("0") == 0 and bench_decode.warmup_steps("30") == 30
    with pytest.raises(argparse.ArgumentTypeError, match="must be 0 or more steps, got -1"):
        bench_decode.warmup_steps("-1")
    with pytest.raises(argparse.ArgumentTypeError, match="must be an integer, got 'many'"):
        bench_decode.warmup_steps("many")


def test_prefill_length_is_zero_or_a_prompt_length() -> None:
    assert bench_decode.prefill_length("0") == 0 and bench_decode.prefill_length("4096") == 4096
    with pytest.raises(
        argparse.ArgumentTypeError, match="must be 0 \\(no prefill figure\\) or a prompt length, got -1"
    ):
        bench_decode.prefill_length("-1")
    with pytest.raises(argparse.ArgumentTypeError, match="must be an integer"):
        bench_decode.prefill_length("long")


def test_two_gloo_ranks_print_the_table_and_match_tp1_logits(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench_decode.add_arguments(parser)
    out = tmp_path / "tp.json"
    args = parser.parse_args(
        [
            "--geometry",
            "tiny",
            "--tp",
            "1,2",
            "--device",
            "cpu",
            "--batch",
            "1,3",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--context",
            "8",
            "--cuda-graph",
            "--json",
        ]
        + [str(out)]
    )
    assert bench_decode.run(args) == 0
    printed = capfd.readouterr().out
    assert "| geometry | tp | mode | batch | step ms | tokens/s |" in printed, printed
    for tp in (1, 2):
        for mode in ("eager", "static-eager"):
            for batch in (1, 3):
                assert f"| tiny | {tp} | {mode} | {batch} | " in printed, f"no row for tp {tp} {mode} {batch}"
    assert "TP 2 / TP 1 step time at batch 1 (eager): " in printed
    report = json.loads(out.read_text())
    kernels = bench_decode.kernel_settings()  # the ranks inherit this process's PHALANX_* settings
    assert kernels.startswith("PDL off, linears ") and report["kernels"] == kernels
    assert f", cpu, {kernels}" in printed
    assert {(r["tp"], r["mode"], r["batch"]) for r in report["rows"]} == {
        (tp, mode, batch) for tp in (1, 2) for mode in ("eager", "static-eager") for batch in (1, 3)
    }
    check = report["logits_vs_tp1"]["2"]
    # fp32 on CPU: TP 2 sums the same products in another order, nothing more.
    assert check["relative_norm_error"] < 1e-5, f"TP 2 logits differ from TP 1: {check}"
    assert check["top1_agreement"] == 1.0, f"TP 2 greedy token differs from TP 1: {check}"
    assert set(report["sweep_s"]) == {"1", "2"} and all(s is not None for s in report["sweep_s"].values())


def test_graph_table_sets_the_graph_alone_and_the_pipelined_step_beside_the_served_step() -> None:
    from phalanx.tools.bench.decode_graph import graph_table
    from phalanx.tools.bench.measure import Row

    graph = [
        Row(1, 2.42, 413.2, 0.808, graph_alone_ms=2.401, pipelined_ms=2.3925),
        Row(64, 5.2, 12307.7, 0.376, graph_alone_ms=5.05, pipelined_ms=5.1),
    ]
    eager = [Row(1, 7.5, 133.3, 0.26), Row(64, 13.0, 4923.1, 0.15)]
    table = graph_table(graph, eager).splitlines()
    assert table[0] == (
        "| batch | step ms | graph alone ms | pipelined ms | tokens/s | weight bytes / step time (of 4.3 TB/s) "
        "| vs eager |"
    )
    assert table[2] == "| 1 | 2.420 | 2.401 | 2.393 | 413 | 80.8% | 3.10x |"
    assert table[3] == "| 64 | 5.200 | 5.050 | 5.100 | 12308 | 37.6% | 2.50x |"


def test_the_pipelined_figure_is_built_from_the_gaps_between_reads() -> None:
    from phalanx.tools.bench.decode_graph import gaps_ms

    assert gaps_ms([1.0, 1.0024, 1.0049, 1.0300]) == pytest.approx([2.4, 2.5, 25.1])
    with pytest.raises(ValueError, match="pipelined figure: 1 timestamps make no gap between steps"):
        gaps_ms([1.0])
