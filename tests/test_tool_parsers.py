"""`tool_choice: auto`'s tool-call parsers (runtime/server/tool_parsers.py): the calls and content they find in a model's
text, and how much of a stream is surely content; end to end through the server with the OpenAI client."""
from __future__ import annotations

import json
import re

import anyio
import httpx
import pytest

from specsched.runtime.server.tool_parsers import HermesParser, Llama3JsonParser, make_parser

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'


def test_hermes_finds_each_tagged_call_and_the_text_before_them():
    p = HermesParser()
    text = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{{\"name\": \"noop\"}}</tool_call>"
    assert p.parse(text) == ("Let me check.", [("get_weather", '{"city": "Paris", "unit": "c"}'), ("noop", "{}")])
    assert p.parse(f"<tool_call>\n{CALL}") == (None, [("get_weather", '{"city": "Paris", "unit": "c"}')])  # cut short
    assert p.parse("no calls here") == ("no calls here", [])
    assert p.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])  # text, as vLLM
    # a stream may send what cannot begin a call: before the tag, or a tail that could begin it (and blanks)
    assert [p.content_end(t) for t in ("Hello", "Hello <tool", "Hello <tool_call>{", "a<b", "a \n")] == [5, 5, 5, 3, 1]


def test_llama3_json_reads_one_or_more_calls_as_the_whole_output():
    p = Llama3JsonParser()
    two = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert p.parse(two) == (None, [("a", '{"x": 1}'), ("b", "{}")])
    assert p.parse(' {"name": "a", "arguments": {"x": 1}}') == (None, [("a", '{"x": 1}')])
    assert p.parse("The weather is fine.") == ("The weather is fine.", [])
    assert p.parse('{"name": "a", "parameters": {}} and more') == ('{"name": "a", "parameters": {}} and more', [])
    assert [p.content_end(t) for t in ("", "  {", "<|python", "Sure")] == [0, 2, 0, 4]


def test_an_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'x' .known: hermes, llama3_json"):
        make_parser("x")


def test_auto_tool_choice_through_the_server_gives_the_parsed_calls_streamed_or_not():
    """With the hermes parser, `auto` (the default with tools) answers the calls the model wrote (here forced by a
    regex) as `tool_calls` with the text before them as content and finish_reason `tool_calls`; a stream sends that
    text as content and never the call's markup; text without a call is content."""
    openai = pytest.importorskip("openai")
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.server.app import build_app

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}
    forced = {"structured_outputs": {"regex": r"Let me check\.\n<tool_call>\n" + json.dumps(json.loads(CALL))
                                     .replace("{", r"\{").replace("}", r"\}") + r"\n</tool_call>"}}
    chat = dict(model="bundled/target", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=160,
                temperature=0, tools=[weather])

    async def main():
        async with AsyncEngine(EngineConfig(num_pages=256)) as eng:
            app = build_app(eng, "bundled/target", tool_parser=make_parser("hermes"))
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
            c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
            r = await c.chat.completions.create(**chat, extra_body=forced)
            m = r.choices[0].message
            assert m.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
            assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
                ("get_weather", {"city": "Paris", "unit": "c"})]
            parts = [ch.choices[0] async for ch in await c.chat.completions.create(**chat, extra_body=forced,
                                                                                   stream=True) if ch.choices]
            assert "".join(p.delta.content or "" for p in parts) == "Let me check."
            calls = [t for p in parts if p.delta.tool_calls for t in p.delta.tool_calls]
            assert [(t.function.name, t.function.arguments) for t in calls] == [
                (t.function.name, t.function.arguments) for t in m.tool_calls]
            assert parts[-1].finish_reason == "tool_calls"
            two = {"structured_outputs": {"regex": r"(<tool_call>\n\{\"name\": \"get_weather\", \"arguments\": \{\}\}"
                                                    r"\n</tool_call>\n){2}"}}
            both = await c.chat.completions.create(**chat, extra_body=two)
            one = await c.chat.completions.create(**chat, extra_body=two, parallel_tool_calls=False)
            assert (len(both.choices[0].message.tool_calls), len(one.choices[0].message.tool_calls)) == (2, 1)
            plain = await c.chat.completions.create(**{**chat, "max_tokens": 8})
            assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
            assert plain.choices[0].finish_reason in ("length", "stop")
            await http.aclose()

    anyio.run(main)


@pytest.mark.parametrize("args,named", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser is used with --enable-auto-tool-choice"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "x"], "unknown tool-call parser 'x'")])
def test_serve_refuses_auto_tool_choice_without_a_known_parser(args, named):
    from typer.testing import CliRunner

    from specsched.cli.main import app

    res = CliRunner().invoke(app, ["serve", *args], env={"COLUMNS": "400"})
    assert res.exit_code == 2 and named in " ".join(res.output.split()), res.output


def test_a_conversation_carries_its_calls_and_their_results_to_the_template():
    """An agent's next turn sends back the assistant's calls (content null) and each tool's result: the chat template
    reads the calls' arguments as objects (transformers' and vLLM's way); a message without content otherwise, or
    with arguments that are not JSON, is a 400 naming it."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.server.app import build_app

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
                "CALL {{ c['function']['name'] }}({{ c['function']['arguments']['city'] }}){% endfor %}"
                "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}<|assistant|>")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"}]

    async def main():
        async with AsyncEngine(EngineConfig(num_pages=64)) as eng:
            app = build_app(eng, "bundled/target", template, tool_parser=make_parser("hermes"))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                ids = (await c.post("/tokenize", json={"messages": messages})).json()["tokens"]
                text = (await c.post("/detokenize", json={"tokens": ids})).json()["prompt"]
                assert text == "<|user|>Weather in Paris?<|assistant|>CALL get_weather(Paris)<|tool|>18 C, clear<|assistant|>"
                r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
                assert r.status_code == 200, r.text
                for bad, named in [([{"role": "user", "content": None}], "a user message needs content"),
                                   ([{**messages[1], "tool_calls": [{**call, "function": {**call["function"],
                                                                                         "arguments": "{city"}}]}],
                                    "arguments are not JSON")]:
                    r = await c.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 2})
                    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text

    anyio.run(main)


def test_parallel_tool_calls_false_lets_required_draw_one_call():
    """`required` is a JSON list of calls drawn by its schema: with parallel_tool_calls false, a list of one."""
    from specsched.runtime.server.protocol import ChatCompletionRequest
    from specsched.scheduler.sampling_params import StructuredOutputs

    tool = {"type": "function", "function": {"name": "noop"}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"}
    one = '[{"name": "noop", "parameters": {}}]'
    two = '[{"name": "noop", "parameters": {}}, {"name": "noop", "parameters": {}}]'
    for parallel, both in ((None, True), (False, False)):
        req = ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": parallel})
        pattern = StructuredOutputs(**req.structured()).pattern
        assert re.fullmatch(pattern, one) and bool(re.fullmatch(pattern, two)) == both, parallel
