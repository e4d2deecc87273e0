"""The embedded tiny demo model: built on first use into the user's cache directory.

``$XDG_CACHE_HOME/phalanx/tiny-demo`` (or ``~/.cache/phalanx/tiny-demo``). The build goes into a
temporary sibling directory that is renamed into place, so a concurrent or interrupted first run
never leaves a half-written model behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger("phalanx.demo")

DEMO_NAME = "tiny-demo"
DEMO_SEED = 0


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "phalanx"


def demo_model_dir() -> Path:
    """The demo model's directory, building it if it is not there yet."""
    target = cache_root() / DEMO_NAME
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    from phalanx.models.tiny import build_tiny_model

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=target.parent))
    log.info("building the tiny demo model", path=str(target))
    try:
        build_tiny_model(staging, tied=False, seed=DEMO_SEED)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent build that won: retry once
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
