"""The bodies of `/v1/completions` and `/v1/chat/completions`, as OpenAI's API defines them.

Why refuse rather than ignore: a client that asks for `best_of` or an automatic tool call and silently gets
none draws wrong conclusions. Fields the engine implements are typed; fields OpenAI defines, and vLLM's
sampling extensions, that it does not implement are refused with a 400 naming them -- unless given
at a value that turns them off (`best_of=1`, `length_penalty=1`); unknown fields are refused too.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

MAX_N = 128  # OpenAI's bound on `n`
MAX_LOGPROBS = 20  # the engine's (SamplingParams.logprobs)

# fields the engine does not implement -> the values that mean "off": OpenAI's, then vLLM's sampling extensions
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,),
    "suffix": (None,), "tools": (None,),
    "tool_choice": (None,), "functions": (None,), "function_call": (None,),
    "parallel_tool_calls": (None,), "audio": (None,), "modalities": (None,), "prediction": (None,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,)}


def _is_off(value: Any, off: tuple) -> bool:
    """Whether a body's `value` is one of `off` (True, False and None match only themselves: `tools: false` is
    not `null`)."""
    if isinstance(value, bool) or value is None:
        return any(value is o for o in off)
    return any(not isinstance(o, bool) and o is not None and value == o for o in off)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)  # also `description`, `strict`
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following `json_schema.schema`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras are checked by `_refuse_unsupported`

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_N, strict=True)  # choices per prompt (OpenAI's bound)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's: token ids that end a choice (kept in it)
    min_tokens: int = Field(0, ge=0)  # vLLM's: tokens before EOS or a stop token id may come
    include_stop_str_in_output: bool = False  # vLLM's
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key, a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: one of json, regex, choice, json_object
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as every server does
    add_special_tokens: bool | None = None  # vLLM's: the tokenizer's special tokens on a text prompt (completions:
    # yes, Llama's BOS; chat: only with the plain format, a chat template writes its own)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "_Common":
        extra = dict(self.model_extra or {})
        bad = [k for k, v in extra.items() if k not in UNSUPPORTED or not _is_off(v, UNSUPPORTED[k])]
        if bad:
            known = [k for k in bad if k in UNSUPPORTED]
            unknown = [k for k in bad if k not in UNSUPPORTED]
            parts = []
            if known:
                parts.append(f"not supported by this server: {', '.join(sorted(known))}")
            if unknown:
                parts.append(f"unknown field(s): {', '.join(sorted(unknown))}")
            raise ValueError("; ".join(parts))
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        bad = [k for k in self.logit_bias or {} if not k.strip().isdigit()]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids, got {bad[:5]}")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_kwargs(self, choice: int = 0) -> dict[str, Any]:
        """SamplingParams fields of a prompt's `choice`-th sample (max_tokens filled in by the route: the model's room
        left); with a seed, sample j draws from seed + j, as vLLM seeds its `n` samples."""
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": max(self.top_k, 0), "min_p": self.min_p,
                "seed": seed, "stop": self.stop_list(), "ignore_eos": self.ignore_eos,
                "stop_token_ids": list(self.stop_token_ids or []), "min_tokens": self.min_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty,
                "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()},
                "structured_outputs": self.structured(),
                "logprobs": self.num_logprobs()}

    def structured(self) -> dict[str, Any] | None:
        """`SamplingParams.structured_outputs` from `response_format` or vLLM's `structured_outputs`."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return self.structured_outputs
        return {"json_object": True} if fmt.type == "json_object" else {"json": fmt.json_schema.schema_}

    def num_logprobs(self) -> int | None:
        """How many most likely tokens each generated token comes with, None: no log-probabilities."""
        raise NotImplementedError


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)  # the top ones with each token
    echo: bool = Field(False, strict=True)  # the prompt before the completion (with logprobs: the prompt's too)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_kwargs(self, choice: int = 0) -> dict[str, Any]:
        kw = super().sampling_kwargs(choice)
        return kw | {"prompt_logprobs": self.logprobs} if self.echo else kw

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of texts or of token-id lists)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class ToolCall(BaseModel):
    """An assistant message's call, as the server answered it (`message.tool_calls`), sent back in a conversation."""
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: "CalledFunction"


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON, as OpenAI sends it


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise ValueError(f"a tool call's arguments are not JSON: {text[:80]!r}") from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None  # None: an assistant's message of tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back with the conversation
    tool_call_id: str | None = None  # a tool's message: the call it answers

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's calls may come without)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to an assistant's message")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (transformers' and vLLM's way: a call's arguments as an object)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_object(c.function.arguments)}} for c in self.tool_calls]
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")  # `description`, `strict`
    name: str = Field(min_length=1)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (none: an empty object)

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most (`required` draws one, `auto` keeps the first)
    add_generation_prompt: bool = True  # vLLM's: the template opens the assistant's reply
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self, info: ValidationInfo) -> "ChatCompletionRequest":
        """`auto` (the default with tools) needs the server's tool-call parser (validation context `tool_parser`)."""
        choice = self.tool_choice
        if choice == "none" or (choice is None and not self.tools):
            return self
        if not self.tools:
            raise ValueError("tool_choice needs tools")
        if choice in (None, "auto"):
            if not (info.context or {}).get("tool_parser"):
                raise ValueError("tool_choice 'auto' (the default with tools) needs the model's tool-call parser: "
                                 "serve with --enable-auto-tool-choice --tool-call-parser NAME, or give 'required', "
                                 "a named function or 'none'")
            return self
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        if self.structured_outputs is not None or (self.response_format and self.response_format.type != "text"):
            raise ValueError("give tool_choice or response_format / structured_outputs, not both")
        return self

    def tool_call(self) -> str | None:
        """The function every choice calls (a named tool_choice), "required" (one or more of the tools, as a JSON
        list of {name, parameters}), "auto" (the model's choice, found by the server's tool-call parser), or None:
        text."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        if choice == "required":
            return choice
        return "auto" if self.tools and choice != "none" else None

    def structured(self) -> dict[str, Any] | None:
        call = self.tool_call()
        if call in (None, "auto"):
            return super().structured()
        if call != "required":  # the named function's arguments
            return {"json": next(t.function for t in self.tools if t.function.name == call).arguments_schema()}
        one = {"maxItems": 1} if self.parallel_tool_calls is False else {}
        return {"json": {"type": "array", "minItems": 1, **one, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t.function.name]},
                            "parameters": t.function.arguments_schema()},
             "required": ["name", "parameters"]} for t in self.tools]}}}

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a completion's `prompt` or a chat's `messages` (and `tools`), encoded as those endpoints
    encode them."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: token ids' text."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: int = 400) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
