"""AsyncEngine: the embedded API (`async for` over a request's outputs).

Why: users embed the engine in their own asyncio/anyio program. Each `generate` call adds a
request to the shared pipeline, so concurrent calls are batched together (continuous
batching); cancelling the consuming task or `abort(request_id)` aborts the request and
frees its pages. The pipeline's step loop hands each request its new token ids; the request's
consumer (the `generate` generator) detokenizes them and applies the stop strings, and a stop
string finishes the request through `Pipeline.stop_request`. The pipeline runs as a task of
the engine's task group; leaving the `async with` block finishes or aborts every request and
joins every task.
"""
from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from collections.abc import Sequence
from typing import AsyncIterator

import anyio
import numpy as np

from specsched.runtime.detokenize import Detokenizer
from specsched.runtime.outputs import (Finished, PromptLogprobs, RequestOutput, Stream, StreamSink, TokenLogprob,
                                      token_logprobs)
from specsched.runtime.engine_checks import check_engine
from specsched.runtime.engine_config import EngineConfig
from specsched.runtime.grammars import Grammars
from specsched.runtime.proposers.ngram import host_drafter
from specsched.scheduler.scheduler import SchedulerConfig, max_pages_needed
from specsched.scheduler.block_manager import KVPoolStats
from specsched.scheduler.run_config import WARMUP_ID, WARMUP_PROMPT, warmup_params
from specsched.scheduler.errors import EngineClosedError, InvalidRequestError
from specsched.scheduler.pipeline import Pipeline
from specsched.scheduler.protocols import DeviceError
from specsched.scheduler.proposer import RULES
from specsched.scheduler.request import Request
from specsched.scheduler.sampling_params import SamplingParams
from specsched.scheduler.wiring import build_pipeline, scheduler_config
from specsched.traces.hook import NULL_TRACER

log = logging.getLogger("specsched")


class MonotonicClock:
    """The real clock: system monotonic time, the base device timestamps use too."""

    def now_ns(self) -> int:
        return time.monotonic_ns()


