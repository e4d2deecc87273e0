"""``tools/host_info.py``: the host line a benchmark prints names the CPU and a measured cost."""

from __future__ import annotations

import re

import torch

from phalanx.tools import host_info


def test_host_line_names_the_cpu_cores_and_a_measured_allocation_cost() -> None:
    line = host_info.host_line(torch.device("cpu"))
    match = re.fullmatch(r"host: (.+), (\d+) cores; torch\.empty on cpu (\d+\.\d\d) µs a call", line)
    assert match, line
    assert match.group(1) == host_info.cpu_model() and match.group(1).strip()
    assert int(match.group(2)) == host_info.usable_cores() >= 1
    assert float(match.group(3)) > 0


def test_cpu_model_falls_back_when_proc_cpuinfo_is_missing(monkeypatch) -> None:
    def missing(*args, **kwargs):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr("builtins.open", missing)
    monkeypatch.setattr(host_info.platform, "processor", lambda: "")
    monkeypatch.setattr(host_info.platform, "machine", lambda: "x86_64")
    assert host_info.cpu_model() == "x86_64"
