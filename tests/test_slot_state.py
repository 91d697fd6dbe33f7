"""The scheduler's per-slot arrays against a plain reference model: random sequences of
adds, steps (with random acceptance), finishes, aborts and preemptions keep the arrays, the
page tables and the free stack consistent, with no page leaked or shared."""
from __future__ import annotations

import random

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from specsched.scheduler.messages import ForwardResult, VerifyResult
from specsched.scheduler.scheduler import Scheduler, SchedulerConfig
from specsched.scheduler.block_manager import BlockManager
from specsched.scheduler.request import Request, RequestState
from specsched.scheduler.sampling_params import SamplingParams
from specsched.scheduler.slot_state import COUNTERS, SlotTable


class Ref:
    """What one request's counters must be, kept as plain Python ints."""

    def __init__(self, prompt: int, max_tokens: int):
        self.prompt, self.max_tokens = prompt, max_tokens
        self.computed = self.output = self.proposer = 0
        self.drafts = self.drafted = self.accepted = 0
        self.drafted_pos: list[int] = []  # drafts with >= k+1 tokens
        self.accepted_pos: list[int] = []  # of those, accepted at >= k+1


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(page_size=st.integers(1, 5), draft_len=st.integers(0, 3), draft_model=st.booleans(),
                max_num_seqs=st.integers(1, 5), budget=st.integers(4, 24), extra=st.integers(0, 12),
                seed=st.integers(0, 2**16))
    def setup(self, page_size, draft_len, draft_model, max_num_seqs, budget, extra, seed):
        self.proposer = "draft" if (draft_len and draft_model) else None
        cfg = SchedulerConfig(max_num_seqs, max(budget, 1 + draft_len), draft_len, self.proposer,
                              kv_ahead=1 if self.proposer else 0)
        self.max_prompt, self.max_out = 12, 8
        probe = Request("probe", [0] * self.max_prompt, SamplingParams(max_tokens=self.max_out), 0)
        models = ("target",) + ((self.proposer,) if self.proposer else ())
        self.blocks = BlockManager(1, page_size, models)
        self.b = Scheduler(cfg, self.blocks)
        num_pages = self.b.max_pages_needed(probe) + extra  # the largest request fits alone
        self.blocks = BlockManager(num_pages, page_size, models)
        self.b = Scheduler(cfg, self.blocks)
        self.kv_ahead = 1 if self.proposer else None
        self.rng = random.Random(seed)
        self.refs: dict[str, Ref] = {}
        self.live: dict[str, Request] = {}
        self.done: list[Request] = []
        self.n = 0
        self.num_spec = 0

    @rule(prompt=st.integers(1, 12), max_tokens=st.integers(1, 8))
    def add(self, prompt, max_tokens):
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens), 0)
        self.b.add(req)
        self.refs[rid] = Ref(prompt, max_tokens)
        self.live[rid] = req

    @rule(data=st.data())
    def abort(self, data):
        if not self.live:
            return
        rids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=3, unique=True))
        for rid in rids:
            assert self.b.abort(rid)
        out = self.b.finish_marked(None, 0)  # no step in flight: every abort ends now
        assert sorted(r.request_id for r in out.finished) == sorted(rids)
        for r in out.finished:
            assert r.state is RequestState.ABORTED
            self._done(r)

    @rule()
    def step(self):
        if not self.b.has_work:
            return
        b, refs = self.b, self.refs
        batch = b.schedule()
        for r in batch.preempted:
            refs[r.request_id].computed = refs[r.request_id].proposer = 0
        b.allocate(batch)
        if batch.is_spec:
            accepted = np.array([self.rng.randint(0, d) for d in batch.draft_lens.tolist()], dtype=np.int64)
            tokens = np.ones((len(batch), (1 + batch.draft_len)), dtype=np.int64)
            out = b.update(batch, VerifyResult(accepted, tokens, batch.draft_lens), 0)
            for r, d, a in zip(batch.requests, batch.draft_lens.tolist(), accepted.tolist()):
                ref = refs[r.request_id]
                ref.computed += 1 + a
                ref.proposer = ref.prompt + ref.output + a + (self.kv_ahead or 0)
                if d:
                    ref.drafts, ref.drafted, ref.accepted = ref.drafts + 1, ref.drafted + d, ref.accepted + a
                    while len(ref.drafted_pos) < d:
                        ref.drafted_pos.append(0)
                        ref.accepted_pos.append(0)
                    for k in range(d):
                        ref.drafted_pos[k] += 1
                        ref.accepted_pos[k] += k < a
                self._emit(r, 1 + a, out.finished)
            ps = self.blocks.page_size
            width = 1 + self.b.config.draft_len
            for r, start in zip(batch.requests, batch.start.tolist()):
                if not r.is_finished:  # rejected candidates' pages went back, the rest stay
                    reserved = -(-(start + width) // ps)
                    assert len(self.blocks.page_table(r.slot)) == min(reserved, -(-r.num_tokens // ps))
            self.num_spec += 1
        else:
            b.launched(batch, fills=True)
            out = b.update(batch, ForwardResult(np.ones(len(batch), dtype=np.int64)), 0)
            for r, n, s in zip(batch.requests, batch.num_new.tolist(), batch.samples.tolist()):
                ref = refs[r.request_id]
                ref.computed += n
                if self.kv_ahead is not None:
                    ref.proposer = ref.computed + (self.kv_ahead if s else 0)
                if s:
                    self._emit(r, 1, out.finished)

    def _emit(self, r: Request, n: int, finished: list[Request]) -> None:
        """The reference's output; a request that reaches max_tokens is among those the update finished."""
        ref = self.refs[r.request_id]
        ref.output += min(n, ref.max_tokens - ref.output)
        assert (ref.output == ref.max_tokens) == (r in finished), r.request_id
        if r in finished:
            assert r.state is RequestState.FINISHED and r.finish_reason == "length"
            self._done(r)

    def _done(self, r: Request) -> None:
        del self.live[r.request_id]
        self.done.append(r)

    @invariant()
    def arrays_match_the_reference(self):
        if not hasattr(self, "b"):
            return
        for r in list(self.live.values()) + self.done:
            ref = self.refs[r.request_id]
            got = (r.num_computed_tokens, r.num_output_tokens, r.num_pending_tokens, r.num_drafts,
                   r.num_drafted_tokens, r.num_accepted_tokens)
            assert got == (ref.computed, ref.output, 0, ref.drafts, ref.drafted, ref.accepted), r.request_id
            assert (r.drafted_per_pos, r.accepted_per_pos) == (ref.drafted_pos, ref.accepted_pos), r.request_id
            if self.kv_ahead is not None:
                assert r.num_proposer_computed == ref.proposer, r.request_id

    @invariant()
    def pages_and_slots_are_consistent(self):
        if not hasattr(self, "b"):
            return
        b, bm = self.b, self.blocks
        bm.check_invariants()  # every page free or in exactly one table
        slots = [r.slot for r in self.live.values()]
        assert len(set(slots)) == len(slots) and b.table.num_used == len(slots)
        ps = bm.page_size
        for r in self.live.values():
            held = len(bm.page_table(r.slot))
            if r.state is RequestState.RUNNING:
                assert held * ps >= r.num_computed_tokens  # computed KV is backed by pages
            else:
                assert held == 0  # waiting or preempted: nothing held
        for r in self.done:  # a finished request's slot holds nothing until a new request takes it
            assert bm.page_table(r.slot) == [] or r.slot in slots
        assert bm.num_free_pages + sum(
            len(bm.page_table(r.slot, m)) for r in self.live.values() for m in bm.models) == bm.num_pages


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=60, stateful_step_count=40, deadline=None, database=None)


def test_a_handle_keeps_its_counters_after_its_slot_is_reused():
    table = SlotTable(2)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=4), 0)
    a.num_computed_tokens = 5
    slot = table.attach(a)
    table.record_spec(np.array([slot]), np.array([3]), np.array([2]))
    table.detach([a])
    b = Request("b", [9], SamplingParams(max_tokens=2), 0)
    assert table.attach(b) == slot  # the freed slot goes to the next request
    b.num_computed_tokens = 1
    assert (a.num_computed_tokens, a.num_accepted_tokens, a.accepted_per_pos) == (5, 2, [1, 1, 0])
    assert (b.num_computed_tokens, b.num_drafts, b.drafted_per_pos) == (1, 0, [])


