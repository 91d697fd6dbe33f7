"""Which requests run a step, with how many tokens: the scheduler's budgets and its two paths.

`decode_only` schedules the steady state (every running request decodes, none waits for a seat, the pool holds the
batch) in whole-array operations, D chosen by the policy; `general` any other step: running requests first (one by
one only when someone must be preempted, most recently admitted first), then waiting ones first come first served
while the token budget, the seats and the pool hold them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from specsched.scheduler.draft_policy import StepView
from specsched.scheduler.request import Request
from specsched.scheduler.small_arrays import some, total
from specsched.scheduler.step_batch import StepBatch

if TYPE_CHECKING:
    from specsched.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per step, verify width (1 + D) counted per spec row
    draft_len: int = 0  # D: verify candidates per speculative step (0 = no speculation)
    proposer_model: str | None = None  # second page table ("draft" / "mtp"), None if no KV
    kv_ahead: int = 0  # tokens the proposer's KV runs ahead of the target's (`ProposerSpec.kv_ahead`)
    # the proposer's fills may wait while a policy that pauses has speculation off, and catch up
    # when it drafts again (`ProposerRules.lazy_fill`)
    lazy_fill: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.draft_len < 0:
            raise ValueError("need max_num_seqs >= 1, max_num_batched_tokens >= 1, draft_len >= 0")
        if self.max_num_batched_tokens < 1 + self.draft_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) cannot hold one "
                f"verification of 1 + draft_len ({1 + self.draft_len}) tokens"
            )


def max_pages_needed(config: SchedulerConfig, page_size: int, num_prompt_tokens: int,
                     max_tokens: int) -> int:
    """Upper bound on the KV pages one request holds at once, over every KV model: at its
    last verification the target's KV covers prompt + max_tokens + D slots, a proposer's one
    slot more (it also sees the sampled token). The engine checks requests and its pool
    against this number; admission uses it too."""
    last = num_prompt_tokens + max_tokens + config.draft_len
    pages = -(-last // page_size)
    if config.proposer_model is not None:
        pages += -(-(last + 1) // page_size)
    return pages


def schedule(s: "Scheduler") -> StepBatch:
    """The step's batch: the steady state's whole-array path if it applies, else the general one."""
    batch = decode_only(s)
    return batch if batch is not None else general(s)


def decode_only(s: "Scheduler") -> StepBatch | None:
    """The steady state in whole-array operations: every running request decodes (one
    token, plus drafts), none waits for a seat, and the pool holds the batch without
    preempting anyone. The batch the general path would make (tested equal); None when
    any of that does not hold, and `general` decides."""
    cfg, running = s.config, s.running
    if not running or (s.waiting and len(running) < cfg.max_num_seqs):
        return None
    t = s.table
    slots = s.running_slots()
    computed = t.computed[slots]
    prompt = t.prompt_len[slots]
    emitted = t.num_output[slots] + t.pending[slots]
    todo = prompt + emitted - computed
    if some(todo > 1) or some(computed < prompt):
        return None  # a prefill or recompute in the batch: no speculation, the general path
    active = (todo == 1).nonzero()[0]
    # D for this step, how many rows its budget then holds (in order) and what each drafts
    every_row = active.size == slots.size
    a_slots = slots if every_row else slots[active]
    a_computed = computed if every_row else computed[active]
    lag = np.maximum(a_computed + cfg.kv_ahead - t.proposer_computed[a_slots], 0) if s._lags else None
    remaining = t.max_tokens[a_slots] - (emitted if every_row else emitted[active])
    decision = s.policy.choose(StepView(a_slots, remaining, a_computed, cfg.max_num_batched_tokens, lag))
    draft = decision.draft_len
    take = active[: min(active.size, decision.rows)]
    n = take.size
    if n == 0:
        return None
    if n == len(running):
        reqs, rows = list(running), slots
    else:
        reqs, rows, computed = [running[i] for i in take.tolist()], slots[take], computed[take]
    cols = s.blocks.shortfall(rows, s.kv_slots(computed + 1 + draft))
    if sum(total(c) for c in cols.values()) > s.blocks.num_free_pages:
        return None  # someone is preempted: the general path chooses whom
    # every row computes its one last token: every row samples
    batch = s.make_batch(reqs, rows, computed, np.ones(n, dtype=np.int64), decision.draft_lens,
                            np.zeros(n, dtype=bool), [], draft, decision, samples=np.ones(n, dtype=bool))
    batch.shortfall = (s.blocks.version, cols)  # what `allocate` reserves: 1 + D slots per row
    return batch


def _running_rows(s: "Scheduler", budget: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The running requests' rows of a step that drafts nothing, in whole-array
    operations: (indices into `running`, tokens each computes, pages they need), each
    taking what is left of the token budget in order -- or None when the pool cannot
    hold them all and someone must be preempted (the loop in `schedule`)."""
    t = s.table
    slots = s.running_slots()
    computed = t.computed[slots]
    todo = t.num_tokens(slots) - computed
    before = np.cumsum(todo) - todo  # budget the rows ahead of each take
    n = np.clip(budget - before, 0, todo)
    rows = (n > 0).nonzero()[0]
    n = n[rows]
    need = s.blocks.pages_needed(slots[rows], s.kv_slots(computed[rows] + n))
    pages = int(need.sum())
    if pages > s.blocks.num_free_pages:
        return None
    return rows, n, pages


