"""Synthetic acceptance (scheduler/synthetic.py) and the simulator's `synthetic:` acceptance: the
schedule an acceptance length gives, the draws' statistics, and bad settings refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from specsched.scheduler.synthetic import SyntheticAcceptance, request_key
from specsched.simulator.acceptance import AcceptanceModel


def test_an_acceptance_length_gives_the_minimum_variance_rates():
    s = SyntheticAcceptance(synthetic_acceptance_length=3.78)
    assert s.rates(7) == pytest.approx([1, 1, 0.78, 0, 0, 0, 0])
    assert SyntheticAcceptance(synthetic_acceptance_length=1.0).rates(3).tolist() == [0, 0, 0]
    given = SyntheticAcceptance(synthetic_acceptance_rates=[0.9, 0.5])
    assert given.rates(4).tolist() == [0.9, 0.5, 0, 0] and given.rates(1).tolist() == [0.9]


@pytest.mark.parametrize("independent", [False, True])
@pytest.mark.parametrize("setting", [{"synthetic_acceptance_length": 1.5}, {"synthetic_acceptance_length": 2.5},
                                     {"synthetic_acceptance_length": 3.5},
                                     {"synthetic_acceptance_rates": (0.9, 0.7, 0.4, 0.1)}])
def test_draws_reach_the_acceptance_asked_for(setting, independent):
    """1,000 verify steps of 16 requests at D = 4 (each step a row's last token 1 + its accepted
    drafts further on): the mean acceptance length within 1% of the one asked for, each
    position's rate within 0.02; a row drafting fewer accepts at most those."""
    s = SyntheticAcceptance(**setting, independent=independent)
    keys = np.array([request_key(f"req-{i}") for i in range(16)])
    positions, steps = np.full(16, 40), []
    for _ in range(1000):
        steps.append(s.draw(np.full(16, 4), keys, positions))
        positions = positions + 1 + steps[-1]
    accepted = np.concatenate(steps)
    want = s.rates(4)
    assert 1 + accepted.mean() == pytest.approx(1 + want.sum(), rel=0.01)
    assert np.abs([(accepted >= k).mean() for k in range(1, 5)] - want).max() < 0.02
    short = s.draw(np.array([0, 1, 2, 4] * 500), np.arange(2000), np.full(2000, 7))
    assert (short <= np.array([0, 1, 2, 4] * 500)).all() and short[::4].max() == 0


def test_one_draw_per_row_has_the_least_variance():
    """Minimum variance: with AL 2.5 at D = 4 every row accepts 1 or 2 drafts, never 0, 3 or 4."""
    s = SyntheticAcceptance(synthetic_acceptance_length=2.5)
    rows = np.arange(4000), np.full(4000, 9)  # keys, positions
    counts = np.bincount(s.draw(np.full(4000, 4), *rows), minlength=5)
    assert counts[0] == counts[3] == counts[4] == 0 and counts[1] > 0 and counts[2] > 0
    independent = SyntheticAcceptance(synthetic_acceptance_length=2.5, independent=True)
    assert np.bincount(independent.draw(np.full(4000, 4), *rows), minlength=5)[1:3].sum() \
        == 4000  # the same rates: 1 is sure, 0.5 then


def test_a_draw_is_a_function_of_the_request_and_its_position():
    """The same (seed, request, position) draws the same count whatever the batch around it, a
    longer draft length keeps a shorter one's accepted prefix (one uniform per row), torch on
    any device computes numpy's counts, and another seed draws others."""
    import torch

    from specsched.scheduler.synthetic import accepted_counts

    s = SyntheticAcceptance(synthetic_acceptance_rates=(0.9, 0.6, 0.3, 0.1))
    keys, positions = np.array([request_key(f"r{i}") for i in range(500)]), np.arange(500) * 3 + 11
    at4 = s.draw(np.full(500, 4), keys, positions)
    assert (s.draw(np.full(250, 4), keys[::2], positions[::2]) == at4[::2]).all()
    assert (s.draw(np.full(500, 2), keys, positions) == np.minimum(at4, 2)).all()
    for independent in (False, True):
        t = SyntheticAcceptance(synthetic_acceptance_rates=(0.9, 0.6, 0.3, 0.1), independent=independent)
        want = t.draw(np.full(500, 4), keys, positions, seed=3)
        got = accepted_counts(torch.tensor(t.thresholds(4)), None, 3, torch.from_numpy(keys),
                              torch.from_numpy(positions), independent)
        assert got.tolist() == want.tolist()
    assert (s.draw(np.full(500, 4), keys, positions, seed=1) != at4).mean() > 0.3


