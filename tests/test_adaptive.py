"""The adaptive draft length: its policy's choices on known acceptance and costs, its
estimates' recovery after a change of workload, and, end to end, that `draft_len="auto"`
stays lossless in the engine's pipeline and replays in the simulator."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from specsched.scheduler.adaptive import PROBE_ROWS, DraftLenPolicy
from specsched.scheduler.draft_policy import Decision, StepView
from specsched.scheduler.online_cost import FEATURES, OnlineCost, cost_models, launch_model, op_features, profile_coef
from specsched.scheduler.step_trace import launch_features
from tests.scripted_policy import ScriptedPolicy
from specsched.simulator.replay import ReplayConfig, replay

SAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "traces" / "samples"


def _teach(policy: DraftLenPolicy, *, verify_ns_per_token: float, draft_ns_per_forward: float,
           const_ns: float = 1e6, rows=(1, 4, 16), widths=(1, 3, 5)) -> None:
    """Feed device intervals from a known linear cost: target forward c + t·tokens, draft
    c + f·row-forwards (varied shapes, so every coefficient is identifiable)."""
    for b in rows:
        for w in widths:
            kv = b * 50
            policy.observe_launch("verify", {"tokens": b * w, "requests": b, "kv_tokens": kv},
                                  int(const_ns + verify_ns_per_token * b * w))
            nd = w - 1
            policy.observe_launch("draft", {"num_draft": nd, "draft_forwards": b * max(nd - 1, 0), "requests": b,
                                            "kv_tokens": kv}, int(const_ns / 10 + draft_ns_per_forward * b * max(nd - 1, 0)))


def _draft_model_policy(prior: float, explore_every: int, fill_ns_per_token: float = 1e5, **costs) -> DraftLenPolicy:
    """A draft model's policy (a fill of its own, KV read ahead) taught `_teach`'s costs and a
    fill of `fill_ns_per_token` per token it reads."""
    p = DraftLenPolicy(4, has_fill=True, kv_ahead=1, lazy_fill=True, prior=prior, explore_every=explore_every)
    _teach(p, **costs)
    for tokens in (2, 8, 64, 512) * 16:
        p.observe_launch("fill", {"tokens": tokens, "requests": 1, "kv_tokens": 50},
                         int(1e6 + fill_ns_per_token * tokens))
    return p


def _taught_at_batch_1() -> DraftLenPolicy:
    """A draft model's policy whose verifies were all at batch 1 (as after a warm-up)."""
    return _draft_model_policy(0.9, 1000, fill_ns_per_token=1e4, verify_ns_per_token=1e5,
                               draft_ns_per_forward=1e5, const_ns=4e6, rows=(1,))


def _choose(policy: DraftLenPolicy, rows: int, remaining: int = 100):
    slots = np.arange(rows)
    return _decide(policy, slots, np.full(rows, remaining), np.full(rows, 50), budget=4096)


def _decide(policy: DraftLenPolicy, slots, remaining, computed, budget, lag=None):
    return policy.choose(StepView(slots, remaining, computed, budget, lag))


def test_online_cost_recovers_a_linear_cost_and_stays_non_negative():
    m = OnlineCost(("const", "tokens", "requests", "kv_tokens"), lam=1e-6)
    rng = np.random.default_rng(0)
    for _ in range(64):
        x = np.array([1.0, rng.integers(1, 200), rng.integers(1, 32), rng.integers(0, 4000)])
        m.add(x, float(2e5 + 3e3 * x[1] + 5e2 * x[3]))
    assert m.coef is not None and (m.coef >= 0).all()
    assert m.predict(np.array([1.0, 100, 8, 1000])) == pytest.approx(2e5 + 3e5 + 5e5, rel=1e-3)


def test_online_cost_folds_queued_samples_as_one_by_one_updates_would():
    """Samples are queued and folded into the sums when the coefficients are read: the sums
    equal those of updating per sample (A <- d A + x x', b <- d b + x y), read after every
    sample or after many."""
    rng = np.random.default_rng(1)
    samples = [(np.array([1.0, *rng.integers(1, 300, size=3)]), float(rng.uniform(1e5, 1e7))) for _ in range(100)]
    m = OnlineCost(("const", "tokens", "requests", "kv_tokens"))
    a, b, scale = np.zeros((4, 4)), np.zeros(4), np.ones(4)
    for i, (x, y) in enumerate(samples):
        m.add(x, y)
        a, b, scale = a * m._decay + np.outer(x, x), b * m._decay + x * y, np.maximum(scale, x)
        if i < 70 or i % 13 == 0:  # reads now and then, as the policy's choices do
            assert m.coef is not None
    state = m.state()
    assert np.allclose(state["a"], a, rtol=1e-12) and np.allclose(state["b"], b, rtol=1e-12)
    assert np.allclose(state["scale"], scale) and state["n"] == 100


@pytest.mark.parametrize("op,attrs", [
    ("forward", {"kind": "decode", "tokens": 7, "requests": 7, "kv_tokens": 700}),
    ("verify", {"tokens": 35, "requests": 7, "kv_tokens": 700}),
    ("draft", {"requests": 7, "num_draft": 4, "draft_tokens": 25, "draft_forwards": 18, "kv_tokens": 700}),
    ("fill", {"tokens": 12, "requests": 3, "kv_tokens": 300}),
])
def test_op_features_read_each_models_features_in_order(op, attrs):
    model = launch_model(op, attrs)
    values = launch_features(attrs) | {"verify": float(op == "verify")}
    values["draft_kv"] = values["kv_tokens"] * values["draft_steps"]
    values["draft_extra_rows"] = values["draft_forwards"] - values["draft_steps"]  # rows past one a step
    assert op_features(model, attrs, op) == tuple(values[f] for f in FEATURES[model])


def test_free_drafting_and_certain_acceptance_pick_the_longest_draft():
    policy = DraftLenPolicy(4, has_fill=False, prior=1.0, explore_every=1000)
    _teach(policy, verify_ns_per_token=1.0, draft_ns_per_forward=0.0, const_ns=1e6)  # verify ~ flat
    d = _choose(policy, 8)
    assert d.draft_len == 4 and (d.num_draft == 4).all()
    assert d.gain is not None and d.gain > 4  # ~5 tokens a step instead of 1, at the same cost


def test_a_verify_priced_too_high_for_the_acceptance_turns_speculation_off():
    policy = DraftLenPolicy(4, has_fill=False, prior=0.2, explore_every=1000)
    # the step's cost is all per token (no fixed cost to amortize): wider verifies cost in proportion
    _teach(policy, verify_ns_per_token=1e6, draft_ns_per_forward=5e5, const_ns=0.0)
    d = _choose(policy, 16)
    assert d.draft_len == 0 and not d.num_draft.any()


def test_speculation_pays_at_batch_1_and_stops_paying_as_the_batch_grows():
    policy = DraftLenPolicy(4, has_fill=False, prior=0.7, explore_every=1000)
    # a fixed cost per forward (weights streamed once) plus a per-token cost
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6, rows=(1, 8, 64))
    small, large = _choose(policy, 1), _choose(policy, 64)
    assert small.draft_len >= 2
    assert large.draft_len < small.draft_len