@dataclass
class Rows:
    """The rows the general path has taken so far, and what is left of the step's budget."""

    budget: int  # tokens
    reqs: list[Request] = field(default_factory=list)
    new: list[int] = field(default_factory=list)  # tokens each computes
    drafts: list[int] = field(default_factory=list)  # tokens each drafts
    prefill: list[bool] = field(default_factory=list)
    planned: int = 0  # pages promised to the rows taken
    preempted: list[Request] = field(default_factory=list)

    def take(self, req: Request, n: int, d: int, pages: int) -> None:
        self.reqs.append(req)
        self.new.append(n)
        self.drafts.append(d)
        self.prefill.append(req.in_prefill)
        self.planned += pages
        self.budget -= n + d


def general(s: "Scheduler") -> StepBatch:
    """Any step: running requests first (whole-array unless someone must be preempted), then admission of waiting
    ones (whole-array, `_admissions`)."""
    rows, draft, in_prefill = start_rows(s)
    fast = _running_rows(s, rows.budget) if (not draft and s.running) else None
    if fast is not None:
        taken, n, rows.planned = fast
        rows.reqs = [s.running[i] for i in taken.tolist()]
        rows.new = n.tolist()
        rows.drafts = [0] * len(rows.reqs)
        rows.prefill = in_prefill[taken].tolist()
        rows.budget -= int(n.sum())
    else:
        running_one_by_one(s, rows, draft)
    if s.waiting and not rows.preempted:  # admit waiting requests while budget, seats and pages allow
        adm, n, pre, rows.budget, rows.planned = _admissions(s, rows.budget, rows.planned, draft)
        rows.reqs.extend(adm)
        rows.new.extend(n)
        rows.drafts.extend([0] * len(adm))
        rows.prefill.extend(pre)
    return batch_of(s, rows, draft)


def start_rows(s: "Scheduler") -> tuple[Rows, int, np.ndarray]:
    """The step's empty rows, its D, and which running requests are in prefill."""
    t = s.table
    slots = s.running_slots()
    computed = t.computed[slots]
    in_prefill = (computed < t.prompt_len[slots]) | (computed < t.num_tokens(slots) - 1)  # `Request.in_prefill`
    # speculate only on a decode-only batch: every running request decodes and none waiting can be admitted
    decodes_only = (not s.waiting or len(s.running) >= s.config.max_num_seqs) and not in_prefill.any()
    last = s.policy.last
    draft = (s.config.draft_len if last is None else last.draft_len) if decodes_only else 0
    return Rows(s.config.max_num_batched_tokens), draft, in_prefill


def batch_of(s: "Scheduler", rows: Rows, draft: int) -> StepBatch:
    if not rows.reqs:
        return s.empty_batch(rows.preempted)
    prefill = np.array(rows.prefill, dtype=bool)
    draft_lens = np.array(rows.drafts, dtype=np.int64)
    if draft and prefill.any():
        draft_lens[:] = 0
    slots = np.fromiter((r.slot for r in rows.reqs), dtype=np.int64, count=len(rows.reqs))
    return s.make_batch(rows.reqs, slots, s.table.computed[slots], np.array(rows.new, dtype=np.int64),
                        draft_lens, prefill, rows.preempted, draft)