@pytest.mark.parametrize("setting, message", [
    ({}, "exactly one of synthetic_acceptance_length and synthetic_acceptance_rates"),
    ({"synthetic_acceptance_length": 2.0, "synthetic_acceptance_rates": (0.5,)}, "exactly one of"),
    ({"synthetic_acceptance_length": 0.5}, r"synthetic_acceptance_length must be a number >= 1"),
    ({"synthetic_acceptance_length": float("nan")}, r"synthetic_acceptance_length must be a number >= 1"),
    ({"synthetic_acceptance_rates": (0.5, 1.2)}, r"synthetic_acceptance_rates must be one or more rates in \[0, 1\]"),
    ({"synthetic_acceptance_rates": ()}, r"synthetic_acceptance_rates must be one or more rates"),
    ({"synthetic_acceptance_rates": (0.5, 0.7)}, r"synthetic_acceptance_rates must not increase"),
])
def test_bad_settings_are_refused_by_name(setting, message):
    with pytest.raises(ValueError, match=message):
        SyntheticAcceptance(**setting)


def test_an_acceptance_length_beyond_the_draft_length_is_refused():
    with pytest.raises(ValueError, match=r"synthetic_acceptance_length 5.5 cannot be reached at draft length 4 "
                                         r"\(at most 5, counting the bonus token\)"):
        SyntheticAcceptance(synthetic_acceptance_length=5.5).check(4)
    SyntheticAcceptance(synthetic_acceptance_length=5.0).check(4)


def test_the_simulators_synthetic_acceptance_draws_a_step_at_once():
    model = AcceptanceModel.parse("synthetic:0.8,0.6,0.3", None, seed=3, max_accept=4)
    accepted, drafted = model.outcomes(np.arange(3000), np.zeros(3000, dtype=np.int64), np.full(3000, 4))
    assert drafted.tolist() == [4] * 3000
    assert [(accepted >= k).mean() for k in (1, 2, 3, 4)] == pytest.approx([0.8, 0.6, 0.3, 0.0], abs=0.03)
    again = AcceptanceModel.parse("synthetic:0.8,0.6,0.3", None, seed=3, max_accept=4)
    assert again.outcomes(np.arange(3000), np.zeros(3000, dtype=np.int64), np.full(3000, 4))[0].tolist() \
        == accepted.tolist()  # seeded
    other = AcceptanceModel.parse("synthetic:0.8,0.6,0.3", None, seed=4, max_accept=4)
    assert other.outcomes(np.arange(3000), np.zeros(3000, dtype=np.int64), np.full(3000, 4))[0].tolist() \
        != accepted.tolist()
    assert AcceptanceModel.parse("synthetic:independent:2.5", None).synthetic.independent
    with pytest.raises(ValueError, match="cannot be reached at draft length 2"):
        AcceptanceModel.parse("synthetic:4", None, max_accept=2)
    with pytest.raises(ValueError, match=r"bad synthetic acceptance 'x'"):
        AcceptanceModel.parse("synthetic:x", None)


# -- the engine ------------------------------------------------------------------------------------


def _engine_steps(fam, prompts, max_tokens, own=None, **cfg):
    """The spec steps' (drafted, accepted) rows of an engine run, and its outputs; `own[i]`:
    prompt i's own synthetic acceptance (SamplingParams fields)."""
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams
    from specsched.traces import Header, MemoryRecorder

    config = EngineConfig.make(model=str(fam["target"]), draft=str(fam["draft"]) if fam.get("draft") else None,
                               num_pages=512, page_size=4, **cfg)
    # the header a bench writes: the configuration, synthetic acceptance included
    rec = MemoryRecorder(Header.create(source="engine", clock="monotonic_ns", model="tiny", proposer=config.proposer,
                                       schedule=config.schedule, draft_len=config.draft_len,
                                       device={"kind": "host", "name": "host"},
                                       engine_config=config.model_dump(mode="json")))

    async def main():
        outs = [None] * len(prompts)
        async with AsyncEngine(config, tracer=rec) as eng:
            async def one(i):
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **((own or {}).get(i) or {}))
                outs[i] = await eng.generate_all(prompts[i], params)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        return outs

    outs = anyio.run(main)
    rows = [(d, a) for st in rec.to_trace().steps if st.kind == "spec" for d, a in zip(st.num_drafted, st.num_accepted)]
    return rows, outs, rec.to_trace()


