"""AsyncEngine: the embedded API (`async for` over a request's outputs).

Why: users embed the engine in their own asyncio/anyio program. Each `generate` call adds a
request to the shared pipeline, so concurrent calls are batched together (continuous
batching); cancelling the consuming task or `abort(request_id)` aborts the request and
frees its pages. The pipeline runs as a task of the engine's task group; leaving the
`async with` block finishes or aborts every request and joins every task.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

import anyio

from runtime.engine_config import EngineConfig
from runtime.tokenizer import Tokenizer
from scheduler.batch_builder import BatchBuilder, SchedulerConfig
from scheduler.block_manager import BlockManager
from scheduler.errors import ConfigurationError, EngineClosedError, InvalidRequestError
from scheduler.pipeline import Pipeline, PipelineConfig
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from traces.hook import NULL_TRACER


class MonotonicClock:
    """The real clock: system monotonic time, the base device timestamps use too."""

    def now_ns(self) -> int:
        return time.monotonic_ns()

    async def sleep_ns(self, duration_ns: int) -> None:
        await anyio.sleep(duration_ns / 1e9)


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new tokens since the previous output
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_output_tokens: int = 0
    spec: dict = field(default_factory=dict)  # per-request speculative stats (on finish)


class _Stream:
    """Outputs of one request; bounded by max_tokens + 1 items by construction."""

    def __init__(self) -> None:
        self.items: deque[RequestOutput] = deque()
        self.event = anyio.Event()

    def push(self, out: RequestOutput) -> None:
        self.items.append(out)
        self.event.set()


class _Sink:
    def __init__(self, engine: "AsyncEngine"):
        self.engine = engine

    def on_tokens(self, req: Request, token_ids: list[int]) -> tuple[int, str | None]:
        st = self.engine._streams.get(req.request_id)
        detok = self.engine._detok.get(req.request_id)
        if detok is None:
            return len(token_ids), None
        keep, reason, text = detok.add(token_ids, req.params.stop)
        if st is not None and (keep or text):
            st.push(RequestOutput(req.request_id, token_ids[:keep], text,
                                  num_output_tokens=req.num_output_tokens + keep))
        return keep, reason

    def on_finish(self, req: Request) -> None:
        detok = self.engine._detok.pop(req.request_id, None)
        tail = detok.flush() if detok is not None and req.finish_reason != "stop" else ""
        st = self.engine._streams.get(req.request_id)
        if st is not None:
            st.push(RequestOutput(req.request_id, [], tail, True, req.finish_reason, req.error,
                                  req.num_output_tokens, req.spec_stats()))


class _Detokenizer:
    """Incremental detokenization with stop strings (text never includes the stop string)."""

    def __init__(self, tok: Tokenizer, prompt_ids: list[int]):
        self.tok = tok
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0

    def add(self, token_ids: list[int], stops: list[str]) -> tuple[int, str | None, str]:
        for j, t in enumerate(token_ids):
            self.ids.append(t)
            self.text = self.tok.decode(self.ids)
            for s in stops:
                k = self.text.find(s, max(0, self.emitted - len(s)))
                if k >= 0:
                    new = self.text[self.emitted:k]
                    self.emitted = k
                    return j + 1, "stop", new
        # hold back a trailing replacement char (an incomplete UTF-8 sequence) and any
        # suffix that could start a stop string
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        for s in stops:
            for n in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:n]):
                    safe = min(safe, len(self.text[:safe]) - n)
                    break
        new = self.text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return len(token_ids), None, new

    def flush(self) -> str:
        new = self.text[self.emitted:]
        self.emitted = len(self.text)
        return new


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, *, tracer=None):
        self.config = config or EngineConfig()
        self.tracer = tracer or NULL_TRACER
        self._streams: dict[str, _Stream] = {}
        self._detok: dict[str, _Detokenizer] = {}
        self._ids = itertools.count()
        self._pipeline: Pipeline | None = None
        self._tg = None
        self._closed = False
        if self.config.model:
            self.model_dir = self.config.model
        else:
            from runtime import bundled

            self.model_dir = str(bundled.target_dir())
        self.tokenizer = Tokenizer(self.model_dir)
        self._check_tokenizers()
        self.max_model_len = self._max_model_len()

    # -- setup --------------------------------------------------------------------------------
    def _proposer_dir(self) -> str | None:
        from runtime import bundled

        c = self.config
        if c.proposer == "draft":
            return c.draft or str(bundled.draft_dir())
        if c.proposer in ("mtp", "eagle"):
            return c.mtp_head or str(bundled.mtp_dir())
        return None

    def _check_tokenizers(self) -> None:
        if self.config.proposer != "draft":
            return
        d = self._proposer_dir()
        other = Tokenizer(d)
        if other.fingerprint() != self.tokenizer.fingerprint():
            raise ConfigurationError(
                f"draft {d} and target {self.model_dir} use different tokenizers; speculative "
                "decoding needs the same vocabulary"
            )

    def _max_model_len(self) -> int:
        from runtime.checkpoint import load_config

        return load_config(self.model_dir).max_position_embeddings

    def worker_spec(self):
        from runtime.devices import WorkerSpec

        c = self.config
        return WorkerSpec("runtime.worker:ModelWorker", {
            "model_dir": self.model_dir,
            "proposer_dir": self._proposer_dir(),
            "proposer": c.proposer_spec().__dict__ | {"tree_parents": list(c.proposer_spec().tree_parents)},
            "num_pages": c.num_pages,
            "page_size": c.page_size,
            "dtype": c.dtype,
            "attention": c.attention,
            "device": "cuda" if c.device == "cuda" else "cpu",
            "acceptance": c.acceptance,
            "threshold": c.threshold,
            "ngram": (c.ngram_min, c.ngram_max),
            "num_threads": c.worker_threads,
        })

    async def __aenter__(self) -> "AsyncEngine":
        from runtime.devices import make_device

        c = self.config
        self.device = await anyio.to_thread.run_sync(
            lambda: make_device(c.device, self.worker_spec(), num_threads=c.worker_threads)
        )
        spec = c.proposer_spec()
        blocks = BlockManager(c.num_pages, c.page_size,
                              ("target",) + ((spec.kv_model,) if spec.kv_model else ()))
        builder = BatchBuilder(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens,
                                               spec.num_candidates, spec.kv_model), blocks)
        self._pipeline = Pipeline(PipelineConfig(c.schedule, spec), builder, self.device,
                                  MonotonicClock(), _Sink(self), self.tracer,
                                  eos_token_ids=tuple(self.tokenizer.eos_token_ids))
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._pipeline.run)
        return self

    async def __aexit__(self, *exc) -> None:
        self._closed = True
        if self._pipeline is not None:
            for rid in list(self._pipeline.requests):
                self._pipeline.abort(rid)
            self._pipeline.stop()
        try:
            await self._tg.__aexit__(*exc)
        finally:
            await anyio.to_thread.run_sync(self.device.close)

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("empty prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids outside the vocabulary: {bad[:5]}")
        if not ids:
            raise InvalidRequestError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens is longer than the model allows ({self.max_model_len - 1})"
            )
        c = self.config
        if c.proposer == "eagle" and params.temperature > 0:
            raise InvalidRequestError(
                "the eagle (tree) proposer verifies greedily only: use temperature 0, or a linear "
                "proposer (draft, mtp, ngram) for sampling"
            )
        need = len(ids) + params.max_tokens + c.proposer_spec().num_candidates + 1
        if need > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"{self.max_model_len} positions"
            )
        if (need + c.page_size) // c.page_size * 2 > c.num_pages:
            raise InvalidRequestError(f"request needs more KV pages than the pool has ({c.num_pages})")
        return ids

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        if self._closed or self._pipeline is None:
            raise EngineClosedError("engine is not running (use `async with AsyncEngine(...)`)")
        params = params or SamplingParams()
        ids = self.validate(prompt, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        st = _Stream()
        self._streams[rid] = st
        self._detok[rid] = _Detokenizer(self.tokenizer, ids)
        req = Request(rid, ids, params, arrival_ns=time.monotonic_ns())
        self._pipeline.add_request(req)
        try:
            while True:
                while st.items:
                    out = st.items.popleft()
                    yield out
                    if out.finished:
                        return
                st.event = anyio.Event()
                if st.items:
                    continue
                await st.event.wait()
        finally:
            self._streams.pop(rid, None)
            if self._pipeline is not None:
                self._pipeline.abort(rid)

    def abort(self, request_id: str) -> bool:
        return self._pipeline is not None and self._pipeline.abort(request_id)

    async def generate_all(self, prompt: str | list[int], params: SamplingParams | None = None,
                           *, request_id: str | None = None) -> RequestOutput:
        """Convenience: run one request to completion; one output with all tokens and text."""
        toks, text, last = [], [], None
        async for out in self.generate(prompt, params, request_id=request_id):
            toks += out.token_ids
            text.append(out.text)
            last = out
        return RequestOutput(last.request_id, toks, "".join(text), True, last.finish_reason,
                             last.error, len(toks), last.spec)
