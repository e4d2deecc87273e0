"""``phalanx serve`` on the GPU as a user starts it: default flags (cuda, CUDA graphs, memory sized
by --gpu-memory-utilization) on a random checkpoint of the 4B size in the released layout, driven by
the official ``openai`` client over HTTP; then SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.support.live_server import metric, serve_process, wait_for_metric

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CONCURRENT = 64


@pytest.fixture(scope="module")
def model_4b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from phalanx.tools.random_checkpoint import write_random_checkpoint

    out = tmp_path_factory.mktemp("qwen35-4b")
    write_random_checkpoint("4b", out, torch.device("cuda"))
    torch.cuda.empty_cache()
    return out


def _children(pid: int) -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process(pid).children(recursive=True)]


def test_serve_with_default_flags_answers_the_openai_client_and_stops_clean(
    model_4b: Path, tmp_path: Path
) -> None:
    import openai
    import psutil

    log_path = tmp_path / "serve.log"
    with serve_process(["--model", str(model_4b)], log_path, startup_s=900, new_session=True) as served:
        assert "cuda, bfloat16, CUDA graphs decode" in served.printed[0], served.printed
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
        model = client.models.list().data[0].id

        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=16, stream=True
        )
        chunks = list(chat)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        completion = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=16, stream=True
        )
        assert list(completion)[-1].choices[0].finish_reason in ("length", "stop")

        def one(index: int) -> int:
            reply = client.completions.create(
                model=model, prompt=f"Request {index}:", max_tokens=32, extra_body={"ignore_eos": True}
            )
            return reply.usage.completion_tokens

        with ThreadPoolExecutor(CONCURRENT) as pool:
            counts = list(pool.map(one, range(CONCURRENT)))
        assert counts == [32] * CONCURRENT
        assert metric(served.url, "phalanx_slots_total") >= CONCURRENT
        wait_for_metric(served.url, "phalanx_slots_used", 0)
        wait_for_metric(served.url, "phalanx_kv_pages_used", 0)
        ranks = _children(served.process.pid)
        assert ranks, "serve spawned no rank processes"
        served.process.send_signal(signal.SIGTERM)
        try:
            code = served.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(served.process.pid, signal.SIGKILL)
            raise
        assert code == 0, log_path.read_text()[-3000:]
        alive = [pid for pid in ranks if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert not alive, f"rank processes {alive} outlived the server"
    log = log_path.read_text()
    assert "memory" in log and "graph buckets 1-256" in log, log[-3000:]