def test_the_engine_forces_the_acceptance_asked_for(tiny_family):
    """An acceptance length of 3 at D = 3 (rates 1, 1, 0): every verify accepts exactly two of
    the drafts it made, whatever the target says; requests still finish at max_tokens, and a
    trace's header (the configuration) says the acceptance was synthetic."""
    rows, outs, trace = _engine_steps(tiny_family, [[5, 6, 7], [9, 10, 11, 12]], 24, proposer="draft", draft_len=3,
                                      schedule="overlap", acceptance="synthetic", synthetic_acceptance_length=3.0,
                                      sync_guard=True)  # drawn on the device: no host read
    assert len(rows) > 10 and all(a == min(2, d) for d, a in rows)
    assert [len(o.token_ids) for o in outs] == [24, 24]
    assert trace.header.engine_config["acceptance"] == "synthetic"
    assert trace.header.engine_config["synthetic_acceptance_length"] == 3.0


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_the_engines_synthetic_rates_are_met_on_average(tiny_family, proposer):
    """Rates 0.8, 0.5, 0.2 at D = 3 over a few hundred verifies: the first draft accepted in 80%
    of the rows that drafted one (within 0.07), and for the draft model, which always drafts
    three, a mean acceptance length within 6% of 2.5; for a model and a host proposer alike."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10]] * 4
    rows, _, _ = _engine_steps(tiny_family, prompts, 64, proposer=proposer, draft_len=3, acceptance="synthetic",
                               synthetic_acceptance_rates=[0.8, 0.5, 0.2])
    drafted = [a for d, a in rows if d >= 1]
    assert len(drafted) > 150
    assert np.mean(np.array(drafted) >= 1) == pytest.approx(0.8, abs=0.07)
    if proposer == "draft":
        assert 1 + np.mean([a for d, a in rows if d == 3]) == pytest.approx(2.5, rel=0.06)


def test_a_request_s_own_acceptance_replaces_the_engine_s(tiny_family):
    """A request that sets its own synthetic acceptance length gets it, batched with ones that
    take the engine's: AL 1 (no draft accepted) and AL 4 (every draft) at D = 3 beside the
    engine's 3 (two of three), in the same verifies; the trace records each request's own, and
    the simulator's bare `synthetic` replays the same three."""
    prompts = [[5, 6, 7], [9, 10, 11, 12], [3, 4, 5, 6]]
    own = {0: {"synthetic_acceptance_length": 1.0}, 1: {"synthetic_acceptance_rates": [1.0, 1.0, 1.0]}}
    rows, outs, trace = _engine_steps(tiny_family, prompts, 24, own=own, proposer="draft", draft_len=3,
                                      acceptance="synthetic", synthetic_acceptance_length=3.0)
    assert [len(o.token_ids) for o in outs] == [24, 24, 24]
    ids = {r.request_id: i for i, r in enumerate(sorted(trace.requests, key=lambda r: r.arrival_ns))}
    by_request: dict[int, set] = {}
    for st in trace.steps:
        if st.kind == "spec":
            for rid, d, a in zip(st.request_ids, st.num_drafted, st.num_accepted):
                by_request.setdefault(ids[rid], set()).add(a - min(d, {0: 0, 1: 3, 2: 2}[ids[rid]]))
    assert by_request == {0: {0}, 1: {0}, 2: {0}}
    recorded = [(r.synthetic_acceptance_length, r.synthetic_acceptance_rates)
                for r in sorted(trace.requests, key=lambda r: r.arrival_ns)]
    assert recorded == [(1.0, None), (None, [1.0, 1.0, 1.0]), (None, None)]
    model = AcceptanceModel.parse("synthetic", trace, max_accept=3)
    accepted, _ = model.outcomes(np.array([0, 1, 2] * 50), np.zeros(150, dtype=np.int64), np.full(150, 3))
    assert set(accepted[0::3]) == {0} and set(accepted[1::3]) == {3} and set(accepted[2::3]) == {2}
    # `trace` replays recorded steps, and draws the rest (here: positions past the run) the same way
    model = AcceptanceModel.parse("trace", trace, max_accept=3)
    accepted, _ = model.outcomes(np.array([0, 1, 2] * 50), np.full(150, 1000), np.full(150, 3))
    assert set(accepted[0::3]) == {0} and set(accepted[1::3]) == {3} and set(accepted[2::3]) == {2}


