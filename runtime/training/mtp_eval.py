"""Measure a proposer through the real inference path: Pipeline + ModelWorker, in-process.

Why: MTP-head validation (and the losslessness tests) must go through the code that serves
requests -- the scheduler's pipeline planning KV and attention, the worker's forward /
draft / verify / fill ops, the paged head -- not a training-time proxy. A worker process is
not needed for that: `InlineDevice` executes each launch at once, in launch order, in this
process, which is a valid device (every stream is in order and dependencies are satisfied
trivially). `run_requests` drives a batch of prompts to completion under any schedule.
(A random tiny model family to serve in tests: runtime/training/tiny.py.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from specsched.runtime.engine import MonotonicClock
from specsched.runtime.proposers.ngram import host_drafter
from specsched.scheduler.plan import build_plan
from specsched.scheduler.protocols import DeviceError
from specsched.scheduler.request import Request
from specsched.scheduler.sampling_params import SamplingParams
from specsched.scheduler.pipeline import MAX_KEPT_TOKENS
from specsched.scheduler.wiring import NATURAL_SCHEDULE, build_pipeline


class _DoneEvent:
    def __init__(self, op: str, stream: str, result: Any, error: str | None, start_ns: int, end_ns: int):
        self.op, self.stream = op, stream
        self.start_ns, self.end_ns = start_ns, end_ns
        self._result, self._error = result, error

    def query(self) -> bool:
        return True

    def synchronize(self, timeout_s: float | None = None) -> Any:
        if self._error is not None:
            raise DeviceError(self.op, self._error)
        return self._result

    async def wait(self) -> Any:
        return self.synchronize()


class _InlineStream:
    def __init__(self, device: "InlineDevice", name: str):
        self.device, self.name = device, name

    def launch(self, op: str, batch: dict) -> _DoneEvent:
        t0 = time.monotonic_ns()
        try:
            result, error = self.device.worker.execute(op, batch), None
        except Exception as exc:  # noqa: BLE001 - reported at the waiter, like a real device
            if self.device.raise_errors:
                raise
            result, error = None, f"{type(exc).__name__}: {exc}"
        return _DoneEvent(op, self.name, result, error, t0, time.monotonic_ns())

    def wait_event(self, event) -> None:
        pass


class InlineDevice:
    """Runs a Worker's ops synchronously at launch (tests, offline evaluation)."""

    kind = "inline"
    needs_plans = True
    warm_first_launch = False

    def __init__(self, worker, name: str = "inline", raise_errors: bool = False):
        self.worker, self.name, self.raise_errors = worker, name, raise_errors

    def stream(self, name: str) -> _InlineStream:
        return _InlineStream(self, name)

    def close(self) -> None:
        pass


class _Sink:
    wants_token_ids = True

    def __init__(self) -> None:
        self.finished: dict[str, Request] = {}
        self.done = anyio.Event()
        self.expected = 0

    def on_prompt_logprobs(self, req: Request, first: int, logprobs: tuple) -> None:
        pass

    def on_tokens(self, req: Request, token_ids: list[int], logprobs: tuple | None = None) -> None:
        pass

    def on_finish(self, req: Request) -> None:
        self.finished[req.request_id] = req
        if len(self.finished) == self.expected:
            self.done.set()


def run_requests(worker, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], *,
                 schedule: str | None = None, num_pages: int = 512, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, adaptive: bool = False,
                 pipelines: list | None = None, max_kept_tokens: int = MAX_KEPT_TOKENS,
                 policy=None, tracer=None) -> list[Request]:
    """Serve `prompts` (token ids) to completion through a Pipeline on an InlineDevice running
    `worker` (a ModelWorker whose proposer defines the spec); returns the finished requests
    in prompt order. `params`: one for every request, or one per prompt. `num_pages` must not
    exceed the worker's KV pages; `adaptive`: the step's D is chosen up to the worker's draft
    length (scheduler/adaptive.py); `pipelines`:
    a list the pipeline is appended to (to inspect it after the run); `max_kept_tokens`:
    `PipelineConfig.max_kept_tokens`; `policy`: a `DraftPolicy` of the caller's
    (scheduler/draft_policy.py) choosing each step's D up to the worker's draft length; `tracer`:
    one recording the run (traces/hook.py)."""
    spec = worker.spec
    sink = _Sink()
    per = params if isinstance(params, list) else [params] * len(prompts)
    if len(per) != len(prompts):
        raise ValueError(f"{len(per)} sampling params for {len(prompts)} prompts")
    eos = tuple(worker.target.config.eos_token_ids)  # a request's own ignore_eos decides
    pipe = build_pipeline(spec, schedule or NATURAL_SCHEDULE[spec.kind], num_pages=num_pages,
                          page_size=worker.page_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, device=InlineDevice(worker),
                          clock=MonotonicClock(), sink=sink, eos_token_ids=eos, adaptive=adaptive, policy=policy,
                          drafter=host_drafter(spec, *worker.ngram), max_kept_tokens=max_kept_tokens,
                          uniform_verify=worker.padding is not None,  # one verify shape for padded steps
                          **({} if tracer is None else {"tracer": tracer}))
    sink.expected = len(prompts)
    if pipelines is not None:
        pipelines.append(pipe)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipe.run)
            for i, p in enumerate(prompts):
                pipe.add_request(Request(f"r{i}", list(p), per[i], arrival_ns=time.monotonic_ns()))
            if prompts:
                await sink.done.wait()
            pipe.stop()

    anyio.run(main)
    return [sink.finished[f"r{i}"] for i in range(len(prompts))]


