"""Synthetic acceptance (scheduler/synthetic.py) and the simulator's `synthetic:` acceptance: the
schedule an acceptance length gives, the draws' statistics, and bad settings refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from specsched.scheduler.synthetic import SyntheticAcceptance
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
    """1,000 verify steps of 16 rows at D = 4: the mean acceptance length within 1% of the one
    asked for, each position's rate within 0.02; a row drafting fewer accepts at most those."""
    s = SyntheticAcceptance(**setting, independent=independent)
    rng = np.random.default_rng(0)
    accepted = np.concatenate([s.draw(np.full(16, 4), rng) for _ in range(1000)])
    want = s.rates(4)
    assert 1 + accepted.mean() == pytest.approx(1 + want.sum(), rel=0.01)
    assert np.abs([(accepted >= k).mean() for k in range(1, 5)] - want).max() < 0.02
    short = s.draw(np.array([0, 1, 2, 4] * 500), rng)
    assert (short <= np.array([0, 1, 2, 4] * 500)).all() and short[::4].max() == 0


def test_one_draw_per_row_has_the_least_variance():
    """Minimum variance: with AL 2.5 at D = 4 every row accepts 1 or 2 drafts, never 0, 3 or 4."""
    s = SyntheticAcceptance(synthetic_acceptance_length=2.5)
    counts = np.bincount(s.draw(np.full(4000, 4), np.random.default_rng(1)), minlength=5)
    assert counts[0] == counts[3] == counts[4] == 0 and counts[1] > 0 and counts[2] > 0
    independent = SyntheticAcceptance(synthetic_acceptance_length=2.5, independent=True)
    assert np.bincount(independent.draw(np.full(4000, 4), np.random.default_rng(1)), minlength=5)[1:3].sum() \
        == 4000  # the same rates: 1 is sure, 0.5 then


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
    assert AcceptanceModel.parse("synthetic:independent:2.5", None).synthetic.independent
    with pytest.raises(ValueError, match="cannot be reached at draft length 2"):
        AcceptanceModel.parse("synthetic:4", None, max_accept=2)
    with pytest.raises(ValueError, match=r"bad synthetic acceptance 'x'"):
        AcceptanceModel.parse("synthetic:x", None)
