"""Replay: the engine's own pipeline on a virtual clock and device, driven by a trace.

Why: a captured trace gives the workload (arrivals, prompt and output lengths, sampling),
the acceptance data and, through `fit_profile`, the costs. Replaying it under another
schedule, draft length or arrival rate answers "what would happen" in a fraction of a second,
and the result is a trace in the same format, so `stats`, `timeline` and `export` work on it.
"""
from __future__ import annotations

import asyncio
import gc
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import anyio

from specsched.scheduler.run_config import WARMUP_ID, RunConfig, warmup_params
from specsched.scheduler.errors import ConfigurationError, InvalidRequestError
from specsched.scheduler.proposer import ProposerSpec, validate_combination
from specsched.scheduler.schedules import schedule_rules
from specsched.scheduler.wiring import NATURAL_SCHEDULE, build_pipeline
from specsched.simulator.follow import follow_choices, recorded_choices
from specsched.scheduler.request import Request
from specsched.scheduler.sampling_params import SamplingParams
from specsched.simulator.acceptance import AcceptanceModel
from specsched.simulator.costs import CostProfile, StageModel, host_key
from specsched.simulator.device import VirtualDevice
from specsched.simulator.responder import TraceResponder
from specsched.simulator.vtime import VirtualClock, run_virtual
from specsched.traces.metrics import compute_metrics
from specsched.traces.recorder import MemoryRecorder
from specsched.traces.names import PROPOSERS, schedule_name
from specsched.traces.schema import Header, Trace

# engine settings a replay may change (what-ifs on the scheduler: seats, token budget, KV pool)
ENGINE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "num_pages", "page_size", "tree_top_k", "tree_max_nodes")


@dataclass
class ReplayConfig:
    schedule: str | None = None  # None = the trace's
    proposer: str | None = None
    draft_len: int | str | None = None  # a fixed D, "auto" (chosen per step), None = the trace's
    max_draft_len: int | None = None  # with "auto": the longest D (None: the trace's, else 4)
    acceptance: str = "trace"  # trace | rates | bernoulli:ALPHA | synthetic (the trace's) | synthetic:AL | synthetic:r1,r2,...
    rate_scale: float = 1.0  # open loop: arrival rate multiplier
    concurrency: int | None = None  # closed loop; None = the trace's
    seed: int = 0
    engine_overrides: dict = field(default_factory=dict)
    # an adaptive draft length starts where the captured run's stood when recording began
    # (the trace header's `draft_policy`), if the replay keeps its proposer and longest D; else
    # where an engine's stands when it serves: after its start-up warm-up request (unless the
    # captured engine skipped it). False: from nothing
    policy_state: bool = True
    # an adaptive draft length takes each step's D from the captured run (simulator/follow.py)
    follow_choices: bool = False

    def __post_init__(self) -> None:
        if not (self.rate_scale > 0 and math.isfinite(self.rate_scale)):
            raise ValueError(f"rate_scale must be a finite number > 0, got {self.rate_scale}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.draft_len is not None and self.draft_len != "auto" and (
                not isinstance(self.draft_len, int) or self.draft_len < 0):
            raise ValueError(f"draft_len must be an integer >= 0 or 'auto', got {self.draft_len!r}")
        if self.max_draft_len is not None and self.max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {self.max_draft_len}")
        if self.proposer is not None and self.proposer not in PROPOSERS:
            raise ValueError(f"unknown proposer {self.proposer!r}; choose one of {PROPOSERS}")
        if self.schedule is not None:
            schedule_rules(self.schedule)  # ValueError naming the schedules
            self.schedule = schedule_name(self.schedule)
        for k, v in self.engine_overrides.items():
            if k not in ENGINE_KNOBS:
                raise ValueError(f"unknown engine setting {k!r}; a replay can change {ENGINE_KNOBS}")
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"engine setting {k} must be a positive integer, got {v!r}")


class WorkloadItem(NamedTuple):
    """One request of a replayed workload (a tuple: a large workload has many)."""

    prompt_len: int
    output_len: int
    arrival_ns: int  # offset from the first arrival
    params: SamplingParams


