"""`specsched serve` end to end: a real server process on a free port, driven by the official
`openai` client and by plain HTTP. What it serves must be exactly the embedded engine's greedy
output; bad bodies get OpenAI's error shape; disconnected streams free their pages; the
Prometheus text parses and its spec-decode counters add up; SIGTERM exits cleanly."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specsched.runtime.server.client import launch_server

openai = pytest.importorskip("openai")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():"]
MAX_TOKENS = 12


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    return launch_server(list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--spec", "draft", "--draft-len", "3")
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.fixture(scope="module")
def embedded_texts():
    """The embedded engine's greedy text for each prompt (plain decoding: lossless means the same)."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    async def main():
        async with AsyncEngine(EngineConfig()) as engine:
            return [(await engine.generate_all(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))).text
                    for p in PROMPTS]

    return anyio.run(main)


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_completions_stream_and_not_are_the_engines_greedy_output(server, embedded_texts):
    c = client(server)
    for prompt, want in zip(PROMPTS, embedded_texts):
        r = c.completions.create(model="bundled/target", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens > 0
        assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS
        chunks = list(c.completions.create(model="bundled/target", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    """vLLM's `stream_options.continuous_usage_stats` (which guidellm sends): every chunk of the stream carries the
    usage so far, the completion tokens never decreasing, ending at the request's."""
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c and c["usage"]["prompt_tokens"] > 0 for c in chunks)
    assert used == sorted(used) and used[-1] == MAX_TOKENS and chunks[-1]["choices"] == []


def test_chat_completions_stream_and_not_agree(server):
    c = client(server)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    r = c.chat.completions.create(model="bundled/target", messages=messages, max_tokens=8, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 8 and text
    stream = c.chat.completions.create(model="bundled/target", messages=messages, max_tokens=8, temperature=0,
                                       stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == text


def test_bad_requests_get_openai_errors_naming_the_problem(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match=r"^Error code: 400 .*n: Input should be less than or equal to 128"):
        c.completions.create(model="bundled/target", prompt="x", n=129)
    with pytest.raises(openai.BadRequestError, match="prompt 1: .*longer than the model allows"):
        c.completions.create(model="bundled/target", prompt=[[5, 6], [5] * 5000])
    with pytest.raises(openai.BadRequestError, match="not supported by this server: best_of"):
        c.completions.create(model="bundled/target", prompt="x", best_of=2)
    with pytest.raises(openai.BadRequestError, match="logprobs: Input should be less than or equal to 20"):
        c.completions.create(model="bundled/target", prompt="x", logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        c.chat.completions.create(model="bundled/target", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="unknown field.*frobnicate"):
        c.completions.create(model="bundled/target", prompt="x", extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="longer than the model allows"):
        c.completions.create(model="bundled/target", prompt=[5] * 5000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="gpt-4", prompt="x")
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server + "/health").status_code == 200  # still serving


def test_fields_at_the_values_that_turn_them_off_are_accepted_and_others_refused():
    """What vLLM's benchmark client sends with every request (`repetition_penalty: 1.0`, `logprobs: null`) and what
    chat clients send by default (`logprobs: false`) are served; fields the server does not implement, asking for
    something, are refused naming them (and JSON's true is not the count 1)."""
    from pydantic import ValidationError

    from specsched.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

    vllm_bench = {"model": "m", "prompt": "x", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
                  "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    assert CompletionRequest.model_validate(vllm_bench).max_tokens == 8
    CompletionRequest.model_validate({"prompt": "x", "n": 1, "best_of": 1, "length_penalty": 1,
                                      "min_tokens": 0, "stop_token_ids": [], "skip_special_tokens": True})
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "logprobs": False,
                                          "top_logprobs": 0})
    for field, value in [("length_penalty", 2), ("best_of", 2), ("tools", [{"type": "function"}]),
                         ("skip_special_tokens", False)]:
        with pytest.raises(ValidationError, match=f"not supported by this server: {field}"):
            CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(ValidationError, match="logprobs\n  Input should be a valid integer"):
        CompletionRequest.model_validate({"prompt": "x", "logprobs": True})
    with pytest.raises(ValidationError, match="n\n  Input should be a valid integer"):
        CompletionRequest.model_validate({"prompt": "x", "n": True})


def test_penalties_and_logit_bias_are_the_engines(server):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias (token ids as strings) and vLLM's
    repetition_penalty give the embedded engine's text under the same parameters; a bias of 100 makes every token
    that one; out-of-range values and keys that are not token ids are 400s naming the field."""
    from specsched.runtime import bundled
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.tokenizer import Tokenizer
    from specsched.scheduler.sampling_params import SamplingParams

    penalties = dict(presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3)

    async def embedded():
        async with AsyncEngine(EngineConfig()) as engine:
            return [(await engine.generate_all(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kw))).text
                    for p, kw in ((PROMPTS[1], penalties), (PROMPTS[1], {}))]

    want, plain = anyio.run(embedded)
    assert want != plain  # the penalties change this output
    c = client(server)
    kw = dict(model="bundled/target", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    r = c.completions.create(**kw, presence_penalty=0.5, frequency_penalty=0.8,
                             extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert r.choices[0].text == want
    token = Tokenizer(bundled.tokenizer_path(bundled.target_dir())).encode(" banana")[0]
    r = c.completions.create(**kw, logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == Tokenizer(bundled.tokenizer_path(bundled.target_dir())).decode([token] * MAX_TOKENS)
    for body, field in [({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {str(token): 101}}, "logit_bias"),
                        ({"logit_bias": {"99999999": 1}}, "logit_bias")]:
        r = httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)


def test_response_format_and_structured_outputs_shape_the_text(server):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs (a choice, a regex): the text
    follows it, from a server drafting with a draft model; a schema the grammar cannot express and a body giving
    both are 400s naming the problem."""
    jsonschema = pytest.importorskip("jsonschema")
    c = client(server)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"]}
    chat = dict(model="bundled/target", messages=[{"role": "user", "content": "A name:"}], max_tokens=64, temperature=0)
    r = c.chat.completions.create(**chat, response_format={"type": "json_schema",
                                                           "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = c.chat.completions.create(**(chat | {"max_tokens": 200}), response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    # no max_tokens: the model's room after the prompt and a step's window
    r = c.chat.completions.create(**{k: v for k, v in chat.items() if k != "max_tokens"},
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    kw = dict(model="bundled/target", prompt="def f(x):\n    ", max_tokens=16, temperature=0)
    r = c.completions.create(**kw, extra_body={"structured_outputs": {"choice": ["return x", "pass"]}})
    assert r.choices[0].text in ("return x", "pass")
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        **kw, stream=True, extra_body={"structured_outputs": {"regex": "[a-z]+ = [0-9]+"}}))
    assert re.fullmatch("[a-z]+ = [0-9]+", streamed) or re.fullmatch("[a-z]+ = [0-9]*", streamed)
    for body, named in [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                         "json schema not supported"),
                        ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
                         "not both"),
                        ({"structured_outputs": {"regex": "("}}, "cannot be compiled")]:
        r = httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 400 and named in r.json()["error"]["message"], (body, r.text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


def test_tool_choice_named_or_required_gives_tool_calls_that_follow_their_schemas(server):
    """A named tool_choice calls that function with arguments following its parameters' schema; `required`, one or
    more of the tools as a JSON list of {name, parameters} (vLLM's way, by structured output); streamed, the calls
    arrive whole in the last delta. `auto` (the default with tools) needs a model's tool-call parser: refused."""
    jsonschema = pytest.importorskip("jsonschema")
    c = client(server)
    chat = dict(model="bundled/target", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64,
                temperature=0, tools=[WEATHER, NOOP])
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = c.chat.completions.create(**chat, tool_choice=choice)
        m = r.choices[0].message
        assert m.content is None and m.tool_calls and r.choices[0].finish_reason == "stop", m
        for call in m.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            spec = {"get_weather": WEATHER, "noop": NOOP}[call.function.name]["function"]
            jsonschema.validate(json.loads(call.function.arguments), spec.get("parameters", {"type": "object"}))
        if choice != "required":
            assert [t.function.name for t in m.tool_calls] == ["get_weather"]
        streamed = [ch.choices[0] for ch in c.chat.completions.create(**chat, tool_choice=choice, stream=True)
                    if ch.choices]
        calls = [t for ch in streamed if ch.delta.tool_calls for t in ch.delta.tool_calls]
        assert [(t.function.name, t.function.arguments) for t in calls] == [
            (t.function.name, t.function.arguments) for t in m.tool_calls]
        assert not any(ch.delta.content for ch in streamed)
    r = c.chat.completions.create(**chat, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    for body, named in [({"tools": [WEATHER]}, "tool_choice 'auto'"), ({"tool_choice": "required"}, "needs tools"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "not among the tools")]:
        r = httpx.post(server + "/v1/chat/completions", json={"messages": chat["messages"], **body})
        assert r.status_code == 400 and named in r.json()["error"]["message"], (body, r.text)


def test_a_batch_of_prompts_times_n_gives_choice_i_times_n_plus_j(server, embedded_texts):
    """OpenAI's batch of prompts and `n`: choice i * n + j is sample j of prompt i (greedy: every sample the engine's
    output for its prompt); the usage counts each prompt once and every choice's tokens; streamed the same."""
    c = client(server)
    solo = [c.completions.create(model="bundled/target", prompt=p, max_tokens=1).usage.prompt_tokens for p in PROMPTS]
    kw = dict(model="bundled/target", prompt=PROMPTS, n=2, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"ignore_eos": True})
    r = c.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [embedded_texts[0]] * 2 + [embedded_texts[1]] * 2
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(solo), 4 * MAX_TOKENS)
    text, reasons, usage = {}, {}, None
    for ch in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for choice in ch.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason
        usage = ch.usage or usage
    assert text == {i: ch.text for i, ch in enumerate(r.choices)} and set(reasons.values()) == {"length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (sum(solo), 4 * MAX_TOKENS)


def test_n_samples_of_a_seeded_chat_draw_from_seed_plus_j(server):
    """With a seed, sample j of `n` is the request with seed + j, as vLLM seeds them: streamed or not."""
    c = client(server)
    kw = dict(model="bundled/target", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8,
              temperature=1.0, extra_body={"ignore_eos": True})
    alone = [c.chat.completions.create(**kw, seed=7 + j).choices[0].message.content for j in range(3)]
    assert len(set(alone)) > 1  # three seeds, three draws of 8 tokens at temperature 1
    r = c.chat.completions.create(**kw, seed=7, n=3)
    assert [ch.message.content for ch in r.choices] == alone and r.usage.completion_tokens == 24
    text: dict[int, str] = {}
    for ch in c.chat.completions.create(**kw, seed=7, n=3, stream=True):
        for choice in ch.choices:
            assert choice.index in text or choice.delta.role == "assistant"  # each choice opens with the role
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
    assert [text[j] for j in range(3)] == alone


def test_logprobs_are_the_engines_in_openais_shapes(server):
    """Completions' `logprobs: k` and chat's `logprobs` / `top_logprobs`: each token's log-probability (the embedded
    engine's), the k most likely with it, the token texts making up the output, streamed alike."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    async def embedded():
        async with AsyncEngine(EngineConfig()) as engine:
            return await engine.generate_all(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, logprobs=2,
                                                                        ignore_eos=True))

    want = anyio.run(embedded)
    c = client(server)
    kw = dict(model="bundled/target", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    lp = c.completions.create(**kw).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert "".join(lp.tokens) == want.text and lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(12)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[tok] == value and max(top.values()) == value  # greedy: the most likely
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(**kw, stream=True)]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    chat = dict(model="bundled/target", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=6,
                temperature=0, logprobs=True, top_logprobs=3)
    r = c.chat.completions.create(**chat)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content and len(content) == 6
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob and bytes(t.bytes) == t.token.encode()
               for t in content)
    streamed = [t for ch in c.chat.completions.create(**chat, stream=True) if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    assert c.chat.completions.create(**(chat | {"logprobs": False, "top_logprobs": None})).choices[0].logprobs is None


def test_echo_returns_the_prompt_and_with_logprobs_scores_it(server):
    """What lm-evaluation-harness asks to score a continuation (echo, logprobs 1, max_tokens 1, temperature 0): the
    text is the prompt and the token, every prompt token after the first scored as the embedded engine scores it
    (the first null), streamed alike; echo alone returns the text without scores."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    async def embedded():
        async with AsyncEngine(EngineConfig()) as engine:
            return await engine.generate_all(PROMPTS[1], SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1))

    want = anyio.run(embedded)
    c = client(server)
    kw = dict(model="bundled/target", prompt=PROMPTS[1], max_tokens=1, temperature=0, logprobs=1, echo=True)
    r = c.completions.create(**kw).choices[0]
    assert r.text == PROMPTS[1] + want.text and "".join(r.logprobs.tokens) == r.text
    assert r.logprobs.token_logprobs[0] is None and r.logprobs.top_logprobs[0] is None
    scores = [x.logprob for x in want.prompt_logprobs[1:]] + [want.logprobs[0].logprob]
    assert r.logprobs.token_logprobs[1:] == pytest.approx(scores, abs=1e-4)
    chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True)]
    assert "".join(ch.text for ch in chunks) == r.text
    assert sum((ch.logprobs.tokens for ch in chunks), []) == r.logprobs.tokens
    plain = c.completions.create(**(kw | {"logprobs": None, "max_tokens": 4})).choices[0]
    assert plain.text.startswith(PROMPTS[1]) and plain.logprobs is None