def _token_ids(prompt: object) -> list[int]:
    """A prompt given as token ids, as a list of ints; InvalidRequestError naming the first
    element that is not an integer id. No coercion: int() would run 5.9 as 5, and True as 1.
    Python and numpy integers are ids; bools, floats, strings and None are not."""
    if (isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray))
            or getattr(prompt, "ndim", 1) != 1):
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise InvalidRequestError(
                f"prompt token id at index {i} is not an integer: {t!r} ({type(t).__name__})"
            )
        ids.append(int(t))
    return ids


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, *, tracer=None):
        self.config = config or EngineConfig()
        self.tracer = tracer or NULL_TRACER
        self._streams: dict[str, Stream] = {}
        self._ids = itertools.count()
        self._pipeline: Pipeline | None = None
        self._tg = None
        self._entered = False
        self._closed = False
        if self.config.model:
            self.model_dir = self._shape_or(self.config.model)
        else:
            from specsched.runtime import bundled

            self.model_dir = str(bundled.target_dir())
        setup = check_engine(self.config, self.model_dir, self._proposer_dir(), self._scheduler_config())
        self.tokenizer, self.max_model_len, self._seed_costs, self.vocab_size = setup
        self.grammars = Grammars(self.tokenizer)  # structured output's compiler (its vocabulary read at first use)

    # -- setup --------------------------------------------------------------------------------
    def _shape_or(self, path: str) -> str:
        """With dummy weights, a shipped shape's name (runtime/shapes) names its folder."""
        if self.config.load_format == "dummy" and not Path(path).exists():
            from specsched.runtime.shapes import shape_dir

            found = shape_dir(path)
            if found is not None:
                return str(found)
        return path

    def _proposer_dir(self) -> str | None:
        from specsched.runtime import bundled

        c = self.config
        option = RULES[c.proposer].checkpoint
        if option == "draft":
            return self._shape_or(c.draft) if c.draft else str(bundled.draft_dir())
        if option == "mtp_head":
            return self._shape_or(c.mtp_head) if c.mtp_head else str(bundled.mtp_dir())
        return None

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        return scheduler_config(c.proposer_spec(), max_num_seqs=c.max_num_seqs,
                                max_num_batched_tokens=c.max_num_batched_tokens)

    def worker_spec(self):
        from specsched.runtime.devices import WorkerSpec
        from specsched.runtime.worker_config import WorkerConfig

        config = WorkerConfig.from_engine(self.config, self.model_dir, self._proposer_dir())
        return WorkerSpec("specsched.runtime.worker:ModelWorker", {"config": config})

    async def __aenter__(self) -> "AsyncEngine":
        from specsched.runtime.devices import make_device

        if self._entered:
            # single-use, as anyio task groups are: a second start would orphan the first worker
            raise EngineClosedError(
                "this AsyncEngine was already entered" + (" and is closed" if self._closed else " and is running")
                + ": an engine serves one `async with` block; create a new AsyncEngine for another")
        self._entered = True
        c = self.config
        # shielded: the start's thread is never abandoned anyway; the shield only makes a
        # cancelled start still keep the device, so that it is closed (below, or by __aexit__)
        with anyio.CancelScope(shield=True):
            self.device = await anyio.to_thread.run_sync(
                lambda: make_device(c.device, self.worker_spec(), num_threads=c.worker_threads,
                                    **({"spin_ms": c.worker_spin_ms, "malloc": c.worker_malloc,
                                        "openmp": c.worker_openmp} if c.device == "host" else {}))
            )
        try:
            if c.device == "host":  # its worker process reports the native libraries and kernels it runs with
                libs = self.device.runtime_libs
                sizes = c.graph_sizes()
                shapes = f"at padded shapes ({sizes[0]}..{sizes[-1]} rows)" if sizes else "at their own shapes"
                ping = await anyio.to_thread.run_sync(self.device.call, "ping")
                log.info("worker pid %s: %d model thread(s), malloc %s, OpenMP %s, linears %s, attention %s, layer "
                         "ops %s, eager forwards %s", self.device.pid, c.worker_threads, libs["malloc"], libs["openmp"],
                         ping["linears"], ping["attention"], ping["ops"], shapes)
            spec = c.proposer_spec()
            self._pipeline = build_pipeline(
                spec, c.schedule, num_pages=c.num_pages, page_size=c.page_size,
                max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                device=self.device, clock=MonotonicClock(), sink=StreamSink(self), tracer=self.tracer,
                eos_token_ids=self.tokenizer.eos_token_ids, adaptive=c.adaptive, seed_costs=self._seed_costs,
                drafter=host_drafter(spec, c.ngram_min, c.ngram_max, self.grammars),
                max_kept_tokens=c.max_kept_hidden_tokens,
                uniform_verify=bool(c.graph_sizes()))
        except BaseException:
            # `async with` never calls __aexit__ when __aenter__ raises: without this the
            # worker process (holding the model's weights) would outlive the failed start
            self._pipeline = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.device.close)
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._pipeline.run)
        if not c.skip_warmup:
            try:
                await self._warm_up()
            except BaseException as e:
                await self.__aexit__(type(e), e, e.__traceback__)
                raise
        return self

    async def _warm_up(self) -> None:
        """One short greedy request through the pipeline before the engine serves, untraced,
        as vLLM and SGLang warm up before serving: the first launch of each device op pays
        one-off costs (allocations, kernel selection; on CUDA, library handles and FlashInfer's
        JIT compile), which no user request should, and a device that cannot serve fails the
        start rather than the first request (DeviceError). An adaptive draft length learns from
        it as from any request (its first launches, cold, teach it nothing)."""
        ids, params = self.tokenizer.encode(WARMUP_PROMPT) or [0], warmup_params()
        while True:  # shortened to what the model's positions and the page pool hold
            try:
                self.validate(ids, params)
                break
            except InvalidRequestError:
                if params.max_tokens > 1:
                    params = params.model_copy(update={"max_tokens": params.max_tokens // 2})
                elif len(ids) > 1:
                    ids = ids[: len(ids) // 2]
                else:
                    return  # not even one token: nothing to warm up with
        async with self._pipeline.warming_up():
            out = await self.generate_all(ids, params, request_id=WARMUP_ID)
        if out.finish_reason == "error":
            raise DeviceError("warmup", f"the engine's warm-up request failed: {out.error}")
        if self.config.device == "cuda" and self.config.graph_sizes():  # its shapes' graphs were captured
            got = await anyio.to_thread.run_sync(self.device.call, "ping")
            log.info("CUDA graphs: %d captured at start-up in %.2f s (capture sizes %s; a shape the "
                     "start did not run is captured at its first step)", got["cuda_graphs"], got["capture_s"],
                     ",".join(map(str, self.config.graph_sizes())))

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._closed = True
        if self._pipeline is not None:
            for rid in list(self._pipeline.requests):
                self._pipeline.abort(rid)
            self._pipeline.stop()
        # The user's own exception is not handed to the task group, which would wrap it in an
        # ExceptionGroup: the pipeline is stopped, the group joined, and the exception goes on
        # as itself. A cancellation is handed on, so the group sees it as anyio expects.
        cancelled = exc is not None and isinstance(exc, anyio.get_cancelled_exc_class())
        try:
            if cancelled:
                await self._tg.__aexit__(exc_type, exc, tb)
            else:
                await self._tg.__aexit__(None, None, None)
        finally:
            if self._pipeline is not None:
                self._pipeline.finish_abandoned()  # a cancelled pipeline left some unfinished
            with anyio.CancelScope(shield=True):  # a cancelled block still closes the worker
                await anyio.to_thread.run_sync(self.device.close)

    def num_unfinished_requests(self) -> int:
        """Requests queued or running (an aborted one counts until its pages are freed)."""
        return len(self._pipeline.requests) if self._pipeline is not None else 0

    def set_tracer(self, tracer) -> None:
        """Record from the next step on into `tracer` (a `specsched.traces.hook.Tracer`; e.g. a
        benchmark's recorder attached after its warm-up)."""
        self.tracer = tracer
        if self._pipeline is not None:
            self._pipeline.tracer = tracer

    def is_running(self) -> bool:
        """Started (`async with`) and not closed."""
        return self._pipeline is not None and not self._closed

    def queue_stats(self) -> dict[str, int]:
        """Requests running (holding a slot in the batch) and waiting to be admitted."""
        if self._pipeline is None:
            return {"running": 0, "waiting": 0}
        s = self._pipeline.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting)}

    def kv_stats(self) -> KVPoolStats:
        """The KV page pool now: pages total, free and used, per model and per request
        (read-only; a finished or aborted request holds none)."""
        if self._pipeline is None:
            raise EngineClosedError("engine has not started: kv_stats() needs `async with AsyncEngine(...)`")
        return self._pipeline.scheduler.kv_stats()

    def room(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt of this length may ask for: the model's positions after it and after the
        window a step computes past the last token (its drafts and the token after them)."""
        return self.max_model_len - num_prompt_tokens - self.config.proposer_spec().num_candidates - 1

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids if the request can be served, else InvalidRequestError saying
        why. A text prompt is encoded with the tokenizer's own special tokens (Llama's BOS), as transformers and
        vLLM encode one; token ids are taken as they are. Needs no running device: workloads are checked with it before a run starts
        (`specsched.runtime.workload.check_workload`)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("empty prompt")
            ids = self.tokenizer.encode(prompt, special_tokens=True)  # as transformers and vLLM: Llama's BOS
        else:
            ids = _token_ids(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids outside the vocabulary: {bad[:5]}")
        if not ids:
            raise InvalidRequestError("empty prompt")
        if params.structured_outputs is not None:  # compiled here first: a grammar the vocabulary cannot follow
            self.grammars.index(params.structured_outputs.pattern)
        bad = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias names token ids outside the vocabulary ({self.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens is longer than the model allows ({self.max_model_len - 1})"
            )
        c = self.config
        if params.max_tokens > self.room(len(ids)):
            window = c.proposer_spec().num_candidates + 1
            raise InvalidRequestError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) + a step's window ({window}) exceeds the "
                f"model's {self.max_model_len} positions"
            )
        own = params.synthetic()
        if own is not None and c.proposer_spec().speculative:  # (plain decoding accepts nothing: no effect)
            if c.acceptance != "synthetic":
                raise InvalidRequestError("synthetic_acceptance_length / _rates need an engine with acceptance "
                                          f"'synthetic' and an engine-wide length or rates (this one's is "
                                          f"{c.acceptance!r})")
            try:
                own.check(c.proposer_spec().max_accept)
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
        pages = max_pages_needed(self._scheduler_config(), c.page_size, len(ids), params.max_tokens)
        if pages > c.num_pages:
            raise InvalidRequestError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) may need {pages} KV pages "
                f"of {c.page_size} tokens, the pool has num_pages {c.num_pages}")
        return ids

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        if self._closed or self._pipeline is None:
            raise EngineClosedError("engine is not running (use `async with AsyncEngine(...)`)")
        params = params or SamplingParams()
        shipped = None  # a large grammar compiles off the event loop (validate finds it), and once
        if params.structured_outputs is not None:
            shipped = await anyio.to_thread.run_sync(self.grammars.for_worker, params.structured_outputs.pattern)
        ids = self.validate(prompt, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        st = Stream()
        self._streams[rid] = st
        req = Request(rid, ids, params, arrival_ns=time.monotonic_ns())
        req.grammar_index = shipped  # the worker takes the automaton with the request instead of compiling it
        self._pipeline.add_request(req)
        # This consumer detokenizes and applies the stop strings, off the pipeline's step loop.
        detok = Detokenizer(self.tokenizer, params.include_stop_str_in_output)
        stop_ids = frozenset(params.stop_token_ids)
        # prompt token index -> TokenLogprob, until the first output carries them (a recomputed prompt scores again)
        scored: dict[int, TokenLogprob] | None = None if params.prompt_logprobs is None else {}

        def prompt_logprobs() -> list[TokenLogprob | None] | None:
            nonlocal scored
            if scored is None:
                return None
            out, scored = [None] + [scored.get(j) for j in range(1, len(ids))], None
            return out

        kept = 0  # output tokens streamed so far
        stopped = False
        try:
            while True:
                while st.items:
                    item = st.items.popleft()
                    if isinstance(item, PromptLogprobs):
                        if scored is not None:
                            first = item.first
                            for j, lp in enumerate(token_logprobs(ids[first : first + len(item.logprobs[0])],
                                                                   item.logprobs)):
                                scored[first + j] = lp
                        continue
                    if isinstance(item, Finished):
                        yield RequestOutput(rid, [], detok.flush(), True, item.reason, item.error,
                                            item.num_output_tokens, item.spec,
                                            None if params.logprobs is None else [], prompt_logprobs())
                        return
                    new = item.token_ids
                    at = next((j for j, t in enumerate(new) if t in stop_ids), None) if stop_ids else None
                    keep, reason, text = detok.add(new if at is None else new[: at + 1], params.stop)
                    if at is not None and reason is None:  # a stop token id, kept: the text held back too
                        reason, text = "stop", text + detok.flush()
                    kept += keep
                    if reason is not None:  # a stop string or token: the request ends at its last token
                        stopped = True
                        self._pipeline.stop_request(rid, kept)
                        yield RequestOutput(rid, item.token_ids[:keep], text, True, reason, None,
                                            kept, req.spec_stats(), token_logprobs(item.token_ids[:keep], item.logprobs),
                                            prompt_logprobs())
                        return
                    if keep or text:
                        yield RequestOutput(rid, item.token_ids[:keep], text, num_output_tokens=kept,
                                            logprobs=token_logprobs(item.token_ids[:keep], item.logprobs),
                                            prompt_logprobs=prompt_logprobs())
                st.event = anyio.Event()
                if st.items:
                    continue
                await st.event.wait()
        finally:
            self._streams.pop(rid, None)
            if self._pipeline is not None and not stopped:
                self._pipeline.abort(rid)

    def abort(self, request_id: str) -> bool:
        return self._pipeline is not None and self._pipeline.abort(request_id)

    async def generate_all(self, prompt: str | list[int], params: SamplingParams | None = None,
                           *, request_id: str | None = None) -> RequestOutput:
        """Convenience: run one request to completion; one output with all tokens and text."""
        toks, text, lps, last, prompt_lps = [], [], [], None, None
        async for out in self.generate(prompt, params, request_id=request_id):
            toks += out.token_ids
            text.append(out.text)
            lps += out.logprobs or []
            prompt_lps = prompt_lps or out.prompt_logprobs
            last = out
        return RequestOutput(last.request_id, toks, "".join(text), True, last.finish_reason,
                             last.error, len(toks), last.spec, None if last.logprobs is None else lps, prompt_lps)