@pytest.mark.parametrize("proposer, schedule", [("draft", "overlap"), ("mtp", "eager_fill")])
def test_the_simulator_replays_the_engines_synthetic_draws_exactly(tiny_family, proposer, schedule):
    """A request's draws are keyed by its id and position, so the simulator replaying an
    engine's run at its configuration draws the very same acceptance wherever a request
    verifies at the same position, whatever the batches its virtual timing makes (which may put
    a plain step, and so a shift, where the engine had none): `--acceptance synthetic`."""
    from specsched.simulator.fit import fit_profile
    from specsched.simulator.replay import ReplayConfig, replay

    fam = tiny_family
    if proposer == "mtp":  # the bundled target and head
        from specsched.runtime import bundled

        fam = {"target": bundled.target_dir(), "draft": None}
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 5, 3, 4, 5], [7, 8, 9, 10]]
    _, _, trace = _engine_steps(fam, prompts, 32, proposer=proposer, draft_len=3, schedule=schedule,
                                acceptance="synthetic", synthetic_acceptance_rates=[0.9, 0.6, 0.3])

    def by_position(tr):
        """(request index, output position) -> (drafted, accepted) of its spec steps."""
        ids = {r.request_id: i for i, r in enumerate(sorted(tr.requests, key=lambda r: r.arrival_ns))}
        pos: dict[str, int] = {}
        out = {}
        for st in sorted(tr.steps, key=lambda st: st.step):
            for j, rid in enumerate(st.request_ids):
                if st.kind == "spec":
                    out[ids[rid], pos.get(rid, 0)] = (st.num_drafted[j], st.num_accepted[j])
                pos[rid] = pos.get(rid, 0) + st.num_output[j]
        return out

    real = by_position(trace)
    _, sim = replay(trace, fit_profile([trace]), ReplayConfig(acceptance="synthetic"))
    simulated = by_position(sim)
    both = real.keys() & simulated.keys()
    assert len(real) > 20 and len(both) > 0.5 * len(real)
    assert {k: simulated[k] for k in both} == {k: real[k] for k in both}
    assert len({a for _, a in real.values()}) > 1  # not one count everywhere


def test_an_eagle_tree_accepts_a_path_of_the_drawn_depth():
    """EAGLE (the bundled head, a top-2 tree of depth 3): an acceptance length of 3 accepts
    exactly two drafts in every verify, and a request with its own AL 1 none, drawn on the
    device (sync guard on); the emitted tokens are that path's drafts and the target's bonus
    token, so every request still finishes at max_tokens."""
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams
    from specsched.traces import Header, MemoryRecorder

    config = EngineConfig.make(proposer="eagle", draft_len=3, schedule="sync", acceptance="synthetic",
                               synthetic_acceptance_length=3.0, sync_guard=True, num_pages=256)
    rec = MemoryRecorder(Header.create(source="engine", clock="monotonic_ns", model="bundled", proposer="eagle",
                                       schedule="sync", draft_len=3, device={"kind": "host", "name": "host"}))

    async def main():
        async with AsyncEngine(config, tracer=rec) as eng:
            a = await eng.generate_all([5, 6, 7, 8], SamplingParams(max_tokens=20, ignore_eos=True))
            b = await eng.generate_all([9, 10, 11], SamplingParams(max_tokens=20, ignore_eos=True,
                                                                    synthetic_acceptance_length=1.0))
        return a, b

    a, b = anyio.run(main)
    assert len(a.token_ids) == 20 and len(b.token_ids) == 20
    trace = rec.to_trace()
    first = min(trace.requests, key=lambda r: r.arrival_ns).request_id
    rows = [(rid == first, d, acc) for st in trace.steps if st.kind == "spec"
            for rid, d, acc in zip(st.request_ids, st.num_drafted, st.num_accepted)]
    assert len(rows) > 5
    assert all(acc == (min(2, d) if mine else 0) for mine, d, acc in rows)


def test_a_synthetic_tree_verify_keeps_the_first_path_of_each_depth():
    """The path kept at depth k ends at the lowest-index node of that depth; its tokens are the
    path's, then the target's token after its last node."""
    import torch

    from specsched.runtime.tree_verify import TreeSpec, synthetic_tree_verify

    tree = TreeSpec.from_parents([-1, 0, 0, 1, 1, 2, 3])  # depths 0, 1, 1, 2, 2, 2, 3
    tokens = torch.tensor([[100, 11, 12, 13, 14, 15, 16]] * 4)
    probs = torch.zeros(4, 7, 50)
    probs[:, torch.arange(7), torch.arange(7) + 40] = 1.0  # after node j the target says 40 + j
    res = synthetic_tree_verify(tokens, tree, probs, torch.tensor([0, 1, 2, 3]), [None] * 4)
    assert res.best_node.tolist() == [0, 1, 3, 6]
    assert res.to_lists() == [[40], [11, 41], [11, 13, 43], [11, 13, 16, 46]]