def test_the_estimates_recover_after_a_change_of_workload():
    policy = DraftLenPolicy(4, has_fill=False, prior=0.8, explore_every=8)
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    slots = np.arange(4)
    assert _choose(policy, 4).draft_len >= 2
    chosen = []
    for _ in range(30):  # every draft rejected at once: speculation turns off
        d = _choose(policy, 4)
        chosen.append((d.draft_len, d.explored))
        policy.observe_verify(slots[: d.rows], d.num_draft, np.zeros(d.rows, dtype=np.int64))
    assert [dl for dl, explored in chosen[-10:] if not explored] == [0] * sum(not e for _, e in chosen[-10:])
    assert any(explored and dl == 1 for dl, explored in chosen[5:])  # it probes D = 1 while off
    seen = []
    for _ in range(80):  # now every draft is accepted: exploration finds it out again
        d = _choose(policy, 4)
        seen.append(d.draft_len)
        policy.observe_verify(slots[: d.rows], d.num_draft, d.num_draft)
    assert seen[-1] >= 2 and max(seen[-10:]) >= 3


def test_a_settled_choice_is_probed_less_and_less_often():
    policy = DraftLenPolicy(4, has_fill=False, prior=0.05, explore_every=4, explore_cost=0.5)  # budget for each
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    slots = np.arange(4)
    probes = []
    for i in range(1, 200):
        d = _choose(policy, 4)
        if d.explored:
            probes.append(i)
        policy.observe_verify(slots[: d.rows], d.num_draft, np.zeros(d.rows, dtype=np.int64))
    gaps = np.diff(probes).tolist()
    assert gaps[:4] == [4, 8, 16, 32] and set(gaps[4:]) == {32}  # doubling, capped at 8 x explore_every


def test_plain_decoding_is_probed_early_while_no_plain_step_has_run():
    """Until a plain step has run, its cost is an extrapolation from verifies (whose fixed cost
    a forward's constant absorbs) and its host overhead borrowed: the first probe, due from the
    fourth decision, is D = 0 -- once the exploration budget pays for it (here about half a
    plain step's tokens lost against 2% of each D = 4 step) -- and once it has run probing goes
    back to its schedule (every 1000 decisions here)."""
    policy = DraftLenPolicy(4, has_fill=False, prior=0.8, explore_every=1000)
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    slots = np.arange(4)
    chosen = []
    for _ in range(40):
        d = _choose(policy, 4)
        chosen.append((d.draft_len, d.explored))
        policy.observe_verify(slots[: d.rows], d.num_draft, d.num_draft)
    probes = [i for i, (_, e) in enumerate(chosen) if e]
    assert len(probes) == 1 and 3 <= probes[0] < 24 and chosen[probes[0]][0] == 0
    assert all(dl == 4 for i, (dl, _) in enumerate(chosen) if i != probes[0])


def test_from_plain_decoding_a_probe_tries_the_length_that_may_pay_most():
    """From D = 0 a due probe goes to the length rated highest with its acceptance read
    `probe_optimism` standard errors above the estimate, not to the neighbour D = 1: here a
    speculative step pays 3 ms of host work a plain step hides, so one draft is the worst way to
    learn whether drafting pays, and nothing is known of the deep positions (the prior alone).
    Read optimistically the longest draft is worth a probe; read at the estimate it is far
    behind and is not probed."""
    def probes(prior: float, optimism: float) -> list[int]:
        policy = DraftLenPolicy(4, has_fill=False, prior=prior, explore_every=4, explore_cost=1.0, plain_ahead=True,
                                probe_optimism=optimism)
        _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
        for d in range(5):
            for _ in range(4):
                policy.overhead.observe(d, 3e6 if d else 0.0)
        chosen = [_choose(policy, 1, remaining=100 + i) for i in range(1, 10)]  # a new batch each step
        assert all(c.draft_len == 0 for c in chosen if not c.explored)
        return [c.draft_len for c in chosen if c.explored]

    assert probes(0.5, 0.5) == [4, 4]
    assert probes(0.4, 0.0) == []
    assert probes(0.4, 2.0) == [4, 4]


def test_a_probe_far_behind_the_best_is_skipped_until_the_longest_interval():
    """Once a length has run, a probe of a neighbour predicted far behind the best (here: every
    draft rejected, D = 0 about twice as fast) is skipped and the interval still doubles, up to
    the longest, which always ends in a probe; with `probe_margin=1` (never far) every probe runs."""
    def probes(margin: float) -> list[int]:
        # a budget for every probe: the schedule is what is under test
        policy = DraftLenPolicy(4, has_fill=False, prior=0.05, explore_every=4, probe_margin=margin, explore_cost=0.5)
        _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
        slots, out = np.arange(4), []
        for i in range(1, 200):
            d = _choose(policy, 4, remaining=100 + i)  # a changed batch each step: nothing held
            if d.explored:
                out.append(i)
            policy.observe_verify(slots[: d.rows], d.num_draft, np.zeros(d.rows, dtype=np.int64))
            policy.observe_step(int(d.device_ns))
        return out

    every, skipping = probes(1.0), probes(0.1)
    assert np.diff(every).tolist()[:4] == [4, 8, 16, 32]
    assert len(skipping) < len(every) and set(np.diff(skipping).tolist()[2:]) == {32}


