"""Bodies parsed by msgspec give what ``json.loads`` gives, and ``json.loads``'s error where it
refuses (FastAPI turns that error into the request's 400)."""

from __future__ import annotations

import asyncio
import json

import pytest

from phalanx.server.json_body import MsgspecJsonRequest

BODIES = [
    b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 16}',
    b'{"a": 123456789012345678901234567890, "b": -0.0, "c": 1E2, "a": 2}',  # big ints, last key wins
    '{"text": "héllo \\u00e9 \\ud83d\\ude42"}'.encode(),
    b'{"a": "\\ud800"}',  # a lone surrogate: msgspec refuses it, json.loads takes it
    b'{"top_p": NaN, "seed": -Infinity, "t": 1e400}',  # json.loads's extensions
    '{"a": 1}'.encode("utf-16"),  # json.loads detects UTF-16
]


def _parse(body: bytes) -> object:
    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    request = MsgspecJsonRequest({"type": "http", "method": "POST", "headers": []}, receive)
    return asyncio.run(request.json())


@pytest.mark.parametrize("body", BODIES)
def test_a_body_parses_as_json_loads_parses_it(body: bytes) -> None:
    assert repr(_parse(body)) == repr(json.loads(body))


@pytest.mark.parametrize("body", [b'{"a": 1', b'{"a": 1} x', b"", b"\xff\xfe\xfd"])
def test_a_body_json_loads_refuses_is_refused_with_its_error(body: bytes) -> None:
    with pytest.raises((json.JSONDecodeError, UnicodeDecodeError)) as ours:
        _parse(body)
    with pytest.raises(type(ours.value)) as theirs:
        json.loads(body)
    assert str(ours.value) == str(theirs.value)