def workload_from_trace(trace: Trace) -> list[WorkloadItem]:
    fin = {f.request_id: f for f in trace.finishes}
    reqs = sorted(trace.requests, key=lambda r: r.arrival_ns)
    if not reqs:
        raise ValueError(f"{trace.path or 'trace'}: no request records to replay")
    t0 = reqs[0].arrival_ns
    items = []
    made: dict[tuple, SamplingParams] = {}  # SamplingParams are immutable: one per distinct set
    for r in reqs:
        f = fin.get(r.request_id)
        out_len = max(1, f.output_len if f is not None else r.max_tokens)
        rates = None if r.synthetic_acceptance_rates is None else tuple(r.synthetic_acceptance_rates)
        key = (out_len, r.temperature, r.top_p, r.top_k, r.seed, r.synthetic_acceptance_length, rates)
        params = made.get(key)
        if params is None:  # (a request's own synthetic acceptance is kept for the replay's trace)
            params = made[key] = SamplingParams(max_tokens=out_len, temperature=r.temperature, top_p=r.top_p,
                                                top_k=r.top_k, seed=r.seed, ignore_eos=True,
                                                synthetic_acceptance_length=r.synthetic_acceptance_length,
                                                synthetic_acceptance_rates=r.synthetic_acceptance_rates)
        items.append(WorkloadItem(r.prompt_len, out_len, r.arrival_ns - t0, params))
    return items


class _Sink:
    """Where finishes go: an open-loop request's own waiter, or the closed loop's count of freed
    seats and its driver's wake-up. The replay's tokens are stand-ins, so the
    pipeline keeps counts, not token lists (`wants_token_ids`)."""

    wants_token_ids = False

    def __init__(self) -> None:
        self.done: dict[str, anyio.Event] = {}
        self.freed = 0  # closed-loop seats freed since the driver last woke
        self.wake: asyncio.Future | None = None

    def on_prompt_logprobs(self, req, first, logprobs) -> None:
        pass

    def on_tokens(self, req, token_ids, logprobs=None) -> None:
        pass

    def on_finish(self, req) -> None:
        ev = self.done.pop(req.request_id, None)
        if ev is not None:
            ev.set()
            return
        self.freed += 1
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)


class Resolved(NamedTuple):
    """What a replay runs: its proposer, schedule and D (the fixed one, or the longest an
    adaptive one may choose) and the engine configuration they make with the trace's."""

    proposer: str
    schedule: str
    draft_len: int
    config: RunConfig


def resolve(trace: Trace, cfg: ReplayConfig) -> Resolved:
    """The replay's proposer, schedule, D and engine configuration: the trace header's
    `engine_config` with the replay's changes, built and checked by `RunConfig` (its
    defaults fill what an older trace lacks). An adaptive draft length -- asked for, or the
    captured run's when the replay keeps its proposer and D -- is `draft_len: "auto"`, D then
    being the longest it may choose."""
    h = trace.header
    proposer = cfg.proposer or h.proposer
    captured_auto = h.engine_config.get("draft_len") == "auto" and proposer == h.proposer
    auto = cfg.draft_len == "auto" or (cfg.draft_len is None and captured_auto)
    if auto:
        draft_len = (cfg.max_draft_len or int(h.engine_config.get("max_draft_len") or 0) or max(h.draft_len, 0)
                     or RunConfig.model_fields["max_draft_len"].default)
    elif cfg.draft_len is not None:
        draft_len = cfg.draft_len
    elif proposer == "none":
        draft_len = 0
    elif h.draft_len >= 1:  # another proposer: the captured draft length unless one is given
        draft_len = h.draft_len
    else:
        raise ValueError(f"the trace decodes plainly: give a draft length for proposer {proposer!r}")
    schedule = cfg.schedule or h.schedule
    if cfg.proposer and cfg.proposer != h.proposer and not cfg.schedule:
        schedule = NATURAL_SCHEDULE[proposer]
    validate_combination(proposer, schedule, draft_len)
    changes = dict(cfg.engine_overrides, proposer=proposer, schedule=schedule, draft_len="auto" if auto else draft_len)
    if auto:
        changes["max_draft_len"] = draft_len
    if not (auto and captured_auto):
        # a what-if: the policy learns the costs as the engine would (a fixed D has no profile)
        changes["draft_profile"] = None
    if proposer == "none" and h.engine_config.get("acceptance") == "synthetic":
        # plain decoding accepts nothing: a synthetic trace's forced acceptance does not apply
        changes.update(acceptance="lossless", synthetic_acceptance_length=None, synthetic_acceptance_rates=None)
    try:
        config = RunConfig.from_header(h.engine_config, **changes)
    except ConfigurationError as e:
        raise ConfigurationError(f"{trace.path or 'trace'}: {e}") from None
    return Resolved(proposer, schedule, draft_len, config)


