"""Run a workload through an AsyncEngine and measure it from its own trace.

Why: `bench --json`, `stats TRACE --json` and the simulator report the same keys because
they share `specsched.traces.metrics.compute_metrics`; the bench simply records a trace in memory
(and optionally to a file) and computes its numbers from it.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import anyio

from specsched.runtime.engine import AsyncEngine
from specsched.runtime.engine_config import EngineConfig
from specsched.runtime.workload import WorkItem
from specsched.scheduler.messages import AgreementMessage
from specsched.scheduler.proposer import RULES
from specsched.traces.hook import MultiTracer
from specsched.traces.metrics import compute_metrics
from specsched.traces.recorder import MemoryRecorder, TraceRecorder, write_trace
from specsched.traces.schema import Header


def model_label(path: str | None) -> str | None:
    """How a checkpoint is named in a trace: bundled models by their bundle name (no machine
    path ever lands in a trace), others by the path the user gave."""
    if path is None:
        return None
    from pathlib import Path

    from specsched.runtime import bundled

    p = Path(path).resolve()
    try:
        return "bundled/" + str(p.relative_to(bundled.BUNDLED_DIR))
    except ValueError:
        return str(path)


def make_header(config: EngineConfig, engine: AsyncEngine, device_name: str | None = None,
                workload: dict | None = None) -> Header:
    extra: dict = {"workload": workload or {}}
    policy = engine._pipeline.policy if engine._pipeline is not None else None
    if policy is not None and policy.adaptive:
        # what the adaptive draft length has learned (e.g. in a warm-up) when recording
        # starts: a replay of the trace starts its policy from it
        extra["draft_policy"] = policy.state()
    return Header.create(
        source="engine", clock="monotonic_ns", model=model_label(engine.model_dir),
        draft_model=model_label(engine._proposer_dir()), proposer=config.proposer, schedule=config.schedule,
        draft_len=config.longest_draft_len, device={"kind": config.device, "name": device_name or config.device},
        engine_config=config.model_dump(mode="json"), extra=extra,
    )


async def run_workload(
    config: EngineConfig,
    items: list[WorkItem],
    *,
    concurrency: int | None = None,
    rate_qps: float | None = None,
    warmup: int = 0,
    trace_path: str | None = None,
    agreement: bool = True,
    record: bool = True,
    otlp: str | bool | None = None,
    on_done: Callable[[], None] | None = None,
    engine_factory: Callable[[EngineConfig], AsyncEngine] = AsyncEngine,
) -> tuple[dict, object, list]:
    """Returns (metrics, trace, outputs). Closed loop with `concurrency` in flight, or
    open loop at `rate_qps` (Poisson-free: evenly spaced) / the items' own arrival_s.
    record=False runs without any tracer (to measure tracing overhead); metrics then hold only
    wall-clock duration, output tokens and steps. `otlp` exports spans live over OTLP/HTTP:
    a URL, or True to use the standard OTEL_EXPORTER_OTLP_* variables; None enables it when
    OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set.
    `engine_factory` builds the engine from the config (an AsyncEngine subclass, e.g. one
    whose worker is paced)."""
    engine = engine_factory(config)
    outputs: list = [None] * len(items)
    live = streamed = None
    try:
        async with engine:
            if warmup:
                for it in items[:warmup]:
                    await engine.generate_all(it.prompt, it.params)
            header = make_header(config, engine, workload={"concurrency": concurrency, "rate_qps": rate_qps})
            mem = MemoryRecorder(header)
            if record:
                from specsched.traces.otel_export import live_tracer

                live = live_tracer(header, otlp)
            if record and trace_path:
                # streamed as the run goes (whole lines, flushed every step): an interrupted
                # or crashed run leaves a file readable to its last record
                streamed = TraceRecorder(trace_path, header)
            if record:
                tracer = MultiTracer(mem, *([live] if live else []), *([streamed] if streamed else []))
                engine.set_tracer(tracer)
            steps0 = engine._pipeline.num_steps
            start = time.monotonic()
            sem = anyio.Semaphore(concurrency or len(items))

            async def one(i: int, it: WorkItem) -> None:
                if rate_qps or it.arrival_s is not None:
                    at = it.arrival_s if it.arrival_s is not None else i / rate_qps
                    await anyio.sleep(max(0.0, start + at - time.monotonic()))
                async with sem:
                    outputs[i] = await engine.generate_all(it.prompt, it.params, request_id=f"r{i}")
                if on_done:
                    on_done()

            async with anyio.create_task_group() as tg:
                for i, it in enumerate(items):
                    tg.start_soon(one, i, it)
            duration = time.monotonic() - start
            steps = engine._pipeline.num_steps - steps0
            if agreement and record and config.proposer != "none":
                await _record_agreement(engine, items, outputs, mem)
    finally:
        # the engine has aborted what was left, so the file ends with every request's finish
        if streamed is not None:
            streamed.close()
        if live is not None:
            live.close()  # bounded: a dead collector cannot hold the run
    if not record:
        toks = sum(len(o.token_ids) for o in outputs)
        return {"duration_s": duration, "output_tokens": toks, "steps": steps,
                "output_tokens_per_s": toks / duration}, None, outputs
    trace = mem.to_trace()
    if trace_path and any(f.agreement is not None for f in trace.finishes):
        # finish records carry the proposer's agreement only once every request is done (it
        # is computed then, so it never disturbs the measured timeline): the complete trace
        # replaces the streamed one, which holds the same records without it
        tmp = f"{trace_path}.tmp"
        write_trace(trace, tmp)
        os.replace(tmp, trace_path)
    return compute_metrics(trace), trace, outputs


async def _record_agreement(engine, items, outputs, mem) -> None:
    """Per-position greedy agreement of the proposer with each greedy output (trace replay)."""
    by_id = {}
    for i, (it, out) in enumerate(zip(items, outputs)):
        if out is None or not it.params.greedy:
            continue
        prompt = engine.validate(it.prompt, it.params)
        msg = AgreementMessage(prompt, list(out.token_ids))
        by_id[f"r{i}"] = (await engine.device.stream("draft").launch(msg.op, msg).wait()).agreement
    kind = RULES[engine.config.proposer].agreement
    for rec in mem.records:
        if isinstance(rec, dict) and rec.get("type") == "finish" and rec["request_id"] in by_id:
            rec["agreement"] = by_id[rec["request_id"]]
            rec["agreement_kind"] = kind
