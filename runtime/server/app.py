"""The OpenAI-compatible routes over one running AsyncEngine (`build_app`), and `serve`.

Every choice of a response (a prompt of a batch, one of its `n` samples) is one `engine.generate` stream: a client
that disconnects mid-stream cancels its response, whose `finally` aborts its requests (their pages are freed at the
next step); a request that fails is a 500 (or an error event in its stream) for that response alone.
"""
from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from specsched.runtime.server.chat import chat_message, chat_prompt, chat_reason
from specsched.runtime.server.metrics import ServerMetrics
from specsched.runtime.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              TokenizeRequest, error_body)
from specsched.runtime.server.tool_parsers import ToolParser
from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.sampling_params import SamplingParams

def _error(message: str, status: int = 400, type_: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(error_body(message, type_, param, status), status_code=status)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"] if x not in ("body",))
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _reason(finish_reason: str | None) -> str | None:
    return {"abort": "abort", "error": "error", "length": "length"}.get(finish_reason or "", "stop")


@dataclass
class _Choice:
    """One choice of a response -- one engine request -- and its bookkeeping for the metrics: arrival, first and last
    token, the output so far."""

    index: int
    request_id: str
    ids: list[int]  # the prompt's token ids
    params: SamplingParams
    start: float = field(default_factory=time.monotonic)
    last: float = 0.0
    first: float | None = None
    output_tokens: int = 0
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob per token so far, where asked for
    offset: int = 0  # completions' `text_offset` of the next token
    echo: str | None = None  # completions' `echo`: the prompt's text, until the first output carries it
    prompt_logprobs: list | None = None  # with echo and logprobs: the prompt's (None for its first token)
    final: Any = None  # the finished RequestOutput
    tool_call: str | None = None  # chat with tools: the function it calls, "required" or "auto" (text held back)
    sent: int = 0  # with `auto`: the characters of content a stream has sent (the rest may begin a call)
    one_call: bool = False  # `parallel_tool_calls: false`: the first call alone
    done: bool = False  # counted in the metrics

    def chunk(self, metrics: ServerMetrics, out) -> None:
        now, n = time.monotonic(), len(out.token_ids)
        metrics.tokens(n, None if self.first is None else now - self.last)
        if self.first is None and n:
            self.first = now
        self.last = now
        self.output_tokens += n
        self.text.append(out.text)
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.final = out
            self.finish(metrics, _reason(out.finish_reason), out.spec)

    def finish(self, metrics: ServerMetrics, reason: str, spec: dict) -> None:
        if self.done:
            return
        self.done = True
        metrics.finished(reason=reason, prompt_tokens=len(self.ids), output_tokens=self.output_tokens,
                         e2e_s=time.monotonic() - self.start,
                         ttft_s=None if self.first is None else self.first - self.start,
                         first_to_last_s=None if self.first is None else self.last - self.first, spec=spec)


def build_app(engine, model_name: str, chat_template: str | None = None,
              metrics: ServerMetrics | None = None, tool_parser: ToolParser | None = None,
              api_key: str | None = None) -> FastAPI:
    """The server's routes over `engine` (entered by the caller, which also closes it).
    `metrics`: the engine's tracer too, for the per-step spec-decode counters
    (`engine.set_tracer(metrics)`); without one, a fresh one counts requests only. `tool_parser`: finds the calls of
    `tool_choice: auto` (runtime/server/tool_parsers.py); without one, `auto` is refused. `api_key`: the routes
    under /v1 answer only requests with `Authorization: Bearer <api_key>` (a 401 otherwise), as vLLM's."""
    app = FastAPI(title="specsched", docs_url=None, redoc_url=None)
    metrics = metrics or ServerMetrics(model_name)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path.startswith("/v1") and not secrets.compare_digest(given, expected):
                return _error("a missing or wrong API key (Authorization: Bearer <key>)", 401, "authentication_error")
            return await call_next(request)

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(t: int) -> str:
        """A token's own text, a special token's named (as OpenAI lists them)."""
        return engine.tokenizer.decode([t], skip_special_tokens=False)

    def logprobs_of(c: _Choice, lps: list | None, chat: bool, prompt: list | None = None) -> dict | None:
        """OpenAI's `logprobs` of a choice's tokens `lps` (TokenLogprob each): chat's `content` list, or the
        completions API's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, after the prompt's with echo
        (`prompt`: per prompt token a TokenLogprob, None for the first, which has none)."""
        if lps is None:
            return None
        if prompt is not None:  # the prompt's token ids: its first has no TokenLogprob
            prompt = [SimpleNamespace(token_id=c.ids[0], logprob=None, top=None), *prompt[1:]]
            lps = prompt + lps
        if chat:
            def entry(t: int, lp: float) -> dict:
                s = token_text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            return {"content": [entry(x.token_id, x.logprob) | {"top_logprobs": [entry(i, v) for i, v in x.top]}
                                for x in lps]}
        tokens, offsets = [token_text(x.token_id) for x in lps], []
        for s in tokens:
            offsets.append(c.offset)
            c.offset += len(s)
        top = [None if x.top is None else {token_text(i): v for i, v in x.top} | {s: x.logprob}
               for s, x in zip(tokens, lps)]
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps], "top_logprobs": top,
                "text_offset": offsets}

    async def parse(request: Request, model: type):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, _error(f"the body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return None, _error("the body must be a JSON object")
        try:
            req = model.model_validate(body, context={"tool_parser": tool_parser is not None})
        except ValidationError as e:
            return None, _error(_validation_message(e))
        if req.model is not None and req.model != model_name:
            return None, _error(f"The model `{req.model}` does not exist (this server serves `{model_name}`).",
                                404, "NotFoundError", "model")
        return req, None

    def encode(prompt, add_special_tokens: bool | None) -> list[int]:
        """A completion's prompt as token ids: a text with the tokenizer's special tokens unless vLLM's
        `add_special_tokens` is false (as the engine encodes one); token ids as they are."""
        if not isinstance(prompt, str):
            return prompt
        return engine.tokenizer.encode(prompt, special_tokens=add_special_tokens is not False)

    def prepare(req, prompt, choice: int) -> tuple[list[int], SamplingParams]:
        prompt = encode(prompt, req.add_special_tokens)
        limit = req.token_limit() if isinstance(req, ChatCompletionRequest) else req.max_tokens
        if limit is None:  # the model's room after the prompt, so the prompt's length first
            prompt = engine.validate(prompt, SamplingParams(max_tokens=1))
            limit = max(engine.room(len(prompt)), 1)
        params = SamplingParams.make(max_tokens=limit, **req.sampling_kwargs(choice))
        return engine.validate(prompt, params), params

    async def respond(req, prompts: list, chat: bool):
        """The response to `req`: `req.n` choices per prompt, choice i * n + j the j-th sample of prompt i."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choices = []
        for i, prompt in enumerate(prompts):
            for j in range(req.n):
                try:
                    ids, params = prepare(req, prompt, j)
                except (InvalidRequestError, ValueError) as e:
                    return _error(f"prompt {i}: {e}" if len(prompts) > 1 else str(e))
                k = len(choices)
                choices.append(_Choice(k, rid if len(prompts) * req.n == 1 else f"{rid}-{k}", ids, params,
                                       tool_call=req.tool_call() if chat else None,
                                       one_call=chat and req.parallel_tool_calls is False))
                if getattr(req, "echo", False):
                    choices[-1].echo = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)
        prompt_tokens = sum(len(c.ids) for c in choices[:: req.n])  # each prompt once, as OpenAI counts them
        created = int(time.time())
        if req.stream:
            opts = req.stream_options
            include_usage = bool(opts and opts.include_usage)
            return StreamingResponse(_stream(rid, created, choices, prompt_tokens, chat, include_usage,
                                             include_usage and opts.continuous_usage_stats),
                                     media_type="text/event-stream")
        try:
            async with aclosing(_outputs(choices)) as outs:
                async for c, out in outs:
                    c.chunk(metrics, out)
        finally:
            for c in choices:  # an engine that stopped under it: the unfinished ones were aborted
                c.finish(metrics, "abort", {})
        failed = next((c.final for c in choices if c.final.finish_reason == "error"), None)
        if failed is not None:
            return _error(f"the request failed: {failed.error}", 500, "internal_server_error")
        body = []
        for c in choices:
            choice: dict[str, Any] = {"index": c.index, "finish_reason": _reason(c.final.finish_reason),
                                      "logprobs": logprobs_of(c, None if c.final.logprobs is None else c.logprobs, chat,
                                                              c.prompt_logprobs)}
            if chat:
                choice["message"] = chat_message("".join(c.text), c.tool_call, tool_parser, c.one_call)
                choice["finish_reason"] = chat_reason(choice["finish_reason"], c.tool_call, choice["message"])
            else:
                choice["text"] = (c.echo or "") + "".join(c.text)
            body.append(choice)
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model_name, "choices": body,
            "usage": _usage(prompt_tokens, sum(c.output_tokens for c in choices)),
            "spec_decode": _spec(*(c.final.spec for c in choices))})

    async def _outputs(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, Any]]:
        """Every choice's outputs as they come, (choice, RequestOutput); closing it aborts the unfinished requests
        (`generate` aborts its request when closed or cancelled)."""
        if len(choices) == 1:
            c = choices[0]
            async with aclosing(engine.generate(c.ids, c.params, request_id=c.request_id)) as outs:
                async for out in outs:
                    yield c, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for out in engine.generate(c.ids, c.params, request_id=c.request_id):
                    queue.put_nowait((c, out))
            except Exception as e:  # noqa: BLE001 - handed to the response, which fails with it
                queue.put_nowait((c, e))
            queue.put_nowait((c, None))  # its stream ended

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            for _ in range(len(choices)):
                while True:
                    c, out = await queue.get()
                    if out is None:
                        break
                    if isinstance(out, Exception):
                        raise out
                    yield c, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(rid: str, created: int, choices: list[_Choice], prompt_tokens: int, chat: bool,
                      include_usage: bool, continuous_usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def usage() -> dict:
            return _usage(prompt_tokens, sum(c.output_tokens for c in choices))

        def event(choice_list: list, **extra) -> bytes:
            payload = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choice_list,
                       **extra}
            if continuous_usage and choice_list:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                payload["usage"] = usage()
            return b"data: " + orjson.dumps(payload) + b"\n\n"

        def choice(c: _Choice, out, finish: str | None) -> dict:
            lps = logprobs_of(c, out.logprobs, chat, out.prompt_logprobs)
            if c.tool_call == "auto" and finish is None:  # the content that cannot begin a call yet
                text = "".join(c.text)
                end = tool_parser.content_end(text)
                delta, c.sent = ({"content": text[c.sent:end]} if end > c.sent else {}), max(c.sent, end)
                return {"index": c.index, "delta": delta, "finish_reason": None, "logprobs": None}
            if c.tool_call is not None:  # held back until the call is whole: its message (the rest) in one delta
                delta = chat_message("".join(c.text), c.tool_call, tool_parser, c.one_call)
                del delta["role"]
                finish = chat_reason(finish, c.tool_call, delta)
                if delta.get("tool_calls"):
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(delta["tool_calls"])]
                if delta["content"] is not None:
                    delta["content"] = delta["content"][c.sent:]
                lps = logprobs_of(c, None if out.logprobs is None else c.logprobs, chat)
                return {"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": lps}
            if chat:
                return {"index": c.index, "delta": {"content": out.text} if out.text else {}, "finish_reason": finish,
                        "logprobs": lps}
            text, c.echo = (c.echo or "") + out.text, None  # the first chunk carries the echoed prompt
            return {"index": c.index, "text": text, "finish_reason": finish, "logprobs": lps}

        if chat:
            for c in choices:
                yield event([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None, "logprobs": None}])
        try:
            async with aclosing(_outputs(choices)) as outs:
                async for c, out in outs:
                    c.chunk(metrics, out)
                    if not out.finished:  # the finished output's text goes with its reason
                        if c.tool_call is None and (out.text or out.logprobs or c.echo):  # tokens that make no text yet still have logprobs
                            yield event([choice(c, out, None)])
                        elif c.tool_call == "auto" and out.text:
                            part = choice(c, out, None)
                            if part["delta"]:
                                yield event([part])
                    elif out.finish_reason == "error":
                        yield b"data: " + orjson.dumps(error_body(f"the request failed: {out.error}",
                                                                  "internal_server_error", None, 500)) + b"\n\n"
                        break
                    else:
                        yield event([choice(c, out, _reason(out.finish_reason))], spec_decode=_spec(out.spec))
                else:
                    if include_usage:
                        yield event([], usage=usage())
        finally:
            for c in choices:  # the client went away, or another choice failed: `_outputs` aborted the rest
                c.finish(metrics, "abort", {})
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, err = await parse(request, CompletionRequest)
        if err is not None:
            return err
        return await respond(req, req.prompts(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, err = await parse(request, ChatCompletionRequest)
        if err is not None:
            return err
        prompt, err = prompt_of(req)
        if err is not None:
            return err
        return await respond(req, [prompt], chat=True)

    def prompt_of(req) -> tuple[list[int] | None, Any]:
        """A chat's prompt as token ids (`chat.chat_prompt`), or the error response."""
        try:
            return chat_prompt(engine.tokenizer, chat_template, req), None
        except ValueError as e:
            return None, _error(str(e), param="messages")
        except Exception as e:  # noqa: BLE001 - a template error is the server's, and this request's alone
            return None, _error(f"the chat template failed: {type(e).__name__}: {e}", 500, "internal_server_error")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: a prompt's token ids as the completion or chat endpoint would encode it."""
        req, err = await parse(request, TokenizeRequest)
        if err is not None:
            return err
        if req.messages is not None:
            ids, err = prompt_of(req)
            if err is not None:
                return err
        else:
            ids = encode(req.prompt, req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [engine.tokenizer.token(t) for t in ids]
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: token ids' text."""
        req, err = await parse(request, DetokenizeRequest)
        if err is not None:
            return err
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            return _error(f"token ids outside the vocabulary: {bad[:5]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "specsched", "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if not engine.is_running():
            return _error("the engine is not running", 503, "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(engine), media_type=CONTENT_TYPE_LATEST)

    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as of

    try:
        return of("specsched")
    except PackageNotFoundError:  # run from a checkout without installing it
        return "unknown"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _spec(*specs: dict) -> dict | None:
    """The speculative statistics of a choice, or summed over a response's choices (a specsched extension)."""
    specs = tuple(s for s in specs if s and s.get("drafts"))
    if not specs:
        return None
    total = {k: sum(s[k] for s in specs) for k in ("drafts", "drafted_tokens", "accepted_tokens")}
    per_pos = [0] * max(len(s["accepted_per_pos"]) for s in specs)
    for s in specs:
        for k, a in enumerate(s["accepted_per_pos"]):
            per_pos[k] += a
    return {**total, "mean_accept_len": 1.0 + total["accepted_tokens"] / total["drafts"], "accepted_per_pos": per_pos}
