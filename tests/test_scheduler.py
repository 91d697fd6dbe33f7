"""Tests for specsched.scheduler.scheduler: budgets, FCFS admission, chunked prefill, speculation on
decode-only batches, preemption and recompute, aborts, driven to completion through the
scheduler's own calls (the ones the pipeline makes) with device results made up here."""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsched.scheduler import batching, packing
from specsched.scheduler.messages import ForwardResult, VerifyResult
from specsched.scheduler.scheduler import Scheduler, SchedulerConfig
from specsched.scheduler.step_batch import StepBatch
from specsched.scheduler.block_manager import BlockManager
from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.proposer import ProposerSpec
from specsched.scheduler.request import Request, RequestState
from specsched.scheduler.sampling_params import SamplingParams


def make_req(rid: str, prompt_len: int, max_tokens: int, arrival_ns: int = 0) -> Request:
    return Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens), arrival_ns)


def make_builder(
    num_pages: int = 64,
    page_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    draft_len: int = 0,
    proposer_model: str | None = None,
) -> Scheduler:
    models = ("target",) + ((proposer_model,) if proposer_model else ())
    cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens, draft_len, proposer_model,
                          kv_ahead=1 if proposer_model == "draft" else 0)
    return Scheduler(cfg, BlockManager(num_pages, page_size, models))


@dataclass(frozen=True)
class Row:
    """One row of a StepBatch, for assertions."""
    request: Request
    num_new_tokens: int
    draft_lens: int
    samples: bool
    prefill: bool


def rows(batch: StepBatch) -> list[Row]:
    return [Row(r, n, d, s, p) for r, n, d, s, p in zip(
        batch.requests, batch.num_new.tolist(), batch.draft_lens.tolist(), batch.samples.tolist(),
        batch.prefill.tolist())]


class Sim:
    """Drives a scheduler as the pipeline does -- `schedule`, `allocate`, `launched`, `update`
    -- with random acceptance; each row's tokens are its output positions (0, 1, 2, ...)."""

    def __init__(self, builder: Scheduler, accept_rng: random.Random | None = None):
        self.b = builder
        self.rng = accept_rng or random.Random(0)
        self.finished: list[Request] = []
        self.batches: list[StepBatch] = []
        self.num_fast = 0  # steps the whole-array decode path scheduled
        cfg = builder.config
        self.kv_ahead = (1 if cfg.proposer_model == "draft" else 0) if cfg.proposer_model else None

    def add(self, req: Request) -> None:
        self.b.add(req)

    def _update(self, batch: StepBatch, result, emitted: list[int]) -> None:
        """The result's update: each row keeps what it emitted up to max_tokens, and a request
        that reaches it finishes, its pages and slot freed."""
        room = [r.params.max_tokens - r.num_output_tokens for r in batch.requests]
        out = self.b.update(batch, result, 0)
        assert out.counts == [min(n, left) for n, left in zip(emitted, room)]
        assert out.finished == [r for r, n, left in zip(batch.requests, emitted, room) if n >= left]
        for r in out.finished:
            assert r.state is RequestState.FINISHED and r.finish_reason == "length"
            assert r.num_output_tokens == r.params.max_tokens and r.request_id not in self.b.requests
            assert self.b.blocks.page_table(r.slot) == []
        self.finished.extend(out.finished)

    @staticmethod
    def _tokens(batch: StepBatch, width: int) -> np.ndarray:
        have = np.array([r.num_output_tokens for r in batch.requests], dtype=np.int64)
        return have[:, None] + np.arange(width)

    def step(self) -> StepBatch:
        b, cfg = self.b, self.b.config
        # what the one-row-at-a-time path decides; the whole-array paths must agree with it
        general = one_by_one(copy.deepcopy(b))
        assert _summary(batching.general(copy.deepcopy(b))) == _summary(general)
        batch = b.schedule()
        assert _summary(batch) == _summary(general)
        self.num_fast += batch.shortfall is not None  # the whole-array path found the pages it needs
        self.batches.append(batch)
        check_batch(b, batch)
        b.allocate(batch)
        check_allocation(b, batch)
        check_messages(b, batch)
        for row in rows(batch):
            if row.samples:
                assert row.request.num_computed_tokens + row.num_new_tokens == row.request.num_tokens
        if batch.is_spec:
            accepted = np.array([self.rng.randint(0, d) for d in batch.draft_lens.tolist()], dtype=np.int64)
            tokens = self._tokens(batch, (1 + batch.draft_len))
            self._update(batch, VerifyResult(accepted, tokens, batch.draft_lens), (1 + accepted).tolist())
            for r, a in zip(batch.requests, accepted.tolist()):
                if not r.is_finished:  # rejected candidates' pages went back
                    assert r.num_computed_tokens == r.num_tokens - 1
                    assert len(b.blocks.page_table(r.slot)) * b.blocks.page_size < r.num_tokens + b.blocks.page_size
                    if self.kv_ahead is not None:
                        assert r.num_proposer_computed == r.num_computed_tokens + self.kv_ahead
        else:
            b.launched(batch, fills=True)
            assert all(r.num_pending_tokens == int(s) for r, s in zip(batch.requests, batch.samples.tolist()))
            tokens = self._tokens(batch, 1)[:, 0]
            self._update(batch, ForwardResult(tokens), batch.samples.astype(int).tolist())
        b.blocks.check_invariants()
        check_slots(b)
        for r in b.running:
            assert r.state is RequestState.RUNNING
        for r in b.waiting:
            assert b.blocks.page_table(r.slot) == []
            if cfg.proposer_model:
                assert b.blocks.page_table(r.slot, cfg.proposer_model) == []
        return batch

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.b.has_work:
                return
            self.step()
        raise AssertionError("the scheduler made no progress (livelock)")


