"""Shared session fixtures: tiny random Qwen3.5 checkpoints (with tokenizer) built once per session,
and the live servers of them that several modules only send requests to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.tools.search_path import keep_repository_last

keep_repository_last()  # before anything imports transformers (it imports the `kernels` distribution)

from phalanx.models.tiny import build_tiny_model  # noqa: E402
from tests.support.interpreter_checks import start_ahead, stop_ahead  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402


def pytest_collection_finish(session: pytest.Session) -> None:
    """The Triton interpreter checks of the collected kernel modules start now, in the background."""
    start_ahead([str(item.path) for item in session.items if _runs_interpreted(item)])


def _runs_interpreted(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return module is not None and "run_interpreted" in vars(module)


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_ahead()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied tiny model (separate lm_head.weight), seed 0."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_untied"), tied=False, seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied tiny model (lm_head shares embed_tokens), seed 1."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_tied"), tied=True, seed=1)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``phalanx serve`` of the untied tiny model with the defaults of ``live_server``; its base URL.
    Shared by the modules whose checks hold whatever the server served before (starting a replica
    is what costs)."""
    with live_server(tiny_model_dir, tmp_path_factory.mktemp("tiny_server") / "server.log") as url:
        yield url


@pytest.fixture(scope="session")
def tiny_server_small_batches(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """As ``tiny_server``, with 16-token steps: a prompt takes several chunks."""
    log = tmp_path_factory.mktemp("tiny_server_small_batches") / "server.log"
    with live_server(tiny_model_dir, log, "--max-batch-tokens", "16") as url:
        yield url