def test_a_plain_step_choice_stands_over_an_unchanged_batch():
    """D = 0 over the same rows is not re-evaluated for `HOLD_STEPS` decisions (nothing it
    depends on moves then but by a token per row): costs that now favour speculating change the
    choice only after the hold, at once for another batch, and after any verify."""
    from specsched.scheduler.adaptive import HOLD_STEPS

    policy = DraftLenPolicy(4, has_fill=False, prior=0.05, explore_every=1000)
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    assert _choose(policy, 4).draft_len == 0
    policy.global_accept[:] = 1.0  # certain acceptance: speculating pays from here on
    held = [_choose(policy, 4).draft_len for _ in range(HOLD_STEPS + 1)]
    assert held[:HOLD_STEPS] == [0] * HOLD_STEPS and held[HOLD_STEPS] > 0
    policy2 = DraftLenPolicy(4, has_fill=False, prior=0.05, explore_every=1000)
    _teach(policy2, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    assert _choose(policy2, 4).draft_len == 0
    policy2.global_accept[:] = 1.0
    assert _choose(policy2, 3).draft_len > 0  # another batch: decided afresh


def test_a_batch_1_warm_up_prices_a_many_row_draft_by_its_steps():
    """A draft step reads the proposer's weights once, whatever its rows: a warm-up's drafts at
    batch 1 (row-forwards = steps) teach the step's cost, and a 12-row draft is priced at what
    its steps cost, not at 12 rows' worth of them (split between a per-step and a per-row term,
    such a warm-up priced one at 17.9 ms where it took 5.6)."""
    p = DraftLenPolicy(4, has_fill=False, prior=0.8, explore_every=1000, cold_first_launch=False)

    def cost(steps, forwards):  # 0.2 ms a launch, 0.93 ms a step, 0.06 ms a row-forward
        return 2e5 + 9.3e5 * steps + 6e4 * forwards

    for nd in (2, 3, 4) * 8:
        p.observe_launch("draft", {"num_draft": nd, "draft_forwards": nd - 1, "requests": 1, "kv_tokens": 60},
                         int(cost(nd - 1, nd - 1)))
    assert p.costs["draft"].at(3, 0, 3 * 60) == pytest.approx(cost(3, 3), rel=0.05)  # what it was taught
    draft_12_rows = p.costs["draft"].at(3, 36 - 3, 3 * 720)
    assert cost(3, 3) <= draft_12_rows * 1.05 and draft_12_rows < 1.1 * cost(3, 36)


def test_a_draft_cost_state_saved_over_row_forwards_prices_as_it_did():
    """A policy state saved before the draft's model took its rows past one a step (its cost
    state without `features`) is converted on restore and prices every launch as before; a
    state over other features is refused."""
    from specsched.scheduler.online_cost import legacy_draft_state

    old = OnlineCost(("const", "draft_steps", "draft_forwards", "draft_kv"), free_const=False)
    rng = np.random.default_rng(3)
    for _ in range(40):
        rows, steps = int(rng.integers(1, 9)), int(rng.integers(0, 4))
        fwd = rows * steps
        old.add((1.0, float(steps), float(fwd), 50.0 * steps), 2e5 + 9e5 * steps + 5e4 * fwd)
    saved = {k: v for k, v in old.state().items() if k != "features"}
    new = cost_models(None)["draft"]
    new.restore(legacy_draft_state(saved))
    for steps, fwd in ((0, 0), (1, 1), (3, 3), (3, 36), (2, 9)):
        assert new.at(steps, fwd - steps, 50.0 * steps) == pytest.approx(old.at(steps, fwd, 50.0 * steps), rel=1e-9)
    with pytest.raises(ValueError, match="draft_forwards"):
        new.restore(old.state())
    # a profile made from it (a replay's ops its trace never ran) prices the draft as before
    c = dict(zip(old.features, old.coef))
    _, coef = profile_coef("draft", legacy_draft_state(saved)["coef"])
    assert coef["draft_steps"] == pytest.approx(c["draft_steps"])
    assert coef["draft_forwards"] == pytest.approx(c["draft_forwards"])


def test_a_held_plain_step_prices_with_the_models_as_last_fitted(monkeypatch):
    """The policy's host work at D = 0: a held choice reads the cost models as last fitted,
    however many samples its steps queued; a due refit is left to the step's residual
    (`observe_step`, against the models as its launches left them), and the models follow
    what the steps taught."""
    from specsched.scheduler.adaptive import HOLD_STEPS

    policy = DraftLenPolicy(4, has_fill=False, prior=0.05, explore_every=1000, cold_first_launch=False)
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    assert _choose(policy, 4).draft_len == 0
    fits = []
    real_fit = OnlineCost.fit
    monkeypatch.setattr(OnlineCost, "fit", lambda self: (fits.append(self), real_fit(self)))
    before = policy.costs["target"].coef.copy()
    in_choose = 0
    for _ in range(HOLD_STEPS):
        # a plain decode's interval, twice the price the models were taught
        policy.observe_launch("forward", {"kind": "decode", "tokens": 4, "requests": 4, "kv_tokens": 204}, int(16e6))
        n = len(fits)
        dec = _choose(policy, 4)
        in_choose += len(fits) - n
        assert dec.draft_len == 0 and dec.device_ns == pytest.approx(policy.step_ns(4, 0, 0, 200, refit=False))
        policy.observe_step(int(17e6))
    assert in_choose == 0 and policy.costs["target"] in fits  # the refits were the residuals'
    assert policy.costs["target"].at(4, 4, 204) > before @ np.array([1.0, 4, 4, 204, 0.0]) * 1.5


def test_a_request_seen_little_follows_the_engine_wide_estimate_as_it_is_learned():
    """p[i, k] counts the engine-wide estimate as `request_weight` observations: a request
    admitted before the engine learned its rate follows that rate as it is learned, one
    observed often keeps mostly its own."""
    policy = DraftLenPolicy(2, has_fill=False, prior=0.9, request_weight=4.0)
    for slot in range(10):
        policy.start(slot)  # all admitted while the estimate is still the prior
    rows = np.array([0] + list(range(2, 10)))  # row 1 is never verified
    for _ in range(30):  # row 0 accepts both drafts every time, the other rows never
        policy.observe_verify(rows, np.full(9, 2), np.array([2] + [0] * 8))
    p = policy.acceptance(np.array([0, 1]))
    assert policy.global_accept[0] < 0.2  # the engine-wide rate, learned from the first samples
    assert p[1, 0] == pytest.approx(policy.global_accept[0])  # follows it, not the prior it started at
    assert p[0, 0] > 0.6 and p[0, 1] > 0.6  # its own evidence outweighs it


def test_a_verify_costing_more_than_a_decode_of_its_tokens_is_priced_apart():
    """The target model's `verify` term: a verify's fixed extra cost over a decode forward of
    as many tokens (its logits at every position) does not inflate the price of a plain step."""
    policy = DraftLenPolicy(4, has_fill=False, prior=0.7)
    for b in (1, 2, 4, 8):
        for w in (1, 2, 3, 5):
            attrs = {"tokens": b * w, "requests": b, "kv_tokens": 100 * b}
            if w == 1:
                policy.observe_launch("forward", {**attrs, "kind": "decode"}, int(3e6 + 1e5 * b))
            else:
                policy.observe_launch("verify", attrs, int(5e6 + 1e5 * b * w))
    plain = policy.step_ns(4, 0, 0, 400)
    wide = policy.costs["target"].at(12, 4, 412, 1.0)
    assert plain == pytest.approx(3e6 + 4e5, rel=0.05)
    assert wide == pytest.approx(5e6 + 12e5, rel=0.05)


def test_a_draft_model_far_behind_resumes_drafting_only_for_a_long_output():
    """A draft model that skipped fills must read the tokens it missed before it drafts: that
    catch-up is priced over the rows' remaining output, so it is paid for a long one only."""
    def policy():
        return _draft_model_policy(0.8, 1000, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)

    slots, computed = np.arange(1), np.full(1, 50)
    for remaining, lag, on in ((200, 0, True), (4, 0, True), (200, 400, True), (4, 400, False)):
        d = _decide(policy(), slots, np.full(1, remaining), computed, 4096, np.full(1, lag))
        assert (d.draft_len > 0) == on, (remaining, lag, d.draft_len)


def test_a_resume_predicted_close_to_plain_decoding_waits_for_the_exploration_budget():
    """Resuming pays every row's catch-up at once, and a later step that finds plain decoding
    best after all has wasted it: a resume predicted within `probe_margin` of plain decoding is
    taken as a probe -- when the exploration budget pays for the whole catch-up, not before.
    (A margin of 10 makes every resume of this setting such a close call.)"""
    def policy(margin):
        p = _draft_model_policy(0.8, 1000, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
        p.probe_margin, p.probes.explore_cost = margin, 0.05
        return p

    slots, remaining, computed = np.arange(1), np.full(1, 200), np.full(1, 50)
    assert _decide(policy(0.1), slots, remaining, computed, 4096, np.full(1, 400)).draft_len > 0  # a clear gain
    assert _decide(policy(10.0), slots, remaining, computed, 4096, np.zeros(1, dtype=np.int64)).draft_len > 0  # caught up
    p = policy(10.0)
    for first in range(400):
        before = p.probes.budget
        d = _decide(p, slots, remaining, computed, 4096, np.full(1, 400))
        if d.draft_len > 0:
            break
    # the catch-up (400 tokens x 0.1 ms) against 5% of ~4 ms plain steps: ~150 decisions of budget
    assert 100 < first < 256 and d.explored
    assert p.probes.budget < before - 20e6  # the catch-up was paid from it


@pytest.mark.parametrize("per_d", [True, False])
def test_host_overhead_is_learned_per_draft_length(monkeypatch, per_d):
    """Speculative steps carry host work plain ones do not (three launches, not one): measured
    per D, that overhead turns speculation off where device time alone would keep it on;
    pooled over every D (the same policy with per-D estimates disabled) it would not."""
    from specsched.scheduler.step_overhead import StepOverhead

    if not per_d:
        monkeypatch.setattr(StepOverhead, "at", lambda self, d: self.pooled)
    policy = DraftLenPolicy(4, has_fill=False, prior=0.7, explore_every=4)
    _teach(policy, verify_ns_per_token=1e4, draft_ns_per_forward=1e4, const_ns=1e7)  # device: D nearly free
    slots = np.arange(4)
    host_ns = {0: 0.0, 1: 3e7, 2: 3e7, 3: 3e7, 4: 3e7}  # 30 ms more host work in any speculative step
    chosen = []
    for _ in range(200):  # the first plain step is a probe, waiting ~90 decisions for the budget
        d = _choose(policy, 4)
        chosen.append((d.draft_len, d.explored))
        if d.draft_len:
            policy.observe_verify(slots[: d.rows], d.num_draft, np.minimum(d.num_draft, 1))
        policy.observe_step(int(d.device_ns + host_ns[d.draft_len]))
    settled = [c for c, explored in chosen[-40:] if not explored]
    if per_d:
        assert settled.count(0) == len(settled)
    else:
        assert settled.count(0) < len(settled) / 2


def _request_0_fails(steps: int, verify_ns_per_token: float, draft_ns_per_forward: float,
                     lookup_misses: bool = False) -> DraftLenPolicy:
    """A policy serving 4 requests for `steps` decisions, in which request 0 never gets a draft
    accepted (`lookup_misses`: it never drafts anything when asked, as an n-gram lookup that
    finds nothing) while the others have every draft accepted."""
    policy = DraftLenPolicy(4, has_fill=False, prior=0.9, explore_every=1000)
    _teach(policy, verify_ns_per_token=verify_ns_per_token, draft_ns_per_forward=draft_ns_per_forward, const_ns=4e6)
    slots = np.arange(4)
    for _ in range(steps):
        d = _choose(policy, 4)
        drafted, acc = d.num_draft.copy(), d.num_draft.copy()
        acc[0] = 0
        if lookup_misses:
            drafted[0] = 0
        policy.observe_verify(slots[: d.rows], drafted, acc, d.num_draft)
    return policy


def test_a_request_whose_drafts_keep_failing_drafts_less_than_the_others():
    d = _choose(_request_0_fails(20, 1e4, 2e5), 4)
    assert d.draft_len >= 2
    assert d.num_draft[0] < d.num_draft[1:].min()


def test_a_request_whose_drafts_keep_failing_stops_costing_the_verify():
    """Each row verifies what it drafts, so a row's first draft costs a verify position: where
    that is dear, a request whose drafts are never accepted drafts none (its verify is its
    last token) while the others keep speculating."""
    d = _choose(_request_0_fails(30, 1e6, 1e4), 4)
    assert d.draft_len >= 1 and (d.num_draft[1:] >= 1).all()
    assert d.num_draft[0] == 0


def test_a_request_whose_lookups_find_nothing_is_not_asked_to_draft():
    """An n-gram lookup may draft nothing (its verify is then the last token alone): the
    policy learns per request how often a row asked for drafts drafts any, so a request whose
    lookups never find anything stops being asked, and the engine-wide rate prices the rest."""
    policy = _request_0_fails(30, 1e6, 1e4, lookup_misses=True)
    d = _choose(policy, 4)
    assert d.draft_len >= 1 and (d.num_draft[1:] >= 1).all()
    assert d.num_draft[0] == 0
    drawn = policy.estimate.drafts(np.arange(4))
    assert drawn[0] < policy.estimate.draft_rate < drawn[1:].min()
    assert policy.estimate.draft_rate < 1.0  # the misses while request 0 was still asked
    again = DraftLenPolicy(4, has_fill=False, prior=0.9, explore_every=1000)
    again.restore(policy.state())
    assert again.estimate.draft_rate == policy.estimate.draft_rate


def test_new_requests_start_from_the_engine_wide_estimate():
    policy = DraftLenPolicy(3, has_fill=False, prior=0.5)
    for _ in range(200):
        policy.observe_verify(np.array([0]), np.array([3]), np.array([3]))
    policy.start(5)
    assert (policy.accept[5] > 0.9).all()
    assert (policy.global_accept > 0.9).all()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_draft_len >= 1"):
        DraftLenPolicy(0, has_fill=False)
    with pytest.raises(ValueError, match="prior"):
        DraftLenPolicy(2, has_fill=False, prior=1.5)
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="linear proposer"):
        EngineConfig.make(proposer="eagle", draft_len="auto")
    with pytest.raises(ConfigurationError, match="needs draft_len 'auto'"):
        EngineConfig.make(proposer="draft", draft_len=3, draft_profile="p.json")
    assert EngineConfig.make(proposer="mtp", draft_len="auto", max_draft_len=3).proposer_spec().draft_len == 3


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
    from specsched.scheduler.batch_builder import BatchBuilder
    from specsched.scheduler.pipeline import Pipeline
    from specsched.scheduler.sampling_params import SamplingParams

    ahead, dropped = [], []
    run_ahead, without = Pipeline._run_ahead, BatchBuilder.without_finished

    async def launched_ahead(self, batch, launch):
        ahead.append(self._inflight is not None)  # the step before is still in flight
        await run_ahead(self, batch, launch)

    def counted(self, batch):
        out = without(self, batch)
        dropped.append(len(batch) - len(out))
        return out

    monkeypatch.setattr(Pipeline, "_run_ahead", launched_ahead)
    monkeypatch.setattr(BatchBuilder, "without_finished", counted)
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
    got = run_requests(worker, prompts, params, schedule=schedule, policy=_two_plain_then_one_drafting(),
                       pipelines=pipes)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain]
    assert [len(r.output_token_ids) for r in got] == lengths
    assert any(r.num_drafts for r in got)
    assert sum(ahead) >= 5  # plain steps launched with the one before still in flight
    assert sum(dropped) >= 1  # a request finished on the tokens a drafting step waited for
    assert pipes[0].blocks.num_used_pages == 0