def check_slots(b: Scheduler) -> None:
    """Queued and running requests hold distinct slots, each the request's page-table row."""
    held = [r.slot for r in list(b.running) + list(b.waiting)]
    assert len(held) == len(set(held)) and all(s >= 0 for s in held)
    assert b.table.num_used == len(held)
    assert b.running_slots().tolist() == [r.slot for r in b.running]


def one_by_one(s: Scheduler) -> StepBatch:
    """The general path one request at a time: the reference the whole-array paths must agree with."""
    rows, draft, _ = batching.start_rows(s)
    batching.running_one_by_one(s, rows, draft)
    while s.waiting and not rows.preempted and rows.budget > 0 and len(s.running) < s.config.max_num_seqs:
        req = s.waiting[0]
        n = min(req.num_tokens - req.num_computed_tokens, rows.budget)
        pages = batching.row_pages(s, req, n, draft)
        if pages + rows.planned > s.blocks.num_free_pages:
            if not s.running:
                raise RuntimeError(f"request {req.request_id} does not fit in the KV pool even alone")
            break
        s.admit([req])
        rows.take(req, n, 0, pages)
    return batching.batch_of(s, rows, draft)


def _summary(batch: StepBatch) -> tuple:
    return (batch.step, batch.kind, [(s.request.request_id, s.num_new_tokens, s.draft_lens, s.samples, s.prefill)
                                     for s in rows(batch)], [r.request_id for r in batch.preempted])


def check_batch(b: Scheduler, batch: StepBatch) -> None:
    cfg = b.config
    ids = [s.request.request_id for s in rows(batch)]
    assert len(ids) == len(set(ids)), "a request scheduled twice"
    assert len(batch) <= cfg.max_num_seqs and len(b.running) <= cfg.max_num_seqs
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    for s in rows(batch):
        assert s.request in b.running
        assert s.num_new_tokens >= 1
        assert s.request.num_computed_tokens + s.num_new_tokens <= s.request.num_tokens
        assert s.draft_lens <= max(0, s.request.remaining_tokens - 1)
    if batch.is_spec:
        assert not any(s.request.in_prefill for s in rows(batch))
        assert all(s.num_new_tokens == 1 and s.samples for s in rows(batch))
        assert all(s.draft_lens == min(cfg.draft_len, s.request.remaining_tokens - 1) for s in rows(batch))
        assert batch.kind == "spec"
        # the verify computes 1 + D tokens for every row
        assert len(batch) * (1 + cfg.draft_len) <= cfg.max_num_batched_tokens
    for r in batch.preempted:
        assert r not in b.running and r in b.waiting
        assert r.state is RequestState.PREEMPTED and r.num_computed_tokens == 0
        assert r.num_proposer_computed == 0
        assert b.blocks.page_table(r.slot) == []