def row_pages(s: "Scheduler", req: Request, n: int, draft: int) -> int:
    """Pages a row computing `n` tokens needs: a decoding row's verification computes (and writes
    KV for) up to 1 + D positions."""
    return int(s.blocks.pages_needed(np.array([req.slot]),
                                     s.kv_slots(req.num_computed_tokens + n + (draft if n == 1 else 0)))[0])


def running_one_by_one(s: "Scheduler", rows: Rows, draft: int) -> None:
    """The running requests one at a time, in order, each taking what is left of the budget;
    when the pool cannot hold a row, the most recently admitted request is preempted (the
    row's own request last, and a lone one that does not fit is an error)."""
    gone: set[int] = set()  # ids of requests preempted here
    for req in list(s.running):
        if id(req) in gone:
            continue
        n = min(req.num_tokens - req.num_computed_tokens, rows.budget)
        if n <= 0:
            continue
        if n == 1 and draft and rows.budget < 1 + draft:
            break
        pages = row_pages(s, req, n, draft)
        while pages + rows.planned > s.blocks.num_free_pages and s.running[-1] is not req:
            victim = s.running[-1]
            s.preempt(victim)
            rows.preempted.append(victim)
            gone.add(id(victim))
        if pages + rows.planned > s.blocks.num_free_pages:
            if len(s.running) == 1:
                raise RuntimeError(
                    f"request {req.request_id} does not fit in the KV pool even alone "
                    f"({pages} pages needed, {s.blocks.num_free_pages} free)"
                )
            s.preempt(req)
            rows.preempted.append(req)
            gone.add(id(req))
            continue
        d = min(draft, max(0, req.remaining_tokens - 1)) if n == 1 else 0
        rows.take(req, n, d, pages)
        rows.budget -= (draft if n == 1 else 0) - d  # the budget counts the whole verify width
        if rows.budget <= 0:
            break


def _admissions(s: "Scheduler", budget: int, planned: int, draft: int
            ) -> tuple[list[Request], list[int], list[bool], int, int]:
    """Admission of waiting requests, whole-array: first come first served while the
    token budget, the seats and the pool (beyond the `planned` pages) hold them -- the
    requests admitting them one by one would, moved to `running`.
    Returns (requests, tokens each computes, whether each is in prefill, budget left,
    pages planned)."""
    waiting = s.waiting
    m = min(len(waiting), s.config.max_num_seqs - len(s.running))
    if m <= 0 or budget <= 0:
        return [], [], [], budget, planned
    cand = list(itertools.islice(waiting, m))
    t = s.table
    slots = np.fromiter((r.slot for r in cand), dtype=np.int64, count=m)
    computed = t.computed[slots]
    prompt = t.prompt_len[slots]
    length = t.num_tokens(slots)
    todo = length - computed
    before = np.cumsum(todo) - todo  # the budget the requests ahead of each take
    k = int(np.count_nonzero(before < budget))  # a prefix: the budget left is > 0 for them
    n = np.minimum(todo[:k], budget - before[:k])
    # a verification reserves 1 + D slots per decoding row (`need` in `schedule`)
    pages = s.blocks.pages_needed(slots[:k], s.kv_slots(computed[:k] + n + np.where(n == 1, draft, 0)))
    fits = planned + np.cumsum(pages) <= s.blocks.num_free_pages
    a = k if fits.all() else int(np.argmin(fits))  # up to the first that does not fit
    if a == 0:
        if k and not s.running:
            raise RuntimeError(
                f"request {cand[0].request_id} does not fit in the KV pool even alone "
                f"({int(pages[0])} pages needed, {s.blocks.num_free_pages} free)"
            )
        return [], [], [], budget, planned
    admitted = cand[:a]
    s.admit(admitted)
    in_prefill = (computed[:a] < prompt[:a]) | (computed[:a] < length[:a] - 1)  # `Request.in_prefill`
    return (admitted, n[:a].tolist(), in_prefill.tolist(), budget - int(n[:a].sum()),
            planned + int(pages[:a].sum()))
