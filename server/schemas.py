"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic (FastAPI's own models).

Anything that fails validation is answered with 400 and an OpenAI-style error body (server.app).
Unknown fields are ignored, as OpenAI clients send optional fields this server does not use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.limits import (
    MAX_STOP_STRINGS,
    RESERVED_TEMPLATE_KWARGS,
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


class StreamOptions(BaseModel):
    include_usage: Flag = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    # accepted only at their neutral values: silently ignoring them would change results unseen
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingRequest:
        neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
        for name, value in neutral.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name} is not supported (only {value})")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

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
    max_tokens: TokenCount | None = 16
    logprobs: LogprobCount | None = None
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(value)}")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra keys (name, tool_calls, reasoning_content, ...) are kept: chat templates may use them
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

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
    tools: list[dict[str, Any]] | None = None  # handed to the chat template; replies are not parsed

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