def test_synthetic_acceptance_keeps_no_draft_the_request_forbids():
    """A draft whose logit is -inf where it is scored (a grammar, min_tokens or a ban forbids it) is never kept: a
    chain keeps the drawn prefix up to it, a tree the deepest path within the drawn depth that avoids it."""
    import torch

    from specsched.runtime.tree_verify import TreeSpec, synthetic_tree_verify
    from specsched.runtime.verify import allowed_drafts, synthetic_verify

    logits = torch.zeros(2, 4, 50)
    logits[0, 1, 12] = float("-inf")  # row 0: the second draft (scored at column 1) is forbidden
    drafts = torch.tensor([[11, 12, 13], [11, 12, 13]])
    probs = torch.softmax(logits, -1)
    res = synthetic_verify(drafts, torch.tensor([3, 3]), probs, torch.tensor([3, 3]), [None, None],
                           allowed_drafts(logits, drafts))
    assert res.num_accepted.tolist() == [1, 3]
    tree = TreeSpec.from_parents([-1, 0, 0, 1, 1, 2, 3])  # depths 0, 1, 1, 2, 2, 2, 3
    tokens = torch.tensor([[100, 11, 12, 13, 14, 15, 16]] * 3)
    logits = torch.zeros(3, 7, 50)
    logits[1, 0, 11] = float("-inf")  # row 1: node 1 (scored at the root) forbidden: its subtree too
    logits[2, 0, 11] = logits[2, 2, 15] = float("-inf")  # row 2: node 5 (under node 2) as well
    res = synthetic_tree_verify(tokens, tree, torch.softmax(logits, -1), torch.tensor([3, 3, 3]), [None] * 3,
                                allowed_drafts(logits, tokens[:, 1:], tree.parents))
    assert res.best_node.tolist() == [6, 5, 2] and res.num_accepted.tolist() == [3, 2, 1]
    assert res.to_lists()[1][:2] == [12, 15]


