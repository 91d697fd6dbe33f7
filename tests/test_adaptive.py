"""The adaptive draft length: its policy's decisions on given costs and acceptance, its cost
models, and, end to end, that `draft_len="auto"` and policies switching speculation off and on
stay lossless in the engine's pipeline and replay in the simulator."""
from __future__ import annotations

import numpy as np
import pytest

from specsched.scheduler.adaptive import STATE_FORMAT, AdaptivePolicy
from specsched.scheduler.cost_model import OnlineModel, StepCosts
from specsched.scheduler.draft_policy import Decision, StepOutcome, StepView, VerifyOutcome
from specsched.simulator.replay import ReplayConfig, replay
from tests.scripted_policy import ScriptedPolicy

SAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "traces" / "samples"


def _policy(*, token_ns: float, draft_forward_ns: float = 0.0, const_ns: float = 1e6, explore: float = 0.0,
            max_draft_len: int = 4) -> AdaptivePolicy:
    """A draft model's policy priced by a known cost: a target forward const + token_ns a token,
    a draft launch draft_forward_ns a row-forward (a profile's JSON seeds the models)."""
    target = {"coef": {"const": const_ns, "tokens": token_ns}}
    seed = {"device": {"decode": target, "verify": target,
                       "draft": {"coef": {"draft_forwards": draft_forward_ns}}}}
    costs = StepCosts(draft_op=True, has_fill=False, window_fill=False, seed=seed)
    return AdaptivePolicy(max_draft_len, costs, explore=explore)


def _view(rows: int, remaining: int = 100) -> StepView:
    return StepView(np.arange(rows), np.full(rows, remaining), np.full(rows, 50), 4096)


def _verified(policy: AdaptivePolicy, accept, drafted: int = 4, rows: int = 1, steps: int = 40, seed: int = 0) -> None:
    """`steps` verifies of `rows` rows (slot i: acceptance accept[i], or `accept` for all), each
    drafting `drafted`: a draft is accepted with its probability if the ones before it were."""
    rng = np.random.default_rng(seed)
    p = np.broadcast_to(np.asarray(accept, dtype=float), (rows,))
    slots = np.arange(rows)
    for _ in range(steps):
        ok = rng.random((rows, drafted)) < p[:, None]
        accepted = np.cumprod(ok, axis=1).sum(axis=1)
        policy.observe(StepOutcome(None, None, VerifyOutcome(slots, np.ones(rows, bool), np.full(rows, drafted),
                                                             np.full(rows, drafted), accepted)))


def test_free_drafting_and_certain_acceptance_pick_the_longest_draft():
    p = _policy(token_ns=0.0)
    _verified(p, 1.0)
    d = p.choose(_view(1))
    assert d.draft_len == 4 and d.draft_lens.tolist() == [4]


def test_a_verify_priced_too_high_for_the_acceptance_turns_speculation_off():
    p = _policy(token_ns=5e6)  # each verified token costs five forwards' fixed cost
    _verified(p, 0.5)
    d = p.choose(_view(4))
    assert d.draft_len == 0 and d.draft_lens.tolist() == [0, 0, 0, 0] and d.rows == 4


def test_speculation_pays_at_batch_1_and_stops_paying_as_the_batch_grows():
    p = _policy(token_ns=1e5, draft_forward_ns=1e5, const_ns=4e6)
    _verified(p, 0.8, rows=64)
    at = {b: p.choose(_view(b)).draft_len for b in (1, 8, 64)}
    assert at[1] >= 2 and at[1] >= at[8] >= at[64] and at[64] < at[1]


def test_a_request_whose_drafts_keep_failing_stops_costing_the_batch():
    p = _policy(token_ns=1e5, draft_forward_ns=1e5, const_ns=4e6)
    _verified(p, [0.0, 0.9, 0.9, 0.9], rows=4)
    d = p.choose(_view(4))
    assert d.draft_len >= 2 and d.draft_lens[0] == 0 and (d.draft_lens[1:] == d.draft_len).all()


