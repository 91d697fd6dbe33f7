"""Chat: the prompt a chat's messages make (the checkpoint's chat template, as transformers renders it), and the tool
calls in a chat choice's text (`tool_choice`: a named function, `required`, or `auto` by a tool-call parser)."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

from specsched.runtime.server.tool_parsers import ToolParser
from specsched.runtime.tokenizer import Tokenizer

PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"  # each message; then "assistant:" opens the reply


def render_chat(messages, template: str | None, tools: list[dict] | None = None, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True, kwargs: dict | None = None) -> str:
    """The prompt of a chat: the tokenizer's chat template (Jinja, as transformers renders it, `tools`, the special
    tokens' texts and vLLM's `chat_template_kwargs` -- Qwen3's `enable_thinking` -- given to it) when the model ships
    one, else each message as "role: content" on its own line, then "assistant:" (with `add_generation_prompt`)."""
    if template is not None:
        import jinja2.sandbox

        def raise_exception(message: str):  # what Hugging Face templates call on a conversation they refuse
            raise ValueError(f"the chat template refuses these messages: {message}")

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template).render({**(kwargs or {}), "messages": [m.for_template() for m in messages],
                                                 "add_generation_prompt": add_generation_prompt,
                                                 "bos_token": bos_token, "eos_token": eos_token, "tools": tools})
    return "".join(PLAIN_CHAT_TEMPLATE.format(role=m.role, content=m.text() or json.dumps(
        [c.function.model_dump() for c in m.tool_calls or ()])) for m in messages) + (
        "assistant:" if add_generation_prompt else "")


def chat_template_of(model_dir: str | Path) -> str | None:
    """The `chat_template` of a checkpoint's tokenizer_config.json (None when it has none)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def chat_prompt(tok: Tokenizer, template: str | None, req) -> list[int]:
    """A chat request's prompt as token ids: a chat template writes the special tokens it wants (the BOS among them)
    and none are added on encoding, as vLLM; the plain format is encoded as a completion's prompt. vLLM's
    `add_special_tokens` adds the tokenizer's own, or leaves them out. ValueError: messages the template refuses."""
    text = render_chat(req.messages, template, [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                       tok.token(tok.bos_token_id), tok.token(tok.eos_token_id), req.add_generation_prompt,
                       req.chat_template_kwargs)
    special = req.add_special_tokens if req.add_special_tokens is not None else template is None
    return tok.encode(text, special_tokens=special)


def tool_calls(text: str, call: str | None, parser: ToolParser | None = None,
               one: bool = False) -> tuple[str | None, list[dict]]:
    """A chat choice's content and calls (`ChatCompletionRequest.tool_call`): the named function with the text as its
    arguments, or each {name, parameters} of the `required` JSON list (no content; none but text for a call cut
    short by max_tokens), or what the server's tool-call parser finds (`auto`; the first alone with `one`:
    `parallel_tool_calls: false`)."""
    if call == "auto":
        content, named = parser.parse(text)
        named = named[:1] if one else named
    elif call is None:
        return text, []
    else:
        try:
            parsed = json.loads(text)
        except ValueError:
            return text, []
        content = None
        named = [(call, text)] if call != "required" else [(x["name"], json.dumps(x["parameters"])) for x in parsed]
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": n, "arguments": a}} for n, a in named]


def chat_message(text: str, call: str | None, parser: ToolParser | None = None, one: bool = False) -> dict:
    """A chat choice's message (the delta of a stream's last chunk carries the same fields): its text, or its tool
    calls (and the text before them, with `auto`)."""
    content, calls = tool_calls(text, call, parser, one)
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def chat_reason(reason: str | None, call: str | None, message: dict) -> str | None:
    """An `auto` choice that called a tool finishes with `tool_calls` (OpenAI's, vLLM's); the others as they did."""
    return "tool_calls" if call == "auto" and reason == "stop" and message.get("tool_calls") else reason