async def _replay(trace: Trace, profile: CostProfile, cfg: ReplayConfig, resolved: Resolved,
                  spec: ProposerSpec, items: list[WorkloadItem], acceptance: AcceptanceModel) -> Trace:
    c = resolved.config
    proposer, schedule = c.proposer, c.schedule
    responder = TraceResponder(profile, acceptance, [it.prompt_len for it in items])
    clock = VirtualClock()
    device = VirtualDevice(profile, responder, clock=clock)
    header = Header.create(source="simulator", clock="virtual_ns", model=trace.header.model,
                           draft_model=trace.header.draft_model, proposer=proposer, schedule=schedule,
                           draft_len=spec.draft_len, device={"kind": "virtual", "name": "replay"},
                           engine_config=c.model_dump(mode="json"),
                           extra={"replayed_from": trace.path, "acceptance": cfg.acceptance,
                                  "workload": trace.header.extra.get("workload", {})})
    rec = MemoryRecorder(header)
    sink = _Sink()
    pipe = build_pipeline(spec, schedule, num_pages=c.num_pages, page_size=c.page_size, max_num_seqs=c.max_num_seqs,
                          max_num_batched_tokens=c.max_num_batched_tokens,
                          device=device, clock=clock, sink=sink, tracer=rec, adaptive=c.adaptive,
                          # seeded as the captured run was: with a profile if it had one (this one)
                          seed_costs=profile.to_json() if c.draft_profile else None,
                          drafter=responder if spec.rules.host_drafts else None,
                          max_kept_tokens=c.max_kept_hidden_tokens, uniform_verify=bool(c.graph_sizes()))
    policy = pipe.policy if pipe.policy.adaptive else None
    captured = trace.header.extra.get("draft_policy")
    warm_up = policy is not None and cfg.policy_state and not c.skip_warmup
    if (policy is not None and captured and cfg.policy_state and proposer == trace.header.proposer
            and captured.get("max_draft_len") == policy.max_draft_len):
        policy.restore(captured)  # where the captured run's policy stood when recording began
        warm_up = False

    models: dict[str, StageModel | None] = {}  # stage -> its model, looked up once
    step_gap = profile.step_overhead_ns
    noisy = profile.noise_seed is not None

    def host_cost(name: str, attrs: dict) -> float:
        # the simulator prices ~10 host stages a step: the stage's model is looked up once,
        # and `host_ns` (which adds the replicate noise) runs only when there is noise
        if name == "step_gap":
            return step_gap
        key = host_key(name, attrs) if name == "plan" or name == "launch" else name
        try:
            m = models[key]
        except KeyError:
            m = models[key] = profile.host_model(key)
        if m is None:
            return 0.0
        return profile.host_ns(key, attrs, m) if noisy else m.price(attrs)

    pipe.launcher.host_cost = host_cost
    workload = trace.header.extra.get("workload", {})
    concurrency = cfg.concurrency or workload.get("concurrency")
    start = clock.now_ns()

    async def submit(i: int, it: WorkloadItem) -> None:
        ev = sink.done[f"r{i}"] = anyio.Event()
        add(i, it)
        await ev.wait()

    def add(i: int, it: WorkloadItem) -> None:
        pipe.add_request(Request(f"r{i}", [i] * it.prompt_len, it.params, arrival_ns=clock.now_ns()))

    async def closed_loop() -> None:
        """One client per seat, submitting the next item when its request finishes (items go
        to seats in order, as they free up). One task drives every seat: it wakes where the
        first of a step's finished seats would, and resubmits them in finish order, each after
        the client latency, as one task per seat would one after another."""
        loop = asyncio.get_running_loop()
        latency = int(profile.client_latency_ns)
        first = min(concurrency, len(items))
        for i in range(first):
            add(i, items[i])
        nxt, live = first, first
        while live:
            if not sink.freed:
                sink.wake = loop.create_future()
                await sink.wake
            freed, sink.freed = sink.freed, 0
            live -= freed
            for _ in range(freed):
                if nxt < len(items):
                    clock.advance_ns(latency)  # a seat freed: resubmitting
                    add(nxt, items[nxt])
                    nxt, live = nxt + 1, live + 1

    async def arrival(i: int, it: WorkloadItem) -> None:
        await clock.sleep_ns(int(start + it.arrival_ns / cfg.rate_scale - clock.now_ns()))
        await submit(i, it)

    async def engine_warm_up() -> None:
        """The engine's start-up warm-up (`AsyncEngine._warm_up`: its request id and sampling),
        untraced, with the first item's prompt length (a replay has no tokenizer for the
        engine's warm-up prompt) and at most its output length."""
        ev = sink.done[WARMUP_ID] = anyio.Event()
        params = warmup_params(items[0].output_len)
        async with pipe.warming_up():
            pipe.add_request(Request(WARMUP_ID, [0] * items[0].prompt_len, params, arrival_ns=clock.now_ns()))
            await ev.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(pipe.run)
        if warm_up:
            await engine_warm_up()
            start = clock.now_ns()  # arrivals are timed from after it
        if policy is not None:
            header.extra["draft_policy"] = policy.state()  # as an engine trace records it
            if cfg.follow_choices:
                follow_choices(policy, pipe.scheduler, recorded_choices(trace))
        async with anyio.create_task_group() as clients:
            if concurrency is None:  # open loop: each request at its arrival time
                for i, it in enumerate(items):
                    clients.start_soon(arrival, i, it)
            else:
                clients.start_soon(closed_loop)
        pipe.stop()
    rec.header.extra["stand_ins"] = device.stand_ins()
    device.close()
    return rec.to_trace(validate=False)