def check_allocation(b: Scheduler, batch: StepBatch) -> None:
    cfg, bm = b.config, b.blocks
    for s in rows(batch):
        r = s.request
        width = cfg.draft_len if batch.is_spec else 0
        target = r.num_computed_tokens + s.num_new_tokens + width
        assert len(bm.page_table(r.slot)) * bm.page_size >= target
        if cfg.proposer_model:
            assert len(bm.page_table(r.slot, cfg.proposer_model)) * bm.page_size >= target + 1


def spec_of(cfg: SchedulerConfig) -> ProposerSpec:
    if not cfg.draft_len:
        return ProposerSpec()
    return ProposerSpec("draft" if cfg.proposer_model == "draft" else "ngram", cfg.draft_len)


def check_messages(b: Scheduler, batch: StepBatch) -> None:
    """The plan stage must succeed on what kv_alloc reserved, and no two tokens of the step
    may write the same KV slot."""
    if not len(batch):
        return
    if batch.is_spec:
        msg = packing.verify_message(batch, b.blocks, spec_of(b.config))
        packing.draft_message(batch, b.blocks, spec_of(b.config))
    else:
        msg = packing.forward_message(batch, b.blocks)
    slots = msg.plan.slot_mapping.tolist()
    assert len(slots) == len(set(slots))


# -- configuration and admission ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_num_seqs": 0}, "max_num_seqs >= 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens >= 1"),
        ({"draft_len": -1}, "draft_len >= 0"),
        ({"max_num_batched_tokens": 4, "draft_len": 4}, r"cannot hold one verification of 1 \+ draft_len \(5\)"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_token_budget_seats_and_fcfs_admission() -> None:
    b = make_builder(max_num_seqs=3, max_num_batched_tokens=12)
    reqs = [make_req(f"r{i}", 5, 4, arrival_ns=i) for i in range(6)]
    for r in reqs:
        b.add(r)
    batch = b.schedule()
    assert [s.request.request_id for s in rows(batch)] == ["r0", "r1", "r2"]
    assert [s.num_new_tokens for s in rows(batch)] == [5, 5, 2]  # r2's prefill is chunked
    assert [s.samples for s in rows(batch)] == [True, True, False]
    assert batch.num_tokens == 12 and batch.kind == "prefill"
    assert [r.request_id for r in b.waiting] == ["r3", "r4", "r5"]
    assert all(r.state is RequestState.RUNNING for r in reqs[:3])
    assert all(r.state is RequestState.WAITING for r in reqs[3:])


def test_chunked_prefill_across_steps_then_decode() -> None:
    b = make_builder(max_num_batched_tokens=10)
    r = make_req("a", 25, 3)
    sim = Sim(b)
    sim.add(r)
    chunks = []
    for _ in range(3):
        batch = sim.step()
        (s,) = rows(batch)
        chunks.append((s.num_new_tokens, s.samples))
        assert batch.kind == "prefill"
    assert chunks == [(10, False), (10, False), (5, True)]
    assert r.num_computed_tokens == 25 and r.num_output_tokens == 1
    batch = sim.step()
    assert batch.kind == "decode" and rows(batch)[0].num_new_tokens == 1
    sim.run()
    assert r.num_output_tokens == 3 and r.state is RequestState.FINISHED
    assert b.blocks.num_free_pages == b.blocks.num_pages


def test_running_requests_come_before_new_prefill() -> None:
    b = make_builder(max_num_batched_tokens=8)
    sim = Sim(b)
    sim.add(make_req("a", 20, 2))
    sim.step()  # a: 8 of 20
    sim.add(make_req("b", 3, 2))
    batch = sim.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in rows(batch)] == [("a", 8)]
    batch = sim.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in rows(batch)] == [("a", 4), ("b", 3)]


# -- speculation ------------------------------------------------------------------------------------


