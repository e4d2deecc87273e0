"""Run a test module's Triton checks in a child process under ``TRITON_INTERPRET=1``.

The interpreter must be switched on before triton is first imported, and pytest's process has
imported it already, so each kernel test module re-runs itself as a child (``python <module>``)
that prints one JSON line per check; the parent's fixture collects them by name. The session
starts those children in the background as soon as collection ends (``start_ahead``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def report(checks: dict[str, Callable[[], dict[str, float]]], seed: int = 0) -> None:
    """Child side: run every check (each from the same seed), one JSON record per line."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (pytest does this)")
    sys.path.insert(0, str(ROOT))
    for name, check in checks.items():
        torch.manual_seed(seed)
        try:
            record: dict[str, object] = {"name": name, "errors": check()}
        except Exception:
            record = {"name": name, "exception": traceback.format_exc()}
        print(json.dumps(record), flush=True)


# Children started ahead (``start_ahead``), by module path; the one running, to stop at the end.
_AHEAD: dict[str, Future[tuple[int, str, str]]] = {}
_RUNNING: list[subprocess.Popen[str]] = []
_AHEAD_TIMEOUT = 300.0


def start_ahead(module_files: list[str]) -> None:
    """Run these modules' interpreter children one after another on a background thread from now:
    the test process uses one core, and the children take the other while it works, instead of
    each blocking the session when its module's fixture asks (two minutes of a CI run)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="interpreter-checks")
    for module_file in sorted(set(module_files)):
        _AHEAD[str(Path(module_file).resolve())] = pool.submit(_child, module_file, _AHEAD_TIMEOUT)
    pool.shutdown(wait=False)


def stop_ahead() -> None:
    """Drop the children not started yet and stop the one running (the session is over)."""
    for future in _AHEAD.values():
        future.cancel()
    for proc in _RUNNING:
        proc.kill()


def _child(module_file: str, timeout: float) -> tuple[int, str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, module_file],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _RUNNING.append(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        _RUNNING.remove(proc)
    return proc.returncode, stdout, stderr


def run_interpreted(module_file: str, timeout: float) -> dict[str, dict[str, object]]:
    """Parent side: the records of ``module_file`` run as an interpreter child, by check name
    (the child started ahead if it was, else one started now)."""
    ahead = _AHEAD.pop(str(Path(module_file).resolve()), None)
    returncode, stdout, stderr = ahead.result() if ahead is not None else _child(module_file, timeout)
    records = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            records[record["name"]] = record
    if not records:
        raise RuntimeError(f"interpreter checks produced no results (rc {returncode}):\n{stderr[-4000:]}")
    return records


def assert_within(
    records: dict[str, dict[str, object]],
    name: str,
    tolerance: dict[str, float],
    default: float,
    measure: str = "relative error",
) -> None:
    """Parent side: check ``name`` reported, raised nothing, and kept each error within its limit."""
    record = records.get(name)
    assert record is not None, f"check {name} did not report"
    assert "exception" not in record, record.get("exception")
    errors = record["errors"]
    assert isinstance(errors, dict)
    for key, err in errors.items():
        limit = tolerance.get(key, default)
        assert err <= limit, f"{name}.{key}: {measure} {err:.3g} > {limit}"


def import_error(module: str, env: dict[str, str]) -> str:
    """Imports ``module`` in a fresh interpreter with ``env`` added; returns its stderr, which must
    come from a failed import (switches read at import time refuse bad values there)."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode == 0:
        raise AssertionError(f"import {module} with {env} succeeded")
    return proc.stderr