def test_the_table_grows_past_its_capacity_and_width():
    table = SlotTable(1, max_draft_len=1)
    reqs = [Request(f"r{i}", [i], SamplingParams(max_tokens=9), 0) for i in range(5)]
    for i, r in enumerate(reqs):
        table.attach(r)
        r.num_computed_tokens = i
    table.record_spec(np.array([r.slot for r in reqs]), np.array([4, 0, 1, 2, 3]), np.array([4, 0, 0, 2, 1]))
    assert [r.num_computed_tokens for r in reqs] == [0, 1, 2, 3, 4]
    assert reqs[0].accepted_per_pos == [1, 1, 1, 1] and reqs[1].drafted_per_pos == []
    assert reqs[4].drafted_per_pos == [1, 1, 1] and reqs[4].accepted_per_pos == [1, 0, 0]


def test_detaching_many_at_once_leaves_what_detaching_one_by_one_leaves():
    tables = SlotTable(4, max_draft_len=2), SlotTable(4, max_draft_len=2)
    handles = []
    for table in tables:
        reqs = [Request(f"r{i}", [i] * (i + 1), SamplingParams(max_tokens=9), 0) for i in range(6)]
        for i, r in enumerate(reqs):
            table.attach(r)
            r.num_computed_tokens = 10 + i
        table.record_spec(np.array([reqs[1].slot, reqs[4].slot]), np.array([2, 1]), np.array([1, 0]))
        handles.append(reqs)
    order = [4, 0, 5, 1]
    for i in order:
        tables[0].detach([handles[0][i]])
    tables[1].detach([handles[1][i] for i in order])
    for a, b in zip(*handles):
        assert (a.slot, a.num_computed_tokens, a.num_prompt_tokens, a.drafted_per_pos, a.accepted_per_pos) == \
            (b.slot, b.num_computed_tokens, b.num_prompt_tokens, b.drafted_per_pos, b.accepted_per_pos)
    assert np.array_equal(tables[0].gen, tables[1].gen)
    for name in COUNTERS + ("drafted_hist", "accepted_hist"):
        assert np.array_equal(getattr(tables[0], name), getattr(tables[1], name)), name
    # the freed slots come back in the same order, the last freed first
    again = [[t.attach(Request(f"n{i}", [1], SamplingParams(max_tokens=2), 0)) for i in range(4)] for t in tables]
    assert again[0] == again[1] == [handles[1][i].slot for i in reversed(order)]