def _metrics(url: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))))] \
                = s.value
    return out


def _metrics_when_idle(url: str, timeout: float = 10.0) -> dict:
    """The server's metrics once no request runs and no page is used (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        idle = m[("specsched:kv_pages_used", ())] == 0 and m[("vllm:num_requests_running", ())] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_disconnected_streams_free_their_pages_and_the_rest_match_solo_runs(server, embedded_texts):
    def stream(i: int, results: dict) -> None:
        with httpx.stream("POST", server + "/v1/completions", timeout=60,
                          json={"prompt": PROMPTS[i % 2], "max_tokens": MAX_TOKENS if i % 3 else 64,
                                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            text = []
            for line in r.iter_lines():
                if i % 3 == 0:
                    return  # disconnects after its first event
                if line.startswith("data: {"):
                    text += [ch["text"] for ch in json.loads(line[6:])["choices"]]
            results[i] = "".join(text)

    results: dict = {}
    threads = [threading.Thread(target=stream, args=(i, results)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: results[i] for i in results} == {i: embedded_texts[i % 2] for i in range(16) if i % 3}
    m = _metrics_when_idle(server)
    assert m[("specsched:kv_pages_used", ())] == 0 and m[("vllm:num_requests_running", ())] == 0
    assert m[("vllm:request_success_total", (("finished_reason", "abort"),))] >= 1


def test_a_disconnected_stream_of_several_choices_aborts_them_all(server):
    """A batch of 2 prompts x n = 3 streamed, the client gone after its first event: all 6 requests are aborted and
    every page freed."""
    before = _metrics(server).get(("vllm:request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"prompt": PROMPTS, "n": 3, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    m = _metrics_when_idle(server)
    assert m[("specsched:kv_pages_used", ())] == 0 and m[("vllm:num_requests_running", ())] == 0
    assert m[("vllm:request_success_total", (("finished_reason", "abort"),))] - before == 6


def test_metrics_spec_decode_counters_add_up(server):
    client(server).completions.create(model="bundled/target", prompt=PROMPTS[0], max_tokens=MAX_TOKENS)
    m = _metrics(server)
    drafted = m[("vllm:spec_decode_num_draft_tokens_total", ())]
    accepted = m[("vllm:spec_decode_num_accepted_tokens_total", ())]
    per_pos = [v for (name, labels), v in m.items() if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert m[("vllm:spec_decode_num_drafts_total", ())] > 0 and 0 < accepted <= drafted
    assert len(per_pos) == 3 and sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert m[("specsched:steps_total", (("draft_len", "3"),))] > 0 and m[("specsched:draft_len", ())] in (0, 1, 2, 3)
    assert m[("specsched:step_acceptance_length_count", ())] > 0
    assert m[("vllm:time_to_first_token_seconds_count", ())] >= 1
    # per-request length histograms (vLLM's dashboard panels): every finished request counted once, its tokens summed
    done = sum(v for (name, _), v in m.items() if name == "vllm:request_success_total")
    assert m[("vllm:request_prompt_tokens_count", ())] == m[("vllm:request_generation_tokens_count", ())] == done
    assert m[("vllm:request_prompt_tokens_sum", ())] == m[("vllm:prompt_tokens_total", ())]
    assert m[("vllm:request_generation_tokens_sum", ())] >= MAX_TOKENS
    models = httpx.get(server + "/v1/models").json()
    assert models["data"][0]["id"] == "bundled/target"


@pytest.mark.slow
def test_sigterm_lets_in_flight_requests_finish_and_keeps_the_trace_and_its_live_export(tmp_path):
    from specsched.traces.reader import read_trace

    from tests.otlp_collector import Collector, serve, span_names

    collector, collector_url = serve(Collector)
    trace = tmp_path / "serve.jsonl"
    proc, url = start_server("--trace", str(trace), "--shutdown-timeout", "5", "--otlp", collector_url)
    got = {}

    def long_request():
        got["r"] = httpx.post(url + "/v1/completions", timeout=60,
                              json={"prompt": PROMPTS[0], "max_tokens": 48, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0 and time.monotonic() - t0 < 6
    t.join(10)
    assert got["r"].status_code == 200 and got["r"].json()["usage"]["completion_tokens"] == 48
    tr = read_trace(trace)
    assert len(tr.requests) == 1 and len(tr.finishes) == 1
    collector.shutdown()
    # the request's span and the steps' spans reached the collector before the server exited
    names = span_names(Collector)
    assert sum(n.startswith("text_completion") for n in names) == 1 and "step" in names


def test_bench_over_the_endpoint_reports_the_embedded_bench_keys(server):
    from typer.testing import CliRunner

    from specsched.cli.main import app
    from specsched.traces.metrics import compute_metrics
    from specsched.traces.synthetic import synthetic_trace

    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--endpoint", server, "--num-requests", "4", "--max-tokens", "6",
                              "--concurrency", "2", "--warmup", "0", "--json"])
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)
    assert m["requests"] == 4 and m["requests_failed"] == 0 and m["output_tokens"] == 4 * 6
    assert m["ttft_ms"]["p50"] > 0 and m["tpot_ms"]["p50"] > 0 and m["output_tokens_per_s"] > 0
    assert m["mean_accept_len"] >= 1 and m["endpoint"] == server
    embedded_keys = set(compute_metrics(synthetic_trace()))
    assert embedded_keys <= set(m)
    res = runner.invoke(app, ["bench", "--endpoint", server, "--spec", "draft"], env={"COLUMNS": "400"})
    assert res.exit_code == 2 and "--spec configure an embedded engine" in " ".join(res.output.split())


def test_a_request_that_fails_on_the_device_is_a_500_for_it_alone(monkeypatch):
    from specsched.runtime.devices import WorkerSpec
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.server.app import build_app
    from tests.faulty_worker import POISON

    async def main():
        eng = AsyncEngine(EngineConfig(num_pages=256))
        spec = eng.worker_spec()
        monkeypatch.setattr(eng, "worker_spec", lambda: WorkerSpec("tests.faulty_worker:FaultyWorker", spec.kwargs))
        async with eng:
            app = build_app(eng, "bundled/target")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                r = await c.post("/v1/completions", json={"prompt": [POISON, 5, 6], "max_tokens": 4})
                assert r.status_code == 500 and "injected device failure" in r.json()["error"]["message"]
                r = await c.post("/v1/completions", json={"prompt": [POISON, 7, 8], "max_tokens": 4, "stream": True})
                events = [line for line in r.text.splitlines() if line.startswith("data: ")]
                assert "injected device failure" in events[-2] and events[-1] == "data: [DONE]"
                r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            assert eng.kv_stats().num_used_pages == 0

    anyio.run(main)


def test_chat_prompts_use_the_models_template_or_the_plain_one(tmp_path):
    from specsched.runtime.server.chat import chat_template_of, render_chat
    from specsched.runtime.server.protocol import ChatMessage

    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content=[{"type": "text",
                                                                                               "text": "hi"}])]
    assert render_chat(msgs, None) == "system: Be brief.\nuser: hi\nassistant:"
    template = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                "{{ raise_exception('system first') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert chat_template_of(tmp_path) == template and chat_template_of(tmp_path / "none") is None
    assert render_chat(msgs, template) == "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"
    with pytest.raises(ValueError, match="refuses these messages: system first"):
        render_chat(msgs[::-1], template)


def test_an_api_key_guards_the_v1_routes_alone():
    """`--api-key`: /v1 answers only `Authorization: Bearer <key>` (401 in OpenAI's error shape otherwise, which the
    OpenAI client raises as AuthenticationError); /health and /metrics stay open."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.server.app import build_app

    async def main():
        async with AsyncEngine(EngineConfig(num_pages=64)) as eng:
            app = build_app(eng, "bundled/target", api_key="s3cret")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    r = await c.get("/v1/models", headers=headers)
                    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
                assert (await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
                assert (await c.get("/health")).status_code == 200 and (await c.get("/metrics")).status_code == 200
            oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="wrong", max_retries=0,
                                     http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
            with pytest.raises(openai.AuthenticationError):
                await oai.completions.create(model="bundled/target", prompt="x", max_tokens=1)

    anyio.run(main)


@pytest.mark.parametrize("value,named", [("no/such/template.jinja", "no such file, and not a Jinja template"),
                                         ("{% if %}", "--chat-template does not compile")])
def test_serve_refuses_a_chat_template_that_is_neither_a_file_nor_a_template(value, named):
    from typer.testing import CliRunner

    from specsched.cli.main import app

    res = CliRunner().invoke(app, ["serve", "--chat-template", value], env={"COLUMNS": "400"})
    assert res.exit_code in (1, 2) and named in " ".join(res.output.split()), res.output