def test_a_drafting_step_short_of_pages_preempts_no_request_in_flight(monkeypatch):
    """A pool too small for every request: a step that drafts needs 1 + D slots a row in the
    target's table and the draft model's, so it may preempt; the plain step in flight is
    completed first (a request in flight is never preempted). Lossless, every page back."""
    from specsched.runtime import bundled
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.batch_builder import BatchBuilder
    from specsched.scheduler.sampling_params import SamplingParams

    pipes: list = []
    victims = []
    preempt = BatchBuilder._preempt

    def checked(self, victim):
        inflight = pipes[0]._inflight
        victims.append(inflight is not None and any(r is victim for r in inflight[0].requests))
        preempt(self, victim)

    monkeypatch.setattr(BatchBuilder, "_preempt", checked)
    prompts = [[(17 * i + j) % 420 + 6 for j in range(10 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = run_requests(ModelWorker(str(bundled.target_dir()), {"kind": "none", "draft_len": 0}, num_pages=256),
                         prompts, params)
    # pages of 4 tokens: a drafting step's row may take 2 pages in each of the two tables
    # (a guard of one page a row let this run preempt a request in flight)
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


def test_a_restored_state_continues_the_policy_it_was_taken_from():
    """The state goes through JSON (a trace header) and the restored policy then decides and
    learns as the original does, where a fresh one would not."""
    import orjson

    learned = DraftLenPolicy(4, has_fill=False, prior=0.2, explore_every=5)
    _teach(learned, verify_ns_per_token=1e6, draft_ns_per_forward=5e5, const_ns=0.0)
    for _ in range(7):  # through a probe, so the probe schedule is part of the state
        d = _choose(learned, 16)
        learned.observe_step(int(d.device_ns or 0) + 100_000)
    state = orjson.loads(orjson.dumps(learned.state()))
    fresh = DraftLenPolicy(4, has_fill=False, prior=0.2, explore_every=5)
    restored = DraftLenPolicy(4, has_fill=False, prior=0.2, explore_every=5)
    restored.restore(state)
    assert _choose(fresh, 16).draft_len == fresh.first_draft_len  # no cost known yet
    for step in range(12):
        a, b = _choose(learned, 16), _choose(restored, 16)
        assert (a.draft_len, a.explored, a.rows) == (b.draft_len, b.explored, b.rows), step
        assert a.device_ns == pytest.approx(b.device_ns)
        for p, dec in ((learned, a), (restored, b)):
            p.observe_launch("verify", {"tokens": 16 * (1 + dec.draft_len), "requests": 16, "kv_tokens": 800},
                             int(2e6 + 1e6 * 16 * (1 + dec.draft_len)))
            p.observe_step(int(dec.device_ns or 0) + 100_000)
    for m, c in learned.costs.items():  # the fill has no sample (no fill): None in both
        assert (c.coef is None and restored.costs[m].coef is None) or np.allclose(restored.costs[m].coef, c.coef)
    assert restored.overhead.by_d == pytest.approx(learned.overhead.by_d)
    with pytest.raises(ValueError, match="max_draft_len=4"):
        DraftLenPolicy(3, has_fill=False).restore(state)


def test_a_replay_starts_the_policy_where_the_captured_run_stood():
    from specsched.simulator.fit import fit_profile
    from specsched.traces.reader import read_trace

    tr = read_trace(SAMPLES / "draft_overlap.jsonl")
    prof = fit_profile([tr])
    _, sim = replay(tr, prof, ReplayConfig(draft_len="auto", max_draft_len=4))
    start = sim.header.extra["draft_policy"]
    # the captured run was not adaptive: the policy starts as an engine's does when it serves,
    # after its start-up warm-up request (untraced), which taught it every op's cost
    assert start["decisions"] > 0 and sorted(start["warm_ops"]) == ["draft", "fill", "forward", "verify"]
    assert all(r.request_id != "warmup" for r in sim.requests)
    assert all(rid != "warmup" for s in sim.steps for rid in s.request_ids)
    skipped = read_trace(SAMPLES / "draft_overlap.jsonl")
    skipped.header.engine_config["skip_warmup"] = True
    _, cold = replay(skipped, prof, ReplayConfig(draft_len="auto", max_draft_len=4))
    assert cold.header.extra["draft_policy"]["decisions"] == 0  # the captured engine skipped it
    # the simulated run is adaptive and its header says where its policy started; a replay of
    # it starting elsewhere (as a captured run after a warm-up would) starts there
    learned = DraftLenPolicy(4, has_fill=True, kv_ahead=1)
    _teach(learned, verify_ns_per_token=1e5, draft_ns_per_forward=1e5)
    for _ in range(20):
        _choose(learned, 4)
    sim.header.extra["draft_policy"] = learned.state()
    _, again = replay(sim, prof, ReplayConfig())
    assert again.header.extra["draft_policy"]["decisions"] == 20
    assert again.header.extra["draft_policy"]["costs"] == learned.state()["costs"]
    _, cold = replay(sim, prof, ReplayConfig(policy_state=False))
    assert cold.header.extra["draft_policy"]["decisions"] == 0


@pytest.mark.parametrize("probe_rows", [PROBE_ROWS, 16])
def test_a_probe_waits_until_the_exploration_budget_pays_for_its_catch_up(monkeypatch, probe_rows):
    """Speculation off, a draft model 60 tokens behind on each of 16 rows: a probe of D = 1
    drafts with the first PROBE_ROWS rows only (the others wait a step) and pays their whole
    catch-up, more than `explore_cost` of the first steps -- it waits for the budget, then
    runs on schedule; with every row probing (`probe_rows=16`) the catch-up is four times
    larger and a single probe is paid for in 400 decisions. Caught up, the same policy
    probes on schedule from the first, with every row."""
    import specsched.scheduler.adaptive as adaptive

    monkeypatch.setattr(adaptive, "PROBE_ROWS", probe_rows)

    def policy():
        return _draft_model_policy(0.3, 16, verify_ns_per_token=4e5, draft_ns_per_forward=2e5, const_ns=2e6)

    rows = 16
    slots, remaining, computed = np.arange(rows), np.full(rows, 200), np.full(rows, 300)
    for lag in (60, 0):
        p = policy()
        probes = []
        for i in range(400):
            d = _decide(p, slots, remaining, computed, 4096, np.full(rows, lag))
            assert d.explored or d.draft_len == 0  # plain decoding is the best here
            if d.explored:
                probes.append((i, d.draft_len, d.rows))
            p._held_slots = None  # each step decides afresh (as after a change of batch)
        if not lag:  # caught up: the first probes (at 16, 32) run, with every row
            assert [i for i, _, _ in probes[:2]] == [15, 31] and all(r == rows for _, _, r in probes), probes
        elif probe_rows < rows:  # ~60 decisions' budget for the first, then on the schedule
            assert len(probes) >= 4 and probes[0][0] > 32 and all(r == probe_rows for _, _, r in probes), probes
        else:
            assert len(probes) <= 1 and all(i > 128 for i, _, _ in probes), probes


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


def test_a_warm_up_at_one_draft_length_does_not_price_a_one_token_draft_by_the_context():
    """One request drafting 4 tokens while its context grows (a warm-up): the draft's cost
    rises with KV x forwards. A 1-token draft makes no forward (its token comes from logits
    already there), so a long context must not make it look dear -- with speculation paying
    (acceptance 0.8, a flat target), D = 0 is not the choice at 10x the warm-up's context."""
    p = DraftLenPolicy(4, has_fill=False, prior=0.8, explore_every=1000)
    for kv in range(20, 80, 4):  # draft: 0.3 ms + 0.8 ms a forward step + 2 us per KV token read
        p.observe_launch("draft", {"num_draft": 4, "draft_forwards": 3, "requests": 1, "kv_tokens": kv},
                         int(3e5 + 3 * 8e5 + 3 * 2e3 * kv))
        p.observe_launch("verify", {"tokens": 5, "requests": 1, "kv_tokens": kv + 5}, int(6e6))
        p.observe_launch("forward", {"kind": "decode", "tokens": 1, "requests": 1, "kv_tokens": kv + 1}, int(6e6))
    assert p.step_ns(1, 1, 0, 600) - p.step_ns(1, 0, 0, 600) < 1e6  # the D = 1 draft: ~0.3 ms
    d = _decide(p, np.arange(1), np.full(1, 100), np.full(1, 600), 4096)
    assert d.draft_len >= 1


def test_a_warm_up_s_noise_over_short_prompts_does_not_price_long_drafts_over_long_contexts():
    """The bundled MTP head's draft launches in a measured auto run: a warm-up over a 10-17
    token prompt drafting 2 and 3 tokens, one-token drafts, then one 2-token draft at 65 KV
    tokens. Their spread (1.2-1.9 ms for the same one forward) read as a KV slope priced a
    3-token draft at 160 KV tokens at 3.9 ms -- twice what it costs (1.9 ms measured), which
    kept speculation off where D = 3 ran 1.12x faster than plain decoding. The KV term is
    pulled toward zero (`PULL`): the price stays near the forwards' cost."""
    p = DraftLenPolicy(4, has_fill=False, prior=0.8, explore_every=1000, cold_first_launch=False)
    for nd, kv, us in ((2, 10, 1930), (2, 13, 1370), (2, 15, 1479), (3, 17, 1888), (1, 107, 265), (1, 124, 274),
                       (2, 65, 1674)):
        p.observe_launch("draft", {"num_draft": nd, "draft_forwards": max(nd - 1, 0), "requests": 1,
                                   "kv_tokens": kv}, us * 1000)
    three_tokens_at_160 = p.costs["draft"].at(2, 0, 2 * 160)  # two steps of one row
    assert 1.5e6 < three_tokens_at_160 < 2.5e6


def test_deeper_positions_start_from_the_acceptance_before_them():
    """A deep draft position is observed only when every one before it was accepted (rarely,
    while speculation is off and only probes draft); until it is, its engine-wide estimate
    follows the position before it rather than the fixed prior -- with the bundled head's 0.85
    at the first position, 0.85 at the second too, not 0.7 -- and its own observations take
    over as they come."""
    p = DraftLenPolicy(4, has_fill=False, prior=0.7, explore_every=1000)
    slots = np.arange(8)
    rng = np.random.default_rng(0)
    for _ in range(20):  # one-token drafts: 85% accepted
        p.observe_verify(slots, np.ones(8, dtype=np.int64), (rng.random(8) < 0.85).astype(np.int64))
    ew = p.estimate.engine_wide()
    assert ew[0] == pytest.approx(p.global_accept[0]) and ew[0] > 0.75
    assert np.allclose(ew[1:], ew[0]) and (p.global_accept[1:] == 0.7).all()  # unseen: the one before
    p.start(20)  # a new request starts from the engine-wide estimate
    assert np.allclose(p.acceptance(np.array([20]))[0], ew)
    for _ in range(200):  # four-token drafts: the second position accepted half the time
        acc = np.where(rng.random(8) < 0.85, np.where(rng.random(8) < 0.5, 4, 1), 0)
        p.observe_verify(slots, np.full(8, 4), acc)
    ew = p.estimate.engine_wide()
    assert abs(ew[1] - 0.5) < 0.08 and ew[2] > 0.9  # each position's own rate once seen


def test_one_stalled_step_does_not_move_the_overhead():
    """The overhead is the median of recent residuals: a step the machine stalled (10x its
    usual residual) leaves it where the steps around it put it."""
    from specsched.scheduler.step_overhead import StepOverhead

    h = StepOverhead(4)
    for i in range(10):
        h.observe(2, 1e6 + 1e4 * (i % 3))
    before = h.at(2)
    h.observe(2, 5e7)
    assert h.at(2) == pytest.approx(before, rel=0.02)
    assert h.at(0) == pytest.approx(h.pooled) and h.at(0) < 2e6  # unseen D: the pooled median


def test_plain_steps_that_hide_their_host_work_neither_borrow_nor_lend_overhead():
    """Launched one step ahead (`overlap`, `mtp`), a plain step's residual is ~0 (its host work
    runs behind the device) while a speculative step's holds its host work: pooled together,
    the plain steps' samples priced a barely tried D > 0 as almost free, and a plain step with
    no samples of its own borrowed the speculative steps' host work. Under `sync` every step
    shows its host work, and the pool spans every D."""
    from specsched.scheduler.step_overhead import StepOverhead
    from specsched.scheduler.wiring import draft_len_policy, proposer_spec

    hidden, shown = StepOverhead(4, plain_hidden=True), StepOverhead(4)
    for h in (hidden, shown):
        for _ in range(5):
            h.observe(2, 2e6)  # speculative steps: 2 ms of host work each
    assert hidden.at(0) == 0.0 and shown.at(0) == pytest.approx(2e6)  # no plain sample yet
    for h in (hidden, shown):
        for _ in range(20):
            h.observe(0, 1e4)  # plain steps launched ahead: nothing to show
    assert hidden.at(1) == pytest.approx(2e6)  # unseen D > 0: the speculative steps' host work
    assert shown.at(1) == pytest.approx(1e4)  # pooled with the plain steps: almost free
    assert hidden.at(0) == shown.at(0) == pytest.approx(1e4)  # its own, once it has them

    spec = proposer_spec("draft", 4)
    for schedule, plain_hidden in (("sync", False), ("overlap", True)):
        assert draft_len_policy(spec, schedule=schedule).overhead.plain_hidden is plain_hidden


def test_a_plain_step_forced_by_last_tokens_does_not_stand():
    """A D = 0 that no estimate chose -- every row is at its last token, so none may draft --
    does not stand over the next steps: a request that takes the freed slot drafts at once
    (one that kept the slot number used to be held at D = 0 for `HOLD_STEPS` steps)."""
    policy = DraftLenPolicy(4, has_fill=False, prior=0.9, explore_every=1000)
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    assert _choose(policy, 1, remaining=1).draft_len == 0  # the last token: nothing to draft
    assert _choose(policy, 1, remaining=60).draft_len > 0  # the same slot, a long output left


def test_a_new_request_in_a_slot_ends_a_standing_plain_step():
    """A D = 0 the estimates chose stands over an unchanged batch; a request starting in one of
    its slots makes it another batch, decided afresh."""
    policy = DraftLenPolicy(4, has_fill=False, prior=0.05, explore_every=1000)
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    assert _choose(policy, 4).draft_len == 0
    policy.global_accept[:] = 1.0  # certain acceptance: speculating pays from here on
    assert _choose(policy, 4).draft_len == 0  # the same batch: the choice stands
    policy.start(2)  # a request finished; a new one took its slot
    assert _choose(policy, 4).draft_len > 0


def test_the_overhead_residual_is_taken_against_the_updated_cost_models():
    """A step's residual is its wall time over the device time the models predict once its
    own launches trained them: a decode model first extrapolated from verifies and corrected
    by the step's sample does not also drag the overhead down (the same correction twice)."""
    policy = DraftLenPolicy(4, has_fill=False, prior=0.7, explore_every=1000)
    _teach(policy, verify_ns_per_token=2e5, draft_ns_per_forward=1e5, const_ns=4e6)
    slots = np.arange(1)
    dec = _decide(policy, slots, np.array([100]), np.array([50]), budget=4096)
    # the step ran as the models now say a step of its shape costs, plus 1 ms of host work
    for _ in range(3):
        policy.observe_launch("forward" if dec.draft_len == 0 else "verify",
                              {"kind": "decode", "tokens": 1 + dec.draft_len, "requests": 1, "kv_tokens": 51},
                              int(2e6))  # cheaper than the models predicted at the decision
    # priced on a copy: a refit here would do observe_step's work for it
    actual_device = copy.deepcopy(policy).step_ns(*dec.cost_args)
    assert actual_device < dec.device_ns - 1e5  # the models moved
    policy.observe_step(int(actual_device + 1e6))
    assert policy.overhead.at(dec.draft_len) == pytest.approx(1e6, rel=1e-6)


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


def test_a_step_that_catches_the_proposer_up_does_not_move_the_overhead():
    """A step drafting again after plain steps pays a catch-up fill (priced by its lag): its
    wall time is a transition, not what a step at its D costs. Where a length is reached only
    that way (probes back from D = 0), counting those steps would price it a launch dearer
    (~4 ms measured) and keep speculation off."""
    policy = _draft_model_policy(prior=0.9, explore_every=1000, verify_ns_per_token=2e5,
                                 draft_ns_per_forward=1e5, const_ns=4e6)
    slots = np.arange(2)
    # each step resumes drafting: 40 tokens to catch up, 9 ms of host time more (three steps:
    # the fourth decision probes D = 0, which has not run)
    for _ in range(3):
        dec = _decide(policy, slots, np.full(2, 200), np.full(2, 50), 4096, np.full(2, 40))
        assert dec.draft_len > 0
        policy.observe_step(int(policy.step_ns(*dec.cost_args) + 9e6))
    assert policy.overhead.samples.sum() == 0 and policy.overhead.at(dec.draft_len) < 1e6
    dec = _decide(policy, slots, np.full(2, 200), np.full(2, 50), 4096, np.zeros(2, dtype=np.int64))
    policy.observe_step(int(policy.step_ns(*dec.cost_args) + 1e6))  # a step with nothing to catch up counts
    assert policy.overhead.at(dec.draft_len) == pytest.approx(1e6, rel=1e-6)


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
        self.decisions += 1
        rows = min(len(view.slots), view.budget)
        dec = Decision(0, np.zeros(rows, dtype=np.int64), rows, None)
        self.last = dec
        return dec

    monkeypatch.setattr(adaptive.DraftLenPolicy, "choose", plain)
    tr = read_trace(SAMPLES / sample)
    m, sim = replay(tr, fit_profile([tr]), ReplayConfig(draft_len="auto", max_draft_len=4))
    assert m["draft_len_counts"] == {"0": sum(1 for s in sim.steps if s.draft_len is not None)}
    assert [s.name for s in sim.spans if s.name in ("draft", "draft_fill", "verify")] == []


def test_a_resume_over_more_rows_than_any_verify_had_is_a_probe_that_doubles():
    """Costs learned at batch 1 (a warm-up) price a verify of 47 rows by extrapolation: a
    resume that would catch 47 rows up on that prediction drafts with PROBE_ROWS rows, paid
    from the exploration budget, and each later resume with at most twice the rows a verify
    has had. A batch with nothing to catch up drafts with every row at once (a wrong price
    then costs one step, not a catch-up)."""
    p = _taught_at_batch_1()
    rows = 47
    slots, remaining, computed = np.arange(rows), np.full(rows, 300), np.full(rows, 100)
    lag = np.full(rows, 20)
    assert _decide(p, slots, remaining, computed, 4096, np.zeros(rows, dtype=np.int64)).rows == rows  # caught up
    taken = []
    for _ in range(2000):
        d = _decide(p, slots, remaining, computed, 4096, lag)
        p._held_slots = None
        if d.draft_len:
            taken.append((d.rows, d.explored))
            p.observe_launch("verify", {"tokens": d.rows * (1 + d.draft_len), "requests": d.rows,
                                        "kv_tokens": int(computed[:d.rows].sum())},
                             int(4e6 + 1e5 * d.rows * (1 + d.draft_len)))
            if d.rows == rows:
                break
    # within reach of the verifies seen (2 x 32 rows), a clear gain is no probe
    assert taken == [(4, True), (8, True), (16, True), (32, True), (47, False)], taken


def test_a_resume_beyond_the_verified_rows_is_held_back_when_a_due_probe_was_declined():
    """A probe of plain decoding is due (none has run) and the budget declines it: the best
    length is still a resume over 47 rows that costs learned at batch 1 price by
    extrapolation, and the resume rule holds it back as when no probe was due (it drafted
    with all 47 rows, catching each up, in a simulated run after an engine's warm-up)."""
    p = _taught_at_batch_1()
    rows = 47
    slots, remaining, computed = np.arange(rows), np.full(rows, 300), np.full(rows, 100)
    p.decisions, p.probes.budget = 10, 0.0
    assert not p.plain_seen and p.probes.due(p.decisions + 1, p.plain_seen)
    d = _decide(p, slots, remaining, computed, 4096, np.full(rows, 20))
    assert d.draft_len == 0 and d.rows == rows and not d.explored


def test_after_the_engine_warm_up_the_next_prompts_skip_their_fills():
    """The warm-up's last choice drafted; the prompts admitted after it count as admitted
    before a decision (their fills wait for a step that drafts) -- what it learned stays."""
    p = _draft_model_policy(prior=0.9, explore_every=1000, verify_ns_per_token=1e4, draft_ns_per_forward=1e4)
    d = _choose(p, 1)
    assert d.draft_len > 0 and p.last is d
    decisions, costs = p.decisions, p.state()["costs"]
    p.warmed_up()
    assert p.last is None  # as before any decision: the pipeline's lazy fills wait (`_lazy`)
    assert p.decisions == decisions and p.state()["costs"] == costs


def test_a_state_saved_before_verify_rows_and_warm_ops_were_kept_restores():
    p = DraftLenPolicy(3, has_fill=False, prior=0.5)
    for _ in range(2):
        p.observe_launch("verify", {"tokens": 12, "requests": 3, "kv_tokens": 60}, int(5e6))
    state = p.state()
    assert state["verify_rows"] == 3 and state["warm_ops"] == ["verify"]
    del state["verify_rows"], state["warm_ops"]
    q = DraftLenPolicy(3, has_fill=False, prior=0.5)
    q.restore(state)
    assert q.verify_rows == 0 and q.costs["target"].coef is not None
    assert sorted(q.warm_ops) == ["draft", "fill", "forward", "verify"]  # such a state came from a warm device


def test_an_op_seen_once_is_not_priced_and_the_warm_up_speculates_again():
    """One sample's cost goes wholly to the model's free constant: the first fill of a head
    that caught up a whole prompt (98 tokens, 10 ms) would price every later 3-token fill at
    10 ms, and a warm-up on that price never drafted again. An unseeded model prices nothing
    before its second sample, so the policy's second step speculates again (caught up now),
    and the fills of both steps set the price."""
    cost = OnlineCost(("const", "tokens", "requests", "kv_tokens"))
    cost.add(np.array([1.0, 98, 1, 98]), 10e6)
    assert cost.coef is not None and cost.at(3, 1, 100) is None
    seeded = OnlineCost(("const", "tokens", "requests", "kv_tokens"), prior=np.array([1e6, 1e4, 0.0, 0.0]))
    seeded.add(np.array([1.0, 98, 1, 98]), 10e6)
    assert seeded.at(3, 1, 100) is not None

    p = DraftLenPolicy(4, has_fill=True, fill_same_batch=True, lazy_fill=True, prior=0.8, explore_every=1000,
                       cold_first_launch=False)
    slots, remaining = np.arange(1), np.full(1, 100)

    def step(d, computed, fill_tokens, fill_ns):
        p.observe_launch("draft", {"num_draft": d, "draft_forwards": d - 1, "requests": 1, "kv_tokens": computed},
                         int(0.3e6 * (d - 1)))
        p.observe_launch("verify", {"tokens": 1 + d, "requests": 1, "kv_tokens": computed}, int(4.2e6 + 0.1e6 * d))
        p.observe_launch("fill", {"tokens": fill_tokens, "requests": 1, "kv_tokens": computed}, int(fill_ns))

    first = _decide(p, slots, remaining, np.full(1, 97), 4096, np.full(1, 97))
    assert first.draft_len == p.first_draft_len
    step(first.draft_len, 97, 97 + 1 + first.draft_len, 10e6)  # the catch-up and the step's own fill
    second = _decide(p, slots, remaining, np.full(1, 100), 4096, np.zeros(1, dtype=np.int64))
    assert second.draft_len == p.first_draft_len and not second.explored
    step(second.draft_len, 100, 1 + second.draft_len, 1.3e6)
    p.observe_launch("forward", {"kind": "decode", "tokens": 1, "requests": 1, "kv_tokens": 103}, int(4.1e6))
    third = _decide(p, slots, remaining, np.full(1, 103), 4096, np.zeros(1, dtype=np.int64))
    assert third.draft_len > 0 and third.gain > 1.2  # a 3-token fill is priced ~1.3 ms, not 10


@pytest.mark.parametrize("cold", [True, False])
def test_the_first_launch_of_each_op_teaches_nothing_on_a_device_where_it_is_cold(cold):
    """A real device's first launch of an op pays one-off costs (measured on the bundled MTP
    head: the first fill 21.4 ms for 97 tokens, the next ones 2.6 ms for 2-4 tokens and 4.7 ms
    for 57): its interval is left out of the op's cost model. The simulator's device has no
    such cost and says so (`warm_first_launch`), and its replays keep every interval."""
    from specsched.scheduler.wiring import draft_len_policy, proposer_spec

    p = DraftLenPolicy(4, has_fill=True, fill_same_batch=True, lazy_fill=True, cold_first_launch=cold)
    fills = [(97, 21.4e6)] + [(3, 2.6e6), (57, 4.7e6)] * 4
    for tokens, ns in fills:
        p.observe_launch("fill", {"tokens": tokens, "requests": 1, "kv_tokens": 100}, int(ns))
    three, many = p.costs["fill"].at(3, 1, 100), p.costs["fill"].at(57, 1, 100)
    if cold:
        assert three == pytest.approx(2.6e6, rel=0.1) and many == pytest.approx(4.7e6, rel=0.1)
        assert p.costs["fill"]._n == len(fills) - 1
    else:  # the cold launch bent the line: a 57-token fill priced 1.6x what it took
        assert many > 1.5 * 4.7e6 and p.costs["fill"]._n == len(fills)

    spec = proposer_spec("mtp", 4)
    assert draft_len_policy(spec).warm_ops == []

    from specsched.simulator.device import VirtualDevice

    assert VirtualDevice.warm_first_launch  # what build_pipeline asks of a device
    assert sorted(draft_len_policy(spec, cold_first_launch=False).warm_ops) == ["draft", "fill", "forward", "verify"]


def test_an_auto_run_that_never_drafted_replays_on_its_policy_s_prices(monkeypatch):
    """At a load where speculation does not pay an adaptive run drafts nothing, so its trace
    has no draft, verify or fill span; its header's policy state priced them (learned in the
    run's warm-up), and the profile fitted on the trace takes them from there: `validate`
    replays it, the policy deciding or following the run, where it refused to before."""
    from specsched.scheduler import adaptive
    from specsched.simulator.analysis import validate
    from specsched.simulator.fit import fit_profile
    from specsched.traces.reader import read_trace

    tr = read_trace(SAMPLES / "draft_overlap.jsonl")
    learned = DraftLenPolicy(4, has_fill=True, kv_ahead=1, cold_first_launch=False)
    op = {"verify": "verify", "draft": "draft", "draft_fill": "fill"}
    for s in tr.spans:  # the captured run's own intervals, as its warm-up would have seen them
        if s.track != "host" and s.name in op:
            learned.observe_launch(op[s.name], s.attrs, s.end_ns - s.start_ns)
    orig = adaptive.DraftLenPolicy.choose

    def plain(self, view):
        orig(self, view)
        rows = min(len(view.slots), view.budget)
        self.last = Decision(0, np.zeros(rows, dtype=np.int64), rows, None)
        return self.last

    with monkeypatch.context() as m:
        m.setattr(adaptive.DraftLenPolicy, "choose", plain)
        # from nothing (no engine warm-up either): its header's policy state prices nothing
        _, never = replay(tr, fit_profile([tr]), ReplayConfig(draft_len="auto", max_draft_len=4, policy_state=False))
    assert not [s for s in never.spans if s.name in op]
    bare = fit_profile([never])
    assert not {"verify", "draft", "draft_fill"} & set(bare.device)
    never.header.extra["draft_policy"] = learned.state()
    prof = fit_profile([never])
    verify = learned.costs["target"].at(12, 4, 400, 1.0)
    assert prof.device["verify"].price({"tokens": 12, "requests": 4, "kv_tokens": 400}) == pytest.approx(verify)
    fill = learned.costs["fill"].at(8, 4, 400)
    assert prof.device["draft_fill"].price({"tokens": 8, "requests": 4, "kv_tokens": 400}) == pytest.approx(fill)
    v = validate(never, replicates=1)
    assert abs(v["makespan_err_followed_pct"]) < 2.0 and v["makespan_err_pct"] is not None
    never.header.extra.pop("draft_policy")
    with pytest.raises(ValueError, match="no model for device op"):
        validate(never, replicates=1)


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