def test_speculation_only_on_decode_only_batches() -> None:
    b = make_builder(draft_len=3, max_num_batched_tokens=32, proposer_model="draft")
    sim = Sim(b, random.Random(1))
    a = make_req("a", 4, 20)
    sim.add(a)
    batch = sim.step()
    assert batch.kind == "prefill" and not batch.is_spec
    batch = sim.step()
    assert batch.is_spec and rows(batch)[0].draft_lens == 3
    sim.add(make_req("b", 6, 20))
    batch = sim.step()  # b prefills: nobody speculates in this step
    assert batch.kind == "mixed" and not batch.is_spec
    assert all(s.draft_lens == 0 for s in rows(batch))
    batch = sim.step()
    assert batch.is_spec and [s.draft_lens for s in rows(batch)] == [3, 3]


def test_speculation_continues_when_waiting_requests_cannot_get_a_seat() -> None:
    b = make_builder(max_num_seqs=1, draft_len=2, max_num_batched_tokens=16)
    sim = Sim(b)
    sim.add(make_req("a", 4, 10))
    sim.step()
    sim.add(make_req("b", 4, 10))
    batch = sim.step()
    assert batch.is_spec and [s.request.request_id for s in rows(batch)] == ["a"]
    assert [r.request_id for r in b.waiting] == ["b"]


def test_no_speculation_while_a_waiting_request_can_be_admitted() -> None:
    b = make_builder(max_num_seqs=4, draft_len=2, max_num_batched_tokens=16)
    sim = Sim(b)
    sim.add(make_req("a", 4, 10))
    sim.step()
    sim.add(make_req("b", 4, 10))
    batch = sim.step()
    assert not batch.is_spec and {s.request.request_id for s in rows(batch)} == {"a", "b"}


def test_num_draft_capped_by_remaining_tokens() -> None:
    b = make_builder(draft_len=4, max_num_batched_tokens=32)
    sim = Sim(b, random.Random(0))
    sim.rng = type("AcceptAll", (), {"randint": staticmethod(lambda lo, hi: hi)})()
    r = make_req("a", 3, 4)
    sim.add(r)
    sim.step()  # prefill -> 1 token, 3 remaining
    batch = sim.step()
    assert rows(batch)[0].draft_lens == 2  # 1 + 2 drafts = the 3 remaining tokens
    assert r.num_output_tokens == 4 and r.state is RequestState.FINISHED


def test_spec_rows_reserve_the_whole_verify_width() -> None:
    # a row with one token left drafts nothing: its pages hold 1 + D slots as every row's do
    # (the schedule reserves the step's width), but its verify computes its last token alone
    b = make_builder(page_size=2, draft_len=3, max_num_batched_tokens=16)
    sim = Sim(b)
    sim.rng = type("AcceptAll", (), {"randint": staticmethod(lambda lo, hi: hi)})()
    long = make_req("long", 2, 10)
    short = make_req("short", 2, 2)
    sim.add(long)
    sim.add(short)
    sim.step()  # both prefill, one token each
    batch = b.schedule()
    assert batch.is_spec
    assert {s.request.request_id: s.draft_lens for s in rows(batch)} == {"long": 3, "short": 0}
    b.allocate(batch)
    for s in rows(batch):
        assert len(b.blocks.page_table(s.request.slot)) * b.blocks.page_size >= s.request.num_computed_tokens + 1 + 3
    msg = packing.verify_message(batch, b.blocks, ProposerSpec("ngram", 3))
    assert list(msg.plan.qo_indptr) == [0, 4, 5]
    assert list(msg.plan.kv_lens) == [s.request.num_computed_tokens + 1 + s.draft_lens for s in rows(batch)]
    assert msg.shape.tokens == 5
    # for padded steps (CUDA graphs) every row verifies the step's whole width, in the pages reserved
    wide = packing.verify_message(batch, b.blocks, ProposerSpec("ngram", 3), uniform=True)
    assert list(wide.plan.qo_indptr) == [0, 4, 8] and wide.shape.tokens == 8
    assert list(wide.plan.kv_lens) == [s.request.num_computed_tokens + 4 for s in rows(batch)]
    assert list(wide.draft_lens) == [3, 0]  # what each row drafted: the rest is never accepted


