"""Tool-call parsers for `tool_choice: auto` (vLLM's `--enable-auto-tool-choice --tool-call-parser NAME`): the model
writes its calls in its own format, and the parser finds them in the text.

- `hermes` (Hermes 2 Pro, Qwen 2.5 and 3, and most tool-tuned models since): each call a JSON object
  `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; text before the first call is content.
- `llama3_json` (Llama 3.1-3.3): the whole output one or more JSON objects `{"name": ..., "parameters": {...}}`
  separated by `;`, optionally after `<|python_tag|>`; other output is content.

A parser says how much of a streamed text is surely content (`content_end`: before a call may begin) and, once the
text is complete, its content and calls (`parse`). Text that looks like a call but does not parse as one stays
content, as vLLM answers it.
"""
from __future__ import annotations

import json
import re
from typing import Protocol

Call = tuple[str, str]  # (function name, its arguments as a JSON string)


class ToolParser(Protocol):
    def content_end(self, text: str) -> int:
        """The length of `text`'s beginning that is content whatever follows (a stream may send it now)."""

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """The complete text's content (None if empty) and the calls in it (none: all content)."""


def _held_prefix(text: str, marker: str) -> int:
    """Where `marker` begins in `text`, or where a tail of `text` that could begin it does; else len(text)."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


def _call(obj, args_key: str) -> Call:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call is an object with a name")
    args = obj.get(args_key, obj.get("arguments", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    _CALLS = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def content_end(self, text: str) -> int:  # whitespace before a call is no content: held too
        return len(text[:_held_prefix(text, self.START)].rstrip())

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        at = text.find(self.START)
        if at < 0:
            return text or None, []
        try:
            calls = [_call(json.loads(body), "arguments") for body in self._CALLS.findall(text[at:])]
        except ValueError:
            return text or None, []
        content = text[:at].rstrip()
        return content or None, calls


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        start = len(text) - len(body)
        if not body or body.startswith("{") or body.startswith(self.TAG) or self.TAG.startswith(body):
            return start  # may be a call: held until the text is whole
        return len(text)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text or None, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        try:
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                calls.append(_call(obj, "parameters"))
                i = len(body) - len(body[i:].lstrip().removeprefix(";").lstrip())
        except ValueError:
            return text or None, []
        return None, calls


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def make_parser(name: str) -> ToolParser:
    """The parser named `name` (`PARSERS`); ValueError naming the known ones otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(PARSERS)})")
    return PARSERS[name]()
