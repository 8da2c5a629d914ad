"""Request bodies of the OpenAI API as pydantic models: OpenAI's field names, types and
ranges, plus vLLM's sampling extras (top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, skip_special_tokens). A body that does not validate gets 400 (app.py), as vLLM
answers, not FastAPI's 422.

Unknown fields are accepted and ignored (the official clients send fields such as `user`);
fields whose meaning the engine cannot honour (best_of > 1, echo, suffix, tools, a
logit_bias, a JSON response format) are refused with 400 by `unsupported`, never silently
dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

INT32_MAX = (1 << 31) - 1
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs; the scheduler has its own (max_logprobs)
# Strict: a JSON string is never read as a token id (["5"] is a list of texts).
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX), Strict()]], Field(min_length=1)]


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class SamplingFields(OpenAIBody):
    """The fields both endpoints share. None: OpenAI's default (temperature 1.0, top_p 1.0)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=INT32_MAX)  # completions per prompt (the scheduler caps it: max_n)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    skip_special_tokens: bool = True

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a field whose meaning the engine cannot honour, else None."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: a text, a list of texts, token ids, or a list of
    token-id lists; each prompt gives n choices, completion j of prompt i at index i * n + j
    (as OpenAI and vLLM number them)."""

    # Tried in this order, the first that fits wins: token ids before texts, so that a long id
    # list is not first validated (and failed) as texts, id by id.
    prompt: Annotated[
        str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)],
        Field(union_mode="left_to_right"),
    ]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, as text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBody):
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. The messages are rendered with the tokenizer's chat template
    (or --chat-template); the gateway sends the scheduler the rendered token ids."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras for the template
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools are not supported"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice is not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only the text response format is supported"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        """The scheduler's `logprobs` (top-n alternatives per token), None: not asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