@dataclass(frozen=True)
class AcceptanceSummary:
    num_requests: int
    num_output_tokens: int
    num_drafts: int  # verify steps with >= 1 draft
    mean_acceptance_length: float  # 1 + accepted / drafts
    acceptance_per_position: tuple[float, ...]  # [D] accepted / drafted at draft position k


def summarize(requests: list[Request]) -> AcceptanceSummary:
    drafts = sum(r.num_drafts for r in requests)
    accepted = sum(r.num_accepted_tokens for r in requests)
    counts = [r.per_pos() for r in requests]  # (drafted, accepted) per position, once per request
    width = max((len(d) for d, _ in counts), default=0)
    per_pos = []
    for k in range(width):
        d = sum(dr[k] for dr, _ in counts if k < len(dr))
        a = sum(ac[k] for _, ac in counts if k < len(ac))
        per_pos.append(a / d if d else 0.0)
    return AcceptanceSummary(len(requests), sum(r.num_output_tokens for r in requests), drafts,
                             1.0 + accepted / drafts if drafts else 1.0, tuple(per_pos))


@torch.inference_mode()
def paged_agreement(target, head, windows: torch.Tensor, page_size: int = 16) -> float:
    """First-token agreement through the paged path: for each window [N, S] the target runs a
    paged prefill (hidden states H), the head a paged pass over (H_i, t_{i+1}); the fraction
    of positions where the head's argmax at i equals the target's argmax at i+1."""
    same = total = 0
    backend = target.attention_backend("torch")
    for w in windows:
        s = int(w.shape[0])
        pages = list(range((s + page_size - 1) // page_size))
        kv_t = target.make_kv_cache(len(pages), page_size)
        kv_h = head.make_kv_cache(len(pages), page_size)
        plan = build_plan([s], [s], [pages], page_size)
        step = backend.prepare(plan, target.device)
        pos = torch.as_tensor(plan.positions, device=target.device)
        ids = w.to(target.device)
        out = target(ids, step, kv_t, pos, return_hidden=True, aux_layers=head.aux_layers)
        hplan = build_plan([s - 1], [s - 1], [pages], page_size)
        hstep = backend.prepare(hplan, target.device)
        hout = head(ids[1:], out.hidden[:-1], hstep, kv_h, pos[:-1])
        guess = hout.logits.argmax(-1)[:-1]  # head at i guesses t_{i+2}
        want = out.logits.argmax(-1)[1:-1]  # target's greedy token after position i+1
        same += int((guess == want).sum())
        total += int(want.numel())
    return same / max(total, 1)


def validate_head(target_dir: str, head_dir: str, heldout_windows: torch.Tensor, prompts: list[list[int]],
                  *, max_tokens: int = 64, draft_lens: tuple[int, ...] = (1, 2, 3),
                  eagle: tuple[int, int, int] | None = (3, 2, 8), log=print) -> dict:
    """Acceptance of the head in `head_dir` through the inference implementation: paged
    first-token agreement on held-out windows, then greedy Pipeline runs on `prompts` with
    the MTP proposer at each D (and an EAGLE tree (depth, top_k, max_nodes)), each checked
    token for token against plain greedy decoding."""
    from specsched.scheduler.wiring import proposer_spec

    runs = [(f"mtp D={d}", d, {"kind": "mtp", "draft_len": d}) for d in draft_lens]
    if eagle is not None:
        depth, top_k, max_nodes = eagle
        parents = list(proposer_spec("eagle", depth, tree_top_k=top_k, tree_max_nodes=max_nodes).tree_parents)
        runs.append((f"eagle(depth={depth},top_k={top_k},nodes={len(parents)})", depth,
                     {"kind": "eagle", "draft_len": depth, "tree_parents": parents}))

    def agreement(worker, report: dict) -> None:
        report["paged_agreement"] = paged_agreement(worker.target, worker.proposer.head, heldout_windows)
        log(f"[validate] paged first-token agreement {report['paged_agreement']:.3f} "
            f"on {heldout_windows.numel():,} held-out tokens")

    return acceptance_runs(target_dir, head_dir, prompts, runs, max_tokens=max_tokens, first=agreement, log=log)


def validate_draft(target_dir: str, draft_dir: str, prompts: list[list[int]], *, max_tokens: int = 64,
                   draft_lens: tuple[int, ...] = (1, 2, 3, 4), log=print) -> dict:
    """Acceptance of the draft model in `draft_dir` along the decode path: greedy Pipeline runs
    on `prompts` with the draft proposer at each D, checked against plain greedy decoding."""
    runs = [(f"draft D={d}", d, {"kind": "draft", "draft_len": d}) for d in draft_lens]
    return acceptance_runs(target_dir, draft_dir, prompts, runs, max_tokens=max_tokens, log=log)


def acceptance_runs(target_dir: str, proposer_dir: str, prompts: list[list[int]], runs, *, max_tokens: int,
                    first=None, log=print) -> dict:
    """Plain greedy reference, then each (key, D, proposer config) in `runs` served through the
    pipeline: its mean acceptance length, per-position acceptance, token identity with the
    reference and wall time relative to it. `first(worker, report)` runs once on the first
    proposer's worker (e.g. a teacher-forced agreement through its model)."""
    from specsched.runtime.worker import ModelWorker

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    num_pages = 4 * len(prompts) * ((max(len(p) for p in prompts) + max_tokens + 32) // 16 + 2)
    kw = {"page_size": 16, "num_pages": num_pages}
    plain = ModelWorker(target_dir, {"kind": "none", "draft_len": 0}, **kw)
    t0 = time.perf_counter()
    reference = [r.output_token_ids for r in run_requests(plain, prompts, params, num_pages=num_pages)]
    plain_s = time.perf_counter() - t0
    report: dict = {"num_prompts": len(prompts), "max_tokens": max_tokens}
    for key, d, prop in runs:
        worker = ModelWorker(target_dir, prop, proposer_dir=proposer_dir, **kw)
        if first is not None:
            first(worker, report)
            first = None
        t0 = time.perf_counter()
        reqs = run_requests(worker, prompts, params, num_pages=num_pages)
        s = summarize(reqs)
        same = [r.output_token_ids for r in reqs] == reference
        report[key] = {"mean_acceptance_length": round(s.mean_acceptance_length, 3),
                       "acceptance_per_position": [round(x, 3) for x in s.acceptance_per_position[:d]],
                       "identical_to_greedy": same,
                       "wall_ratio_vs_plain": round((time.perf_counter() - t0) / plain_s, 2)}
        log(f"[validate] {key}: AL {s.mean_acceptance_length:.3f} per-position "
            f"{report[key]['acceptance_per_position']} identical={same}")
    return report


def acceptance_table(report: dict) -> list[str]:
    """A model card's section for `validate_draft`'s report."""
    runs = {k: v for k, v in report.items() if k.startswith("draft D=")}
    lines = ["", "## Acceptance along the decode path", "",
             f"Greedy generation through the engine's pipeline and worker (`--spec draft`) on"
             f" {report['num_prompts']} held-out function prompts x {report['max_tokens']} tokens, outputs"
             " checked identical to plain greedy decoding; AL = 1 + accepted / drafts.", "",
             "| D | AL | acceptance per draft position | identical to greedy |", "|---|---|---|---|"]
    for k, v in runs.items():
        lines.append(f"| {k.split('=')[1]} | {v['mean_acceptance_length']:.2f} | {v['acceptance_per_position']} |"
                     f" {'yes' if v['identical_to_greedy'] else 'NO'} |")
    return lines


def draft_acceptance(target_dir: str, draft_dir: str, corpus, encode, seed: int, num_prompts: int = 24) -> dict:
    """`validate_draft` at D = 1..4 on `num_prompts` held-out function prompts of `corpus`
    (`encode`: text -> token ids; the prompts the MTP head's card uses, seed + 1)."""
    from specsched.runtime.training.corpus import function_prompts

    prompts = [encode(p) for p in function_prompts(corpus.heldout, lambda x: len(encode(x)), num_prompts, seed + 1)]
    return validate_draft(target_dir, draft_dir, prompts)
