"""What the routes share: the engine, the tokenizer and chat template, metrics, the served name;
and turning a request into a started Generation (prompt ids, context check, sampling params)."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from phalanx.engine.engine import Engine, GenerationParams
from phalanx.server.access_log import current_usage
from phalanx.server.chat_template import ChatTemplate, ChatTemplateError
from phalanx.server.choices import Choice
from phalanx.server.detokenizer import TextTokenizer
from phalanx.server.errors import bad_request, unavailable
from phalanx.server.generation import Generation, StopRule
from phalanx.server.metrics import ServerMetrics
from phalanx.server.prompt_tokens import TooManyTokens, encode_within, lone_surrogate
from phalanx.server.schemas import STRUCTURED_FIELDS, ChatCompletionRequest, SamplingRequest
from phalanx.server.structured import (
    GrammarCheck,
    after_reasoning,
    guided_grammar,
    response_format_grammar,
    tool_call_grammar,
    tool_names,
)
from phalanx.server.xml_call_grammar import xml_tool_call_grammar


@dataclass
class ServerState:
    engine: Engine
    tokenizer: TextTokenizer
    template: ChatTemplate | None
    metrics: ServerMetrics
    model_name: str
    grammar_check: GrammarCheck
    default_max_tokens: int | None = None  # None: whatever the context leaves (OpenAI's chat default)

    @property
    def max_context(self) -> int:
        return self.engine.model_info.max_context

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise bad_request(
                f"model {name!r} does not exist here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def start_choices(
        self,
        prompts: list[list[int]],
        body: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        opens_reasoning: bool = False,
    ) -> list[Choice]:
        """One started generation per prompt and sample; if one is refused, those started are
        cancelled and the refusal stands for the whole request. ``opens_reasoning``: the prompt
        ends inside the model's reasoning (a constraint holds from its end on)."""
        usage = current_usage()
        if usage is not None:
            usage.user = body.user  # the access log's line names the end user the request named
        slots = self.engine.stats().slots_total
        if body.n > slots:
            raise bad_request(
                f"n is {body.n}, but this server runs at most {slots} sequences at once", param="n"
            )
        xml_calls = self.template is not None and self.template.writes_xml_calls
        grammar = output_grammar(body, self.grammar_check, xml_calls, opens_reasoning)
        choices: list[Choice] = []
        try:
            for p, prompt_ids in enumerate(prompts):
                for sample in range(body.n):
                    seed = derived_seed(body.seed, sample)
                    generation = self.start(
                        prompt_ids, body, max_tokens, logprobs, seed, prompt_logprobs, grammar
                    )
                    choices.append(Choice(p * body.n + sample, prompt_ids, generation, sample == 0))
        except BaseException:
            for choice in choices:
                self.engine.cancel(choice.generation.request_id)
            raise
        return choices

    def completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (tokenizing is slow on long texts: call it off the event loop)."""
        if isinstance(prompt, str):
            return self._encode_prompt(prompt, "prompt", add_special_tokens=True)
        return list(prompt)

    def _encode_prompt(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """The text's token ids; tokenizing stops as soon as it has more than the context minus
        the one token a completion needs, and that is refused. So is a text that is not Unicode."""
        surrogate = lone_surrogate(text)
        if surrogate is not None:
            raise bad_request(
                f"{param}: the text holds a lone surrogate (U+{ord(text[surrogate]):04X}), which is not"
                " Unicode text: a JSON escape \\ud800-\\udfff must be one half of a pair",
                param=param,
            )
        try:
            return encode_within(self.tokenizer, text, add_special_tokens, self.max_context - 1)
        except TooManyTokens as e:
            raise bad_request(
                f"This model's maximum context length is {self.max_context} tokens, and the prompt"
                f" has at least {e.counted} tokens (at least one token must be left for the"
                " completion).",
                param=param,
                code="context_length_exceeded",
            ) from e

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids (slow on long texts: call it off the event loop)."""
        if self.template is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        messages: list[dict[str, Any]] = [m.for_template() for m in body.messages]
        try:
            text = self.template.render(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                tools=body.tools,
                **(body.chat_template_kwargs or {}),
            )
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages") from e
        # the template already wrote any BOS; the tokenizer must not add another
        return text, self._encode_prompt(text, "messages", add_special_tokens=False)

    def start(
        self,
        prompt_ids: list[int],
        body: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        seed: int | None,
        prompt_logprobs: int | None,
        grammar: str | None,
    ) -> Generation:
        if self.engine.poison_reason is not None:
            raise unavailable(f"engine is poisoned: {self.engine.poison_reason}")
        context = self.max_context
        if len(prompt_ids) >= context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens, and the prompt has"
                f" {len(prompt_ids)} tokens (at least one token must be left for the completion).",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            room = context - len(prompt_ids)
            max_tokens = room if self.default_max_tokens is None else min(room, self.default_max_tokens)
        if len(prompt_ids) + max_tokens > context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens. However, you requested"
                f" {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt,"
                f" {max_tokens} for the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        params = GenerationParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=seed,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            min_p=body.min_p,
            logit_bias=body.token_biases,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            min_tokens=body.min_tokens,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
        )
        stops = StopRule(body.stop_strings, body.include_stop_str_in_output, body.min_tokens)
        try:
            return Generation(self.engine, self.tokenizer, self.metrics, prompt_ids, params, stops)
        except ValueError as e:  # the engine's checks word their field first: "min_tokens must be ..."
            field = str(e).split(" ", 1)[0].rstrip(":")
            raise bad_request(str(e), param=field if field in type(body).model_fields else None) from e
        except RuntimeError as e:  # the engine closed between the check above and submit
            raise unavailable(str(e)) from e


def output_grammar(
    body: SamplingRequest, check: GrammarCheck, xml_calls: bool, opens_reasoning: bool = False
) -> str | None:
    """The grammar the request's output must follow: a tool call its tool_choice demands (in the
    XML form with ``xml_calls``, else the JSON form), or its response format or guided decoding;
    with ``opens_reasoning`` (the prompt ends inside the model's reasoning) it holds from the
    reasoning's end on. None when nothing constrains it."""
    grammar, field = _constraint(body, check, xml_calls)
    if grammar is None or not opens_reasoning:
        return grammar
    return after_reasoning(grammar, field, check)


def _constraint(body: SamplingRequest, check: GrammarCheck, xml_calls: bool) -> tuple[str | None, str]:
    """The constraint's grammar and the field it came from."""
    if isinstance(body, ChatCompletionRequest) and body.tools:
        call_grammar = xml_tool_call_grammar if xml_calls else tool_call_grammar
        names = tool_names(body.tools)
        choice = body.tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if choice.get("type") != "function" or name not in names:
                raise bad_request(
                    f"tool_choice: no tool named {name!r} among the tools offered ({', '.join(names)})",
                    param="tool_choice",
                )
            return call_grammar(body.tools, [name], check), "tools"
        if choice == "required":
            return call_grammar(body.tools, names, check), "tools"
    if body.response_format is not None:
        return response_format_grammar(body.response_format, check), "response_format"
    field = next((name for name in STRUCTURED_FIELDS if getattr(body, name) is not None), "")
    return guided_grammar(body.guided_json, body.guided_regex, body.guided_choice, check), field


def derived_seed(seed: int | None, sample: int) -> int | None:
    """Sample 0 keeps the request's seed (n = 1 matches a plain request); sample i > 0 draws from
    a seed derived from (seed, i), so each of n choices is reproducible and they differ."""
    if seed is None or sample == 0:
        return seed
    digest = hashlib.blake2b(struct.pack("<qq", seed, sample), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
