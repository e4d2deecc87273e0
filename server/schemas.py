"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic (FastAPI's own models).

Anything that fails validation is answered with 400 and an OpenAI-style error body (server.app).
A field this server does not know is refused with a 400 naming it, never accepted and ignored:
it could change the output (a sampling extra, a response format) without the client noticing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from phalanx.server.limits import (
    INT32_MAX,
    MAX_STOP_STRINGS,
    RESERVED_TEMPLATE_KWARGS,
    CompletionTokenCount,
    Flag,
    LogprobCount,
    ModelName,
    Seed,
    StopString,
    Temperature,
    TokenCount,
    TokenId,
    TopK,
    TopP,
)

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one bias
MAX_PROMPTS = 1024  # prompts in one completions request
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")
StrictFloat = Annotated[float, Field(strict=True)]


class StreamOptions(BaseModel):
    include_usage: Flag = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: StopString | list[StopString] | None = None
    ignore_eos: Flag = False
    stream: Flag = False
    stream_options: StreamOptions | None = None
    n: Annotated[
        int,
        Field(strict=True, ge=1, le=INT32_MAX, description="choices per prompt (at most the decode slots)"),
    ] = 1
    # accepted only at their neutral values: silently ignoring them would change results unseen
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    repetition_penalty: StrictFloat = 1.0
    logit_bias: dict[str, StrictFloat] | None = None
    # vLLM's sampling extras
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] = 0
    stop_token_ids: list[Annotated[int, Field(strict=True)]] | None = None  # checked against the vocabulary
    include_stop_str_in_output: Flag = False
    prompt_logprobs: LogprobCount | None = None
    user: ModelName | None = None  # OpenAI's end-user id: named in the request's access-log line
    # structured output (server/structured.py): at most one of these
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Annotated[str, Field(strict=True)] | None = None
    guided_regex: Annotated[str, Field(strict=True)] | None = None
    guided_choice: list[Annotated[str, Field(strict=True)]] | None = None

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty")
    @classmethod
    def _neutral_penalty(cls, value: float, info: ValidationInfo) -> float:
        neutral = 1.0 if info.field_name == "repetition_penalty" else 0.0
        if value != neutral:
            raise ValueError(f"not supported (only {neutral})")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingRequest:
        constraints = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        if len(constraints) > 1:
            raise ValueError(f"{constraints[1]} cannot be combined with {constraints[0]}")
        if constraints and self.min_tokens:
            raise ValueError(f"min_tokens is not supported with {constraints[0]}")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return value

    @property
    def token_biases(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        return stops

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: Annotated[str, Field(strict=True)] | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: CompletionTokenCount | None = 16
    logprobs: LogprobCount | None = None
    echo: Flag = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> list[str] | list[list[int]]:
        """A list of prompts, each a string or token ids."""
        batched = isinstance(value, list) and bool(value) and isinstance(value[0], str | list)
        prompts = value if batched else [value]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError("the prompt is empty" if not batched else f"prompt {index} is empty")
        return prompts

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        return self.prompt  # type: ignore[return-value]  # the validator made it a list

    @property
    def prompt_top_logprobs(self) -> int | None:
        """Top-N prompt logprobs to ask the engine for: vLLM's prompt_logprobs, and echo's."""
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(asked, default=None)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra keys (name, tool_calls, reasoning_content, ...) are kept: chat templates may use them
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @model_validator(mode="after")
    def _tool_call_arguments(self) -> ChatMessage:
        """An assistant's past calls carry their arguments as JSON text (OpenAI's shape); chat
        templates take them as an object (transformers' convention, which vLLM follows too)."""
        calls = (self.model_extra or {}).get("tool_calls")
        if self.role != "assistant" or not isinstance(calls, list):
            return self
        for index, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(function, dict) and isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as e:
                    raise ValueError(f"tool_calls.{index}.function.arguments is not JSON: {e}") from e
        return self

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: Flag = False
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: Flag = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # handed to the chat template; replies parsed for calls
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: Flag = True  # False: at most the first call is returned

    @model_validator(mode="after")
    def _chat_options(self) -> ChatCompletionRequest:
        if self.stream and self.prompt_logprobs is not None:  # answered beside the choices, whole
            raise ValueError("prompt_logprobs is not supported with stream in chat completions")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        constraints = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        if self.tool_choice not in (None, "none", "auto") and constraints:
            raise ValueError(f"a tool_choice that demands a call cannot be combined with {constraints[0]}")
        return self

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or ()) & set(RESERVED_TEMPLATE_KWARGS))
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here: the request's own fields set them")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        """Top-N logprobs to ask the engine for; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None
