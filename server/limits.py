"""The one table of request limits: every numeric, string and list field of a request body, its
type (strict: ``true`` is not 1, ``"5"`` is not 5) and its bounds. ``docs/server.md`` lists the
same table; a value outside it is a 400 naming the field.

The numeric bounds are those of the wire (``protocol.messages``), so nothing a request carries can
fail to encode, and a prompt or stop string cannot make the server do unbounded work.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from phalanx.protocol.messages import INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_TEMPERATURE

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_TOP_LOGPROBS = MAX_LOGPROBS
MAX_MODEL_NAME_CHARS = 256
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")

TokenCount = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
# completions: 0 with echo answers the prompt alone (OpenAI's legacy API and vLLM take it)
CompletionTokenCount = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
Temperature = Annotated[float, Field(strict=True, ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(strict=True, gt=0.0, le=1.0)]
TopK = Annotated[int, Field(strict=True, ge=-1, le=INT32_MAX, description="0 or -1: no top-k filter")]
Seed = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
LogprobCount = Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)]
StopString = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
Flag = Annotated[bool, Field(strict=True)]
ModelName = Annotated[str, Field(strict=True, max_length=MAX_MODEL_NAME_CHARS)]