def test_the_policy_recovers_after_a_change_of_workload():
    """Acceptance falls (speculation stops paying: D = 0), then comes back: with no verify at
    D = 0 only exploration, paid from its budget, finds that drafting pays again."""
    p = _policy(token_ns=1e5, draft_forward_ns=1e5, const_ns=4e6, explore=0.05)
    rng = np.random.default_rng(1)
    chosen = []
    for step in range(600):
        accept = 0.9 if step < 150 or step >= 300 else 0.05
        d = p.choose(_view(2))
        chosen.append(d.draft_len)
        if d.draft_len:
            ok = rng.random((2, d.draft_len)) < accept
            acc = np.cumprod(ok, axis=1).sum(axis=1)
            p.observe(StepOutcome(d, None, VerifyOutcome(np.arange(2), np.ones(2, bool), d.draft_lens, d.draft_lens, acc)))
    assert np.mean(chosen[100:150]) >= 2  # drafting pays
    assert np.mean([d == 0 for d in chosen[250:300]]) > 0.8  # it stopped
    assert np.mean(chosen[550:600]) >= 2  # and resumed


def test_while_a_cost_is_unknown_it_drafts_to_learn_it():
    costs = StepCosts(draft_op=True, has_fill=True, window_fill=True)
    p = AdaptivePolicy(4, costs, first_draft_len=2)
    assert p.choose(_view(2)).draft_len == 2
    for op, kind in (("forward", "decode"), ("verify", None), ("draft", None), ("fill", None)):
        for n in (1, 2, 4):
            attrs = {"requests": n, "tokens": 3 * n, "kv_tokens": 50 * n, "draft_len": 2, "draft_forwards": n}
            costs.observe(op, attrs | ({"kind": kind} if kind else {}), int(1e6 + 1e4 * n))
    assert costs.known and p.choose(_view(2)).gain is not None


def test_online_model_recovers_a_linear_cost_and_stays_non_negative():
    m = OnlineModel(("const", "tokens", "requests", "kv_tokens", "padded_attn"))
    rng = np.random.default_rng(0)
    for _ in range(200):
        t, r = int(rng.integers(1, 64)), int(rng.integers(1, 8))
        m.add({"const": 1.0, "tokens": t, "requests": r, "kv_tokens": 50 * r}, 2e6 + 3e4 * t)
    assert m.model().predict({"const": 1, "tokens": 10, "requests": 2, "kv_tokens": 100}) == pytest.approx(2.3e6, rel=0.01)
    assert (m.coef >= 0).all()


def test_the_first_launch_of_each_op_teaches_nothing_on_a_device_where_it_is_cold():
    for cold in (True, False):
        costs = StepCosts(draft_op=False, has_fill=False, window_fill=False, cold_first_launch=cold)
        costs.observe("verify", {"requests": 1, "tokens": 2, "kv_tokens": 10}, int(5e7))  # one-off costs
        for n in (1, 2, 3):
            costs.observe("verify", {"requests": n, "tokens": 2 * n, "kv_tokens": 10 * n}, int(1e6 + 1e5 * n))
        priced = costs.models["target"].model().predict({"const": 1, "requests": 1, "tokens": 2, "kv_tokens": 10, "verify": 1})
        assert (priced == pytest.approx(1.1e6, rel=0.01)) is cold


def test_a_state_restores_and_a_state_of_another_format_or_length_is_refused():
    p = _policy(token_ns=1e5)
    _verified(p, 0.3)
    q = _policy(token_ns=1e5)
    q.restore(p.state())
    assert q.state() == p.state() and q.state()["format"] == STATE_FORMAT
    assert q.choose(_view(1)).draft_len == p.choose(_view(1)).draft_len
    with pytest.raises(ValueError, match="format 1"):
        q.restore({**p.state(), "format": 1})
    with pytest.raises(ValueError, match="max_draft_len=4"):
        _policy(token_ns=1e5, max_draft_len=3).restore(p.state())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_draft_len >= 1"):
        _policy(token_ns=1e5, max_draft_len=0)