def test_spec_token_budget_counts_the_verify_width() -> None:
    b = make_builder(draft_len=3, max_num_batched_tokens=10)
    sim = Sim(b)
    for i in range(3):
        sim.add(make_req(f"r{i}", 2, 10))
    sim.step()  # 3 prefills of 2 tokens
    batch = sim.step()
    assert batch.is_spec and len(batch) == 2  # 2 * (1 + 3) <= 10 < 3 * 4
    batch = sim.step()
    assert batch.is_spec and rows(batch)[0].request.request_id == "r0"


# -- preemption -------------------------------------------------------------------------------------


def test_preemption_takes_the_most_recent_request_and_recomputes_it() -> None:
    # page_size 2, 6 pages; three 3-token prompts with max_tokens 6 (each needs up to 5 pages)
    b = make_builder(num_pages=6, page_size=2, max_num_batched_tokens=16)
    sim = Sim(b)
    reqs = [make_req(f"r{i}", 3, 6, arrival_ns=i) for i in range(3)]
    for r in reqs:
        sim.add(r)
    batch = sim.step()
    assert [s.request.request_id for s in rows(batch)] == ["r0", "r1", "r2"]  # 2 pages each
    batch = sim.step()  # all decode at position 3: fits in the 2 pages
    assert not batch.preempted
    batch = sim.step()  # position 4 needs a third page each: no room; r2 is preempted
    assert [r.request_id for r in batch.preempted] == ["r2"]
    r2 = reqs[2]
    assert r2.state is RequestState.PREEMPTED and r2.num_preemptions == 1
    assert list(b.waiting) == [r2]
    assert r2.output_token_ids == [0, 1]  # outputs are kept, never dropped
    assert [s.request.request_id for s in rows(batch)] == ["r0", "r1"]
    sim.run()
    assert all(r.state is RequestState.FINISHED and r.output_token_ids == list(range(6)) for r in reqs)
    # r2 came back with a recompute of prompt + outputs in one prefill chunk
    readmit = next(bt for bt in sim.batches if any(
        s.request is r2 and s.num_new_tokens > 1 for s in rows(bt)) and bt.step > 2)
    (s2,) = [s for s in rows(readmit) if s.request is r2]
    assert s2.num_new_tokens == 3 + 2 and s2.samples
    assert b.blocks.num_free_pages == b.blocks.num_pages


def test_preempted_requests_return_to_the_front_in_fcfs_order() -> None:
    # page_size 1, 9 pages; three 3-token prompts fill the pool. The next (speculative) step
    # needs 1 + D = 4 more slots for r0: r2 and then r1 are preempted, in that order.
    b = make_builder(num_pages=9, page_size=1, draft_len=3, max_num_batched_tokens=16)
    sim = Sim(b)
    reqs = [make_req(f"r{i}", 3, 3, arrival_ns=i) for i in range(3)]
    for r in reqs:
        sim.add(r)
    sim.step()
    assert b.blocks.num_free_pages == 0
    batch = sim.step()
    assert [r.request_id for r in batch.preempted] == ["r2", "r1"]
    assert [s.request.request_id for s in rows(batch)] == ["r0"] and batch.is_spec
    late = make_req("late", 2, 2, arrival_ns=9)
    sim.add(late)
    assert [r.request_id for r in b.waiting] == ["r1", "r2", "late"]
    sim.run()
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs + [late])
    assert reqs[0].num_preemptions == 0 and min(r.num_preemptions for r in reqs[1:]) >= 1


def test_request_larger_than_the_pool_is_rejected_at_add() -> None:
    b = make_builder(num_pages=4, page_size=4, draft_len=2, proposer_model="draft")
    # target may hold prompt + max_tokens + D = 8 + 4 + 2 = 14 slots (4 pages) and the draft
    # one more (4 pages): 8 > 4
    with pytest.raises(InvalidRequestError, match=r"request big: .* may need 8 KV pages, the pool has 4"):
        b.add(make_req("big", 8, 4))
    assert not b.has_work


def test_request_at_the_bound_fits_and_finishes() -> None:
    b = make_builder(num_pages=8, page_size=4, draft_len=2, proposer_model="draft",
                     max_num_batched_tokens=8)
    r = make_req("edge", 8, 5)  # target up to 8 + 5 + 2 = 15 slots (4 pages), draft 16 (4)
    assert b.max_pages_needed(r) == 8
    sim = Sim(b, random.Random(3))
    sim.add(r)
    sim.run()
    assert r.num_output_tokens == 5