def check_profile(profile: CostProfile, spec: ProposerSpec) -> None:
    """Fail before the run when `profile` cannot price an op this configuration launches (a
    profile fitted on a plain trace has no draft op): a clear error, not one mid-replay."""
    needed = ["prefill"] + ((["verify"] if spec.rules.host_drafts else ["draft", "verify"]) if spec.speculative
                            else ["decode"])
    if spec.kv_model is not None:
        needed.append("fill")
    missing = [op for op in needed if profile.priced_as(op) is None]
    if missing:
        raise ValueError(f"the cost profile has no model for device op(s) {', '.join(missing)} (fitted: "
                         f"{', '.join(sorted(profile.device)) or 'none'}): replaying proposer {spec.kind!r} needs "
                         f"a profile fitted on a trace that ran it (capture one, or pass a profile fitted on one)")


def replay(trace: Trace, profile: CostProfile, cfg: ReplayConfig | None = None) -> tuple[dict, Trace]:
    """Replay `trace` under `cfg`; returns (metrics with the bench keys, simulated trace)."""
    cfg = cfg or ReplayConfig()
    items = workload_from_trace(trace)
    resolved = resolve(trace, cfg)
    proposer, _, draft_len, config = resolved
    spec = config.proposer_spec()  # the replay's proposer, as the engine builds it
    check_profile(profile, spec)
    same = proposer == trace.header.proposer and draft_len == trace.header.draft_len
    varying = config.adaptive or trace.header.engine_config.get("draft_len") == "auto"
    acceptance = AcceptanceModel.parse(cfg.acceptance, trace, seed=cfg.seed, captured_config=same,
                                       any_length=varying, max_accept=spec.max_accept)
    # The cyclic garbage collector is paused for the run: a replay allocates many short-lived
    # objects, and with a large trace in memory the collections it triggers scan that trace
    # again and again. The rest is collected later.
    paused = gc.isenabled()
    gc.disable()
    try:
        sim = run_virtual(lambda: _replay(trace, profile, cfg, resolved, spec, items, acceptance))
    except BaseExceptionGroup as eg:  # a request the configuration cannot serve (pool too small)
        bad = eg.subgroup(InvalidRequestError)
        if bad is None:
            raise
        while isinstance(bad, BaseExceptionGroup):
            bad = bad.exceptions[0]
        raise ValueError(f"this configuration cannot serve the workload: {bad}") from None
    finally:
        if paused:
            gc.enable()
    return compute_metrics(sim), sim