@pytest.mark.parametrize("kind,schedule", [("draft", "overlap"), ("mtp", "eager_fill"), ("ngram", "sync"), ("mtp", "sync")])
def test_auto_serves_the_tokens_of_plain_greedy_decoding(kind, schedule):
    from specsched.runtime import bundled
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.sampling_params import SamplingParams

    prompts = [[(7 * i + j) % 500 + 3 for j in range(12 + 3 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = run_requests(ModelWorker(str(bundled.target_dir()), {"kind": "none", "draft_len": 0}, num_pages=256),
                         prompts, params)
    pdir = {"draft": bundled.draft_dir(), "mtp": bundled.mtp_dir()}.get(kind)
    worker = ModelWorker(str(bundled.target_dir()), {"kind": kind, "draft_len": 4},
                         proposer_dir=str(pdir) if pdir else None, num_pages=256)
    for batch in (prompts[:1], prompts):  # batch 1, then 5 at once
        got = run_requests(worker, batch, params, schedule=schedule, adaptive=True)
        assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain[: len(batch)]]
        assert all(r.error is None for r in got)


def test_replay_auto_on_a_captured_trace_records_its_choices_and_keeps_tokens():
    from specsched.simulator.fit import fit_profile
    from specsched.traces.reader import read_trace

    tr = read_trace(SAMPLES / "draft_overlap.jsonl")
    prof = fit_profile([tr])
    fixed, _ = replay(tr, prof, ReplayConfig())
    m, sim = replay(tr, prof, ReplayConfig(draft_len="auto", max_draft_len=4))
    assert m["output_tokens"] == fixed["output_tokens"]
    counts = m["draft_len_counts"]
    assert counts and sum(counts.values()) == sum(1 for s in sim.steps if s.draft_len is not None)
    assert set(counts) <= {"0", "1", "2", "3", "4"}
    assert sim.header.engine_config["draft_len"] == "auto"
    # replaying the simulated auto trace again follows it: the captured run was adaptive
    again, _ = replay(sim, prof, ReplayConfig())
    assert again["draft_len_counts"]
    with pytest.raises(ValueError, match="linear proposer"):
        replay(tr, prof, ReplayConfig(proposer="eagle", draft_len="auto"))


def _two_plain_then_one_drafting() -> ScriptedPolicy:
    """Two plain steps, then one that drafts 3 tokens a row, over and over."""
    return ScriptedPolicy(3, lambda i, view: 0 if i % 3 else 3)


def test_speculation_switched_off_and_on_again_stays_lossless():
    """Every other step plain (a draft model skips its fill then), the others drafting: the
    draft model catches up on the tokens it missed before it drafts again."""
    from specsched.runtime import bundled
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.sampling_params import SamplingParams

    chosen: list[int] = []
    prompts = [[(11 * i + j) % 400 + 5 for j in range(10 + 4 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = run_requests(ModelWorker(str(bundled.target_dir()), {"kind": "none", "draft_len": 0}, num_pages=256),
                         prompts, params)
    for kind, pdir, schedule in (("draft", bundled.draft_dir(), "overlap"), ("draft", bundled.draft_dir(), "sync"),
                                 ("mtp", bundled.mtp_dir(), "mtp")):
        worker = ModelWorker(str(bundled.target_dir()), {"kind": kind, "draft_len": 3}, proposer_dir=str(pdir),
                             num_pages=256)
        policy = _two_plain_then_one_drafting()
        got = run_requests(worker, prompts, params, schedule=schedule, policy=policy)
        chosen += policy.chosen
        assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain], (kind, schedule)
    assert 0 in chosen and any(d > 0 for d in chosen)


@pytest.mark.parametrize("kind,schedule", [("draft", "overlap"), ("draft", "eager_fill"), ("mtp", "eager_fill")])
def test_plain_steps_run_one_ahead_and_rows_finishing_in_flight_leave_the_next_draft(monkeypatch, kind, schedule):
    """With speculation off an adaptive `overlap` / `mtp` schedule launches a plain step
    before the previous one's tokens reach the host (as `plain_overlap`); a step that drafts
    waits for them, and a request finishing on them leaves its batch before it holds pages.
    Token-identical to plain greedy decoding, every page back at the end."""
    from specsched.runtime import bundled
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.sampling_params import SamplingParams
    from specsched.traces import Header, MemoryRecorder

    # one of 3, 4 and 5 tokens ends on the second plain step, before anything was drafted (so
    # whatever the proposer accepts), while the first drafting step waits for it
    prompts = [[(13 * i + j) % 450 + 4 for j in range(8 + 3 * i)] for i in range(9)]
    lengths = [3, 4, 5, 9, 10, 11, 12, 13, 14]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    plain = run_requests(ModelWorker(str(bundled.target_dir()), {"kind": "none", "draft_len": 0}, num_pages=256),
                         prompts, params)
    pdir = {"draft": bundled.draft_dir(), "mtp": bundled.mtp_dir()}.get(kind)
    worker = ModelWorker(str(bundled.target_dir()), {"kind": kind, "draft_len": 3},
                         proposer_dir=str(pdir) if pdir else None, num_pages=256)
    pipes: list = []
    rec = MemoryRecorder(Header.create(source="engine", clock="monotonic_ns", model="bundled", proposer=kind,
                                       schedule=schedule, draft_len=3, device={"kind": "host", "name": "host"}))
    got = run_requests(worker, prompts, params, schedule=schedule, policy=_two_plain_then_one_drafting(),
                       pipelines=pipes, tracer=rec)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain]
    assert [len(r.output_token_ids) for r in got] == lengths
    assert any(r.num_drafts for r in got)
    trace = rec.to_trace()
    host = {}
    for sp in trace.spans:
        if sp.track == "host" and sp.name in ("schedule", "kv_alloc", "output") or sp.name == "launch":
            host.setdefault((sp.name, sp.step, sp.attrs.get("op")), sp)
    # plain steps launched with the one before still in flight: its output comes after their launch
    ahead = [k for (name, k, op), sp in host.items() if name == "launch" and op == "forward"
             and ("output", k - 1, None) in host and host[("output", k - 1, None)].start_ns >= sp.end_ns]
    assert len(ahead) >= 5
    # a drafting step waits for the step in flight: a request finishing on its tokens does so
    # after the drafting step was scheduled and before it holds pages
    spec_steps = [st.step for st in trace.steps if st.kind == "spec"]
    assert any(host[("schedule", k, None)].end_ns <= f.finish_ns <= host[("kv_alloc", k, None)].start_ns
               for k in spec_steps for f in trace.finishes)
    assert pipes[0].blocks.num_used_pages == 0


def test_a_drafting_step_short_of_pages_preempts_no_request_in_flight(monkeypatch):
    """A pool too small for every request: a step that drafts needs 1 + D slots a row in the
    target's table and the draft model's, so it may preempt; the plain step in flight is
    completed first (a request in flight is never preempted). Lossless, every page back."""
    from specsched.runtime import bundled
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.scheduler import Scheduler
    from specsched.scheduler.sampling_params import SamplingParams

    pipes: list = []
    victims = []
    preempt = Scheduler.preempt

    def checked(self, victim):
        inflight = pipes[0].ops.inflight
        victims.append(inflight is not None and any(r is victim for r in inflight[0].requests))
        preempt(self, victim)

    monkeypatch.setattr(Scheduler, "preempt", checked)
    prompts = [[(17 * i + j) % 420 + 6 for j in range(10 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = run_requests(ModelWorker(str(bundled.target_dir()), {"kind": "none", "draft_len": 0}, num_pages=256),
                         prompts, params)
    # pages of 4 tokens: a drafting step's row may take 2 pages in each of the two tables
    # (a guard of one page a row would let this run preempt a request in flight)
    worker = ModelWorker(str(bundled.target_dir()), {"kind": "draft", "draft_len": 3},
                         proposer_dir=str(bundled.draft_dir()), num_pages=256, page_size=4)
    got = run_requests(worker, prompts, params, schedule="overlap", policy=_two_plain_then_one_drafting(),
                       num_pages=42, pipelines=pipes)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain]
    assert victims and not any(victims)  # preempted, none while in flight
    assert pipes[0].blocks.num_used_pages == 0


def _off_then_on(fills: list) -> ScriptedPolicy:
    """D = 0 for the first 30 decisions (until the first two requests are done, 24 steps, and
    two more arrived), then D = 3 (`fills` gets each drafting step's largest lag)."""
    def script(i, view):
        if i <= 30:
            return 0
        fills.append(int(view.lag.max()))
        return 3

    return ScriptedPolicy(3, script)


def _workload_prompts(n: int) -> list[list[int]]:
    from specsched.runtime import bundled
    from specsched.runtime.tokenizer import Tokenizer
    from specsched.runtime.workload import load_workload

    tok = Tokenizer(bundled.target_dir())
    return [tok.encode(item.prompt) for item in load_workload(bundled.workload_path(), limit=n)]


@pytest.mark.parametrize("kind,schedule", [("draft", "overlap"), ("draft", "eager_fill"), ("mtp", "eager_fill")])
def test_prompts_admitted_while_speculation_is_off_are_caught_up_before_drafting(monkeypatch, kind, schedule):
    """With speculation off a draft model or an MTP head skips the fills of new prompts too
    (for a head the device keeps the target's hidden states); when drafting resumes one
    catch-up fill covers the whole prompt, after which the proposer's carried logits are those
    of the proposer run teacher-forced over the same tokens (one that caught up on nothing
    would draft from stale state: lossless, rarely accepted)."""
    from specsched.runtime import bundled
    from specsched.runtime.proposers.draft_model import DraftModelProposer
    from specsched.runtime.proposers.mtp import HeadProposer
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.sampling_params import SamplingParams

    prompts = _workload_prompts(4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def worker(kind):
        pdir = {"draft": bundled.draft_dir(), "mtp": bundled.mtp_dir()}.get(kind)
        return ModelWorker(str(bundled.target_dir()), {"kind": kind, "draft_len": 3 if pdir else 0},
                           proposer_dir=str(pdir) if pdir else None, num_pages=256)

    plain = run_requests(worker("none"), prompts, params, max_num_seqs=2)
    fills: list[int] = []
    caught_up = []
    catch_up, draft_fill = HeadProposer._catch_up, DraftModelProposer.fill

    def record(proposer, msg, reference) -> None:
        """Each caught-up row's (start, carried logits' distance to `reference(tokens, end)`)."""
        w = proposer.worker
        for i, slot in enumerate(msg.slots.tolist()):
            end = int(msg.end[i])
            ref = reference(w.tokens.data[slot, : end + 1].unsqueeze(0), end)
            caught_up.append((int(msg.start[i]), float((ref - w.states[slot].carried).abs().max())))

    def checked(self, msg):
        catch_up(self, msg)

        def ref(seq, end):  # the head run teacher-forced on the target's hidden states
            _, hidden = self.worker.target.forward_full(seq, self.aux_layers)
            return self.head.forward_full(seq[:, 1:], hidden[:, :-1]).logits[0, end - 1]

        record(self, msg, ref)

    def draft_checked(self, msg):  # a draft model's catch-up is a fill after="catch_up"
        draft_fill(self, msg)
        if msg.after == "catch_up":
            record(self, msg, lambda seq, end: self.model.forward_full(seq[:, :end])[0][0, end - 1])

    monkeypatch.setattr(HeadProposer, "_catch_up", checked)
    monkeypatch.setattr(DraftModelProposer, "fill", draft_checked)
    got = run_requests(worker(kind), prompts, params, schedule=schedule, max_num_seqs=2, policy=_off_then_on(fills))
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain]
    assert max(fills) >= len(prompts[2]) - 1  # a late request's proposer had read none of its prompt
    assert all(r.num_drafts > 0 for r in got[2:])
    assert len(caught_up) == 2 and all(start == 0 for start, _ in caught_up)  # whole prompts
    assert max(err for _, err in caught_up) < 1e-4


def test_a_replay_following_the_captured_choices_keeps_them_where_the_policy_would_not():
    """Replaying an adaptive run on costs that differ from its own, the live policy chooses
    other draft lengths; following the captured choices, every step's D is the run's."""
    from specsched.simulator.costs import CostProfile
    from specsched.simulator.fit import fit_profile
    from specsched.simulator.follow import recorded_choices
    from specsched.traces.reader import read_trace

    tr = read_trace(SAMPLES / "draft_overlap.jsonl")
    prof = fit_profile([tr])
    _, run = replay(tr, prof, ReplayConfig(draft_len="auto", max_draft_len=4))  # the "captured" run
    choices = recorded_choices(run)
    assert len(choices) == sum(len(s.request_ids) for s in run.steps if s.draft_len is not None)
    # the verify three times dearer: speculation pays less than the run found
    j = prof.to_json()
    j["device"]["verify"]["coef"] = {k: 3 * v for k, v in j["device"]["verify"]["coef"].items()}
    dear = CostProfile.from_json(j)

    def by_step(t):
        return [s.draft_len for s in sorted(t.steps, key=lambda s: s.step) if s.draft_len is not None]

    captured = by_step(run)
    live = by_step(replay(run, dear, ReplayConfig())[1])
    followed = by_step(replay(run, dear, ReplayConfig(follow_choices=True))[1])
    assert followed == captured
    assert live != captured


@pytest.mark.parametrize("kind,schedule", [("draft", "overlap"), ("draft", "eager_fill"), ("mtp", "eager_fill")])
def test_skipped_fills_and_their_catch_up_read_no_device_value_on_the_host(kind, schedule):
    """Under the host-sync guard (runtime/sync_guard.py) a run whose proposer skips its fills
    and catches up -- a head gathering the hidden states the device kept -- serves plain
    greedy decoding's tokens with no request failing."""
    from specsched.runtime import bundled
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.sampling_params import SamplingParams

    prompts = _workload_prompts(4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = run_requests(ModelWorker(str(bundled.target_dir()), {"kind": "none", "draft_len": 0}, num_pages=256),
                         prompts, params, max_num_seqs=2)
    fills: list[int] = []
    pdir = {"draft": bundled.draft_dir(), "mtp": bundled.mtp_dir()}[kind]
    worker = ModelWorker(str(bundled.target_dir()), {"kind": kind, "draft_len": 3}, proposer_dir=str(pdir),
                         num_pages=256, sync_guard=True)
    got = run_requests(worker, prompts, params, schedule=schedule, max_num_seqs=2, policy=_off_then_on(fills))
    assert [r.error for r in got] == [None] * len(got)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain]
    assert max(fills) > 0  # a catch-up happened


@pytest.mark.parametrize("sample", ["draft_overlap.jsonl", "mtp_mtp.jsonl"])
def test_a_load_where_speculation_never_pays_runs_no_fill(monkeypatch, sample):
    """A proposer with lazy fills reads nothing until the policy first drafts: the prompts
    admitted before its first decision are caught up then, like those admitted while
    speculation is off. A policy that never drafts thus costs what plain decoding does (before,
    the first prompts' fill ran: at 12 concurrent, 3% of a simulated run that never drafted)."""
    from specsched.scheduler import adaptive
    from specsched.simulator.fit import fit_profile
    from specsched.traces.reader import read_trace

    def plain(self, view):
        rows = min(len(view.slots), view.budget)
        dec = Decision(0, np.zeros(rows, dtype=np.int64), rows, None)
        self.last = dec
        return dec

    monkeypatch.setattr(adaptive.AdaptivePolicy, "choose", plain)
    tr = read_trace(SAMPLES / sample)
    m, sim = replay(tr, fit_profile([tr]), ReplayConfig(draft_len="auto", max_draft_len=4))
    assert m["draft_len_counts"] == {"0": sum(1 for s in sim.steps if s.draft_len is not None)}
    assert [s.name for s in sim.spans if s.name in ("draft", "fill", "verify")] == []


def test_a_head_past_its_kept_budget_catches_up_while_speculation_is_off(monkeypatch):
    """With speculation off an MTP head's fills wait and the device keeps the target's hidden
    states of the positions it has not read; past `max_kept_tokens` over a step's rows the head
    reads them in a fill at D = 0, so what the device keeps stays within the budget and one
    forward's tokens (unbounded, it grows with every token served), and the outputs stay those
    of plain greedy decoding."""
    from specsched.runtime import bundled
    from specsched.runtime.proposers.hidden_log import HiddenLog
    from specsched.runtime.proposers.mtp import HeadProposer
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.sampling_params import SamplingParams

    kept, forward_tokens, catch_ups = [], [], []
    keep, catch_up = HiddenLog.keep, HeadProposer._catch_up

    def keeping(self, slots, starts, offsets, hidden):
        keep(self, slots, starts, offsets, hidden)
        forward_tokens.append(int(hidden.shape[0]))
        kept[-1] = max(kept[-1], sum(int(c.hidden.shape[0]) for c in self.chunks))  # tensors held

    def counted(self, msg):
        catch_ups[-1] += 1
        catch_up(self, msg)

    monkeypatch.setattr(HiddenLog, "keep", keeping)
    monkeypatch.setattr(HeadProposer, "_catch_up", counted)
    prompts = _workload_prompts(4)
    params = SamplingParams(max_tokens=64, ignore_eos=True)

    def worker(kind):
        pdir = bundled.mtp_dir() if kind == "mtp" else None
        return ModelWorker(str(bundled.target_dir()), {"kind": kind, "draft_len": 3 if pdir else 0},
                           proposer_dir=str(pdir) if pdir else None, num_pages=256)

    plain = run_requests(worker("none"), prompts, params, max_num_seqs=2)
    budget = 48
    outputs = {}
    for name, limit in (("unbounded", 1 << 20), ("bounded", budget)):
        kept.append(0)
        catch_ups.append(0)
        got = run_requests(worker("mtp"), prompts, params, schedule="eager_fill", max_num_seqs=2,
                           policy=ScriptedPolicy(3, lambda i, view: 0),
                           max_kept_tokens=limit)
        outputs[name] = [r.output_token_ids for r in got]
        assert all(r.num_drafts == 0 for r in got)  # speculation stayed off
    expected = [r.output_token_ids for r in plain]
    assert outputs["bounded"] == expected and outputs["unbounded"] == expected
    assert catch_ups == [0, catch_ups[1]] and catch_ups[1] >= 3
    assert kept[0] > budget + max(forward_tokens)
    assert kept[1] <= budget + max(forward_tokens)
