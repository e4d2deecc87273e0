"""A flood of forged frames at the coordinator's control socket is dropped, counted exactly in
``/metrics`` (``phalanx_rejected_frames_total``) and logged at a bounded rate: ten lines in full,
then a summary at most once a second, however many frames come."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import zmq
from live_server import metric, serve_process

from protocol import PROTOCOL_VERSION, encode
from protocol.messages import Ack, ReplyEnvelope

FORGED = 10_000


def test_forged_frames_are_counted_and_logged_at_a_bounded_rate(tiny_model_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    args = ["--model", str(tiny_model_dir), "--tp", "2", "--kv-pages", "64"]
    with serve_process(args, log_path) as served:
        address = re.search(r"address='(ipc://\S+)'", log_path.read_text()).group(1)
        forger = zmq.Context.instance().socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        forger.connect(address)
        answer = encode(ReplyEnvelope(PROTOCOL_VERSION, 1, 0, 1, Ack()))  # rank 0's, from nobody
        for index in range(FORGED):
            forger.send(answer if index % 2 else b"\x00garbage")
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        deadline = time.monotonic() + 60
        while metric(served.url, "phalanx_rejected_frames_total") < FORGED:  # each step reads the socket
            assert httpx.post(served.url + "/v1/completions", json=body, timeout=60).status_code == 200
            assert time.monotonic() < deadline
        assert metric(served.url, "phalanx_rejected_frames_total") == FORGED
        forger.close()  # open until then: a closed peer's unread frames are discarded
        assert httpx.get(served.url + "/health").status_code == 200
        assert metric(served.url, "phalanx_engine_poisoned") == 0
    log = log_path.read_text()
    assert log.count("event='reply frame rejected'") == 10
    assert 1 <= log.count("event='reply frame rejected (summary)'") <= 10, log[-3000:]
