"""The OpenAI-compatible routes over one running AsyncEngine (`build_app`), and `serve`.

Every request is one `engine.generate` stream: a client that disconnects mid-stream cancels its
response, whose `finally` aborts the request (its pages are freed at the next step); a request
that fails is a 500 (or an error event in its stream) for that request alone.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from specsched.runtime.server.metrics import ServerMetrics
from specsched.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.sampling_params import SamplingParams

PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"  # each message; then "assistant:" opens the reply


def render_chat(messages, template: str | None) -> str:
    """The prompt of a chat: the tokenizer's chat template (Jinja, as transformers renders it) when
    the model ships one, else each message as "role: content" on its own line, then "assistant:"."""
    if template is not None:
        import jinja2.sandbox

        def raise_exception(message: str):  # what Hugging Face templates call on a conversation they refuse
            raise ValueError(f"the chat template refuses these messages: {message}")

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template).render(messages=[{"role": m.role, "content": m.text()} for m in messages],
                                                add_generation_prompt=True, bos_token="", eos_token="")
    return "".join(PLAIN_CHAT_TEMPLATE.format(role=m.role, content=m.text()) for m in messages) + "assistant:"


def chat_template_of(model_dir: str | Path) -> str | None:
    """The `chat_template` of a checkpoint's tokenizer_config.json (None when it has none)."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    return template if isinstance(template, str) else None


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


class _Run:
    """One request's bookkeeping for the metrics: arrival, first and last token."""

    def __init__(self, prompt_tokens: int) -> None:
        self.start = self.last = time.monotonic()
        self.first: float | None = None
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0

    def chunk(self, metrics: ServerMetrics, n: int) -> None:
        now = time.monotonic()
        metrics.tokens(n, None if self.first is None else now - self.last)
        if self.first is None and n:
            self.first = now
        self.last = now
        self.output_tokens += n

    def done(self, metrics: ServerMetrics, reason: str, spec: dict) -> None:
        metrics.finished(reason=reason, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
                         e2e_s=time.monotonic() - self.start,
                         ttft_s=None if self.first is None else self.first - self.start,
                         first_to_last_s=None if self.first is None else self.last - self.first, spec=spec)


def build_app(engine, model_name: str, chat_template: str | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The server's routes over `engine` (entered by the caller, which also closes it).
    `metrics`: the engine's tracer too, for the per-step spec-decode counters
    (`engine.set_tracer(metrics)`); without one, a fresh one counts requests only."""
    app = FastAPI(title="specsched", docs_url=None, redoc_url=None)
    metrics = metrics or ServerMetrics(model_name)

    async def parse(request: Request, model: type):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, _error(f"the body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return None, _error("the body must be a JSON object")
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            return None, _error(_validation_message(e))
        if req.model is not None and req.model != model_name:
            return None, _error(f"The model `{req.model}` does not exist (this server serves `{model_name}`).",
                                404, "NotFoundError", "model")
        return req, None

    def prepare(req, prompt) -> tuple[list[int], SamplingParams]:
        limit = req.token_limit() if isinstance(req, ChatCompletionRequest) else req.max_tokens
        if limit is None:  # the model's room after the prompt, so the prompt's length first
            prompt = engine.validate(prompt, SamplingParams(max_tokens=1))
            limit = max(engine.max_model_len - len(prompt), 1)
        params = SamplingParams.make(max_tokens=limit, **req.sampling_kwargs())
        return engine.validate(prompt, params), params

    async def respond(req, prompt, chat: bool):
        try:
            ids, params = prepare(req, prompt)
        except (InvalidRequestError, ValueError) as e:
            return _error(str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        run = _Run(len(ids))
        if req.stream:
            opts = req.stream_options
            include_usage = bool(opts and opts.include_usage)
            return StreamingResponse(_stream(rid, created, ids, params, run, chat, include_usage,
                                             include_usage and opts.continuous_usage_stats),
                                     media_type="text/event-stream")
        text, last = [], None
        async for out in engine.generate(ids, params, request_id=rid):
            run.chunk(metrics, len(out.token_ids))
            text.append(out.text)
            last = out
        run.done(metrics, _reason(last.finish_reason), last.spec)
        if last.finish_reason == "error":
            return _error(f"the request failed: {last.error}", 500, "internal_server_error")
        body = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _reason(last.finish_reason), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": body}
        else:
            choice["text"] = body
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model_name, "choices": [choice], "usage": _usage(len(ids), run.output_tokens),
            "spec_decode": _spec(last.spec)})

    async def _stream(rid: str, created: int, ids: list[int], params: SamplingParams, run: _Run, chat: bool,
                      include_usage: bool, continuous_usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, **extra) -> bytes:
            payload = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices, **extra}
            if continuous_usage and choices:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                payload["usage"] = _usage(len(ids), run.output_tokens)
            return b"data: " + orjson.dumps(payload) + b"\n\n"

        def choice(text: str, finish: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish,
                        "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if chat:
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None}])
        last = None
        try:
            async for out in engine.generate(ids, params, request_id=rid):
                run.chunk(metrics, len(out.token_ids))
                last = out
                if out.text and not out.finished:  # the finished output's text goes with its reason
                    yield event([choice(out.text, None)])
        finally:
            if last is None or not last.finished:  # the client went away: `generate` aborted it
                run.done(metrics, "abort", {})
        run.done(metrics, _reason(last.finish_reason), last.spec)
        if last.finish_reason == "error":
            yield b"data: " + orjson.dumps(error_body(f"the request failed: {last.error}", "internal_server_error",
                                                      None, 500)) + b"\n\n"
        else:
            yield event([choice(last.text, _reason(last.finish_reason))], spec_decode=_spec(last.spec))
            if include_usage:
                yield event([], usage=_usage(len(ids), run.output_tokens))
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, err = await parse(request, CompletionRequest)
        if err is not None:
            return err
        try:
            prompt = req.single_prompt()
        except ValueError as e:
            return _error(str(e), param="prompt")
        return await respond(req, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, err = await parse(request, ChatCompletionRequest)
        if err is not None:
            return err
        try:
            prompt = render_chat(req.messages, chat_template)
        except ValueError as e:
            return _error(str(e), param="messages")
        except Exception as e:  # noqa: BLE001 - a template error is the server's, and this request's alone
            return _error(f"the chat template failed: {type(e).__name__}: {e}", 500, "internal_server_error")
        return await respond(req, prompt, chat=True)

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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _spec(spec: dict) -> dict | None:
    """The per-request speculative statistics (a specsched extension of the response)."""
    if not spec or not spec.get("drafts"):
        return None
    return {k: spec[k] for k in ("drafts", "drafted_tokens", "accepted_tokens", "mean_accept_len",
                                 "accepted_per_pos")}