def test_duplicate_request_id_is_rejected() -> None:
    b = make_builder()
    b.add(make_req("x", 3, 3))
    with pytest.raises(InvalidRequestError, match="duplicate request id 'x'"):
        b.add(make_req("x", 3, 3))


def test_schedule_raises_when_the_waiting_head_cannot_fit_and_nothing_runs() -> None:
    b = make_builder(num_pages=4, page_size=2)
    b.add(make_req("a", 5, 2))
    b.blocks.allocate(np.array([99]), {"target": 6})  # pages held outside the scheduler's slots
    with pytest.raises(RuntimeError, match=r"request a does not fit in the KV pool even alone"):
        b.schedule()


def test_schedule_raises_when_a_lone_running_request_cannot_grow() -> None:
    b = make_builder(num_pages=4, page_size=2)
    sim = Sim(b)
    sim.add(make_req("a", 4, 4))
    sim.step()
    b.blocks.allocate(np.array([99]), {"target": 4})
    with pytest.raises(RuntimeError, match=r"request a does not fit in the KV pool even alone"):
        b.schedule()


def test_remove_frees_pages_and_dequeues() -> None:
    b = make_builder(proposer_model="draft")
    sim = Sim(b)
    a, w = make_req("a", 6, 4), make_req("w", 3, 4)
    sim.add(a)
    sim.step()
    b.add(w)
    assert b.blocks.num_used_pages > 0
    assert b.abort("a") and b.abort("w") and not b.abort("unknown")
    assert b.has_work  # until the step boundary
    out = b.finish_marked(None, 7)
    assert out.finished == [a, w] and all(r.finish_reason == "abort" and r.finish_ns == 7 for r in out.finished)
    assert not b.has_work and b.blocks.num_free_pages == b.blocks.num_pages
    assert not b.abort("a")


@pytest.mark.parametrize("keep_ids", [True, False])
@pytest.mark.parametrize("n", [5, 12])  # a handful of rows one by one; many whole-array
def test_update_cuts_at_eos_and_max_tokens_and_ends_aborts_and_stops(n: int, keep_ids: bool) -> None:
    """One decode step's result: a row that samples EOS finishes "stop" with it, one at
    max_tokens "length", an abort asked for while the step was in flight ends it without its
    tokens, a stop string's cut keeps the first tokens; the rest get their token. Every finished
    request's pages and slot are freed; the sink's tokens are exactly what each kept. A scheduler that keeps counts
only (the simulator's) counts the same tokens and hands out none."""
    eos = 2
    b = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256), BlockManager(256, 4),
                  eos_token_ids=(eos,), keep_ids=keep_ids)
    reqs = [Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2 if i == 1 else 8), 0) for i in range(n)]
    for r in reqs:
        b.add(r)
    prefill = b.schedule()
    b.allocate(prefill)
    b.launched(prefill, fills=False)
    first = b.update(prefill, ForwardResult(np.full(n, 9, dtype=np.int64)), 10)
    assert first.counts == [1] * n and first.finished == [] and [r.first_token_ns for r in reqs] == [10] * n
    step = b.schedule()
    b.allocate(step)
    b.launched(step, fills=False)
    assert b.abort("r2") and b.stop("r0", 0)  # asked while the step is in flight
    sampled = np.full(n, 11, dtype=np.int64)
    sampled[3] = eos
    out = b.update(step, ForwardResult(sampled), 20)
    want = {"r0": "stop", "r1": "length", "r2": "abort", "r3": "stop"}
    assert {r.request_id: r.finish_reason for r in out.finished} == want
    assert out.counts == [0, 1, 0, 1] + [1] * (n - 4)
    assert [r.num_output_tokens for r in reqs] == [0, 2, 1, 2] + [2] * (n - 4)
    if keep_ids:
        assert reqs[0].output_token_ids == [] and reqs[1].output_token_ids == [9, 11]
        assert reqs[2].output_token_ids == [9] and reqs[3].output_token_ids == [9, eos]
        assert sorted((r.request_id, t) for r, t in out.tokens) == \
            sorted([("r1", [11]), ("r3", [eos])] + [(r.request_id, [11]) for r in reqs[4:]])
    else:
        assert out.tokens == [] and all(r.output_token_ids == [] for r in reqs)
    assert all(r.finish_ns == 20 and b.blocks.page_table(r.slot) == [] for r in out.finished)
    assert sorted(b.requests) == sorted(r.request_id for r in reqs[4:])
    assert b.finish_marked(None, 30).finished == []  # nothing asked for is left


