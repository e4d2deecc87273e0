"""``phalanx serve``'s own helpers: the curl line it prints and the note on eager CUDA decode."""

from __future__ import annotations

import json
import shlex

from tools.serve import curl_line, eager_decode_note


def test_curl_line_posts_a_chat_completion_to_the_printed_address() -> None:
    words = shlex.split(curl_line("http://127.0.0.1:8123", "tiny-demo"))
    assert words[:2] == ["curl", "http://127.0.0.1:8123/v1/chat/completions"]
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == "tiny-demo" and body["messages"][0]["role"] == "user"


def test_a_cuda_replica_without_graphs_is_told_about_cuda_graph() -> None:
    note = eager_decode_note("cuda", cuda_graph=False)
    assert note is not None and note.startswith("note: decode runs eagerly; --cuda-graph replays")
    assert eager_decode_note("cuda", cuda_graph=True) is None
    assert eager_decode_note("cpu", cuda_graph=False) is None  # graphs are CUDA's; CPU has no note