def test_a_request_s_own_acceptance_is_checked(tiny_family):
    """Its own acceptance needs an engine that speculates to have synthetic acceptance (plain
    decoding has nothing to accept) and a reachable length; a malformed one is refused when the
    parameters are made, naming the field."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.errors import InvalidRequestError
    from specsched.scheduler.sampling_params import SamplingParams

    base = dict(model=str(tiny_family["target"]), draft=str(tiny_family["draft"]), proposer="draft", draft_len=3)
    plain = AsyncEngine(EngineConfig.make(**base))
    with pytest.raises(InvalidRequestError, match="need an engine with acceptance 'synthetic'"):
        plain.validate([5, 6, 7], SamplingParams(synthetic_acceptance_length=2.0))
    plain = AsyncEngine(EngineConfig.make(model=base["model"]))  # no drafts to accept: a phased workload's baseline
    assert plain.validate([5, 6, 7], SamplingParams(synthetic_acceptance_length=2.0)) == [5, 6, 7]
    forced = AsyncEngine(EngineConfig.make(**base, acceptance="synthetic", synthetic_acceptance_length=2.0))
    assert forced.validate([5, 6, 7], SamplingParams(synthetic_acceptance_length=4.0)) == [5, 6, 7]
    with pytest.raises(InvalidRequestError, match="synthetic_acceptance_length 4.5 cannot be reached at draft length 3"):
        forced.validate([5, 6, 7], SamplingParams(synthetic_acceptance_length=4.5))
    with pytest.raises(InvalidRequestError, match="synthetic_acceptance_rates must not increase"):
        SamplingParams.make(synthetic_acceptance_rates=[0.5, 0.9])
    with pytest.raises(InvalidRequestError, match="exactly one of synthetic_acceptance_length"):
        SamplingParams.make(synthetic_acceptance_length=2.0, synthetic_acceptance_rates=[0.5])


def test_the_transition_workload_alternates_acceptance_phases():
    """The bundled transition workload: the bundled prompts in four phases of 16 requests at
    synthetic acceptance lengths 1.5, 3.5, 1.5, 3.5 (at draft lengths >= 3: given as rates, so
    that a shorter one runs it too)."""
    from specsched.runtime.bundled import transition_workload_path, workload_path
    from specsched.runtime.workload import load_workload

    items = load_workload(transition_workload_path())
    lengths = [1 + sum(it.params.synthetic().rates(4)) for it in items]
    assert lengths == [1.5] * 16 + [3.5] * 16 + [1.5] * 16 + [3.5] * 16
    assert [it.prompt for it in items] == [it.prompt for it in load_workload(workload_path())]


def test_a_workload_line_s_own_acceptance_is_checked(tmp_path):
    from specsched.runtime.workload import load_workload
    from specsched.scheduler.errors import InvalidRequestError

    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": [1, 2], "synthetic_acceptance_rates": [0.9, 0.5]}\n'
                    '{"prompt": [1, 2], "synthetic_acceptance_length": 0.5}\n')
    with pytest.raises(InvalidRequestError, match=r"w.jsonl:2: invalid sampling parameter: "
                                                  r"synthetic_acceptance_length must be a number >= 1"):
        load_workload(path)
    assert load_workload(path, limit=1)[0].params.synthetic_acceptance_rates == [0.9, 0.5]


@pytest.mark.parametrize("cfg, message", [
    ({"proposer": "draft", "synthetic_acceptance_length": 2.0}, "synthetic_acceptance_length needs acceptance 'synthetic'"),
    ({"proposer": "draft", "acceptance": "synthetic"}, "exactly one of synthetic_acceptance_length"),
    ({"proposer": "draft", "draft_len": 2, "acceptance": "synthetic", "synthetic_acceptance_length": 3.5},
     r"synthetic_acceptance_length 3.5 cannot be reached at draft length 2"),
    ({"proposer": "draft", "acceptance": "synthetic", "synthetic_acceptance_rates": [0.2, 0.4]},
     "synthetic_acceptance_rates must not increase"),
    ({"acceptance": "synthetic", "synthetic_acceptance_length": 2.0}, "needs a proposer"),
])
def test_the_engine_refuses_a_bad_synthetic_setting_by_name(tiny_family, cfg, message):
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        EngineConfig.make(model=str(tiny_family["target"]), draft=str(tiny_family["draft"]), **cfg)


def test_vllms_speculative_config_is_read_onto_the_configuration(tiny_family):
    from specsched.runtime.engine_config import EngineConfig

    base = {"model": str(tiny_family["target"]), "draft": str(tiny_family["draft"])}
    c = EngineConfig.make(**base, speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                          '"prompt_lookup_min": 2, "prompt_lookup_max": 4, "rejection_sample_method": "synthetic", '
                          '"synthetic_acceptance_rates": [0.9, 0.6]}')
    assert (c.proposer, c.draft_len, c.ngram_min, c.ngram_max, c.acceptance, c.synthetic_acceptance_rates) == \
        ("ngram", 3, 2, 4, "synthetic", [0.9, 0.6])
    d = EngineConfig.make(model=base["model"], speculative_config={"method": "draft_model", "model": base["draft"],
                                                                    "num_speculative_tokens": 2})
    assert (d.proposer, d.draft, d.draft_len, d.acceptance) == ("draft", base["draft"], 2, "lossless")
    assert EngineConfig.make(**base, speculative_config={"method": "eagle3"}).proposer == "eagle"
    assert EngineConfig.make(**base, speculative_config={"method": "deepseek_mtp"}).proposer == "mtp"  # vLLM's alias
    # without a method: the configuration's own proposer, or with a model vLLM's draft_model
    e = EngineConfig.make(**base, proposer="mtp", draft_len=2, speculative_config={
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5})
    assert (e.proposer, e.acceptance, e.synthetic_acceptance_length) == ("mtp", "synthetic", 2.5)
    assert EngineConfig.make(model=base["model"], speculative_config={"model": base["draft"]}).proposer == "draft"


@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa"}, "method 'medusa' is not one of draft_model, mtp, eagle, eagle3, ngram"),
    ({"method": "ngram", "spec_decode_window": 2}, "unsupported key 'spec_decode_window'"),
    ({"method": "ngram", "rejection_sample_method": "strict"}, "rejection_sample_method 'strict'"),
    ("{not json", "speculative_config is not JSON"),
    ('["ngram"]', "speculative_config must be a JSON object"),
])
def test_a_speculative_config_it_cannot_read_is_refused_by_name(spec, message):
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        EngineConfig.make(speculative_config=spec)
    with pytest.raises(ConfigurationError, match=r"speculative_config sets proposer='ngram', the configuration 'draft'"):
        EngineConfig.make(proposer="draft", speculative_config={"method": "ngram"})