# -- randomized end-to-end ---------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    page_size = draw(st.integers(1, 6))
    draft_len = draw(st.integers(0, 3))
    return {
        "page_size": page_size,
        "draft_len": draft_len,
        "proposer_model": draw(st.sampled_from([None, "draft"])) if draft_len else None,
        "max_num_seqs": draw(st.integers(1, 4)),
        "max_num_batched_tokens": draw(st.integers(1 + draft_len, 24)),
        "extra_pages": draw(st.integers(0, 6)),
        "requests": draw(st.lists(
            st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=7,
        )),
        "seed": draw(st.integers(0, 2**16)),
    }


@given(workloads())
@settings(max_examples=120, deadline=None, database=None)
def test_random_workloads_finish_with_every_token(w: dict) -> None:
    cfg = SchedulerConfig(w["max_num_seqs"], w["max_num_batched_tokens"], w["draft_len"], w["proposer_model"],
                          kv_ahead=1 if w["proposer_model"] else 0)
    reqs = [make_req(f"r{i}", p, m, arrival_ns=i) for i, (p, m, _) in enumerate(w["requests"])]
    ps, d = w["page_size"], w["draft_len"]

    def bound(r: Request) -> int:  # the last verify: prompt + max_tokens + D slots (+1 draft)
        last = r.num_prompt_tokens + r.params.max_tokens + d
        return -(-last // ps) + (-(-(last + 1) // ps) if w["proposer_model"] else 0)

    num_pages = max(bound(r) for r in reqs) + w["extra_pages"]
    models = ("target",) + ((w["proposer_model"],) if w["proposer_model"] else ())
    b = Scheduler(cfg, BlockManager(num_pages, ps, models))
    assert all(b.max_pages_needed(r) == bound(r) for r in reqs)
    sim = Sim(b, random.Random(w["seed"]))
    arrivals = sorted(((delay, i) for i, (_, _, delay) in enumerate(w["requests"])))
    step = 0
    for _ in range(5_000):
        while arrivals and arrivals[0][0] <= step:
            sim.add(reqs[arrivals.pop(0)[1]])
        if not b.has_work and not arrivals:
            break
        if b.has_work:
            sim.step()
        step += 1
    else:
        raise AssertionError("livelock")
    for r in reqs:
        assert r.state is RequestState.FINISHED
        assert r.output_token_ids == list(range(r.params.max_tokens))
    assert b.blocks.num_free_pages == num_pages
    admitted = [s.request.request_id for bt in sim.batches for s in rows(bt) if s.request.num_preemptions == 0]
    first_seen = list(dict.fromkeys(admitted))
    arrival_order = [reqs[i].request_id for _, i in sorted((d, i) for i, (_, _, d) in enumerate(w["requests"]))]
    # FCFS: among requests never preempted, first scheduling follows arrival order
    assert first_seen == [rid for rid in arrival_order if rid in first_seen]


def test_decode_steady_state_is_scheduled_by_the_whole_array_path() -> None:
    """Once every request decodes and nothing waits, the batch comes from whole-array
    operations (and equals the general path's, which every Sim step checks)."""
    b = make_builder(256, 4, max_num_seqs=8, max_num_batched_tokens=40, draft_len=3, proposer_model="draft")
    sim = Sim(b)
    for i in range(8):
        sim.add(make_req(f"r{i}", 5 + i, 30))
    sim.run()
    assert all(r.num_output_tokens == 30 for r in sim.finished) and len(sim.finished) == 8
    spec_steps = sum(bt.is_spec for bt in sim.batches)
    assert spec_steps > 5 and sim.num_fast >= spec_steps
