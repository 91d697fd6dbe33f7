"""Tests for specsched.runtime.sampling: greedy, seeds, top-k/top-p masks, sampled frequencies."""
from __future__ import annotations

import math

import pytest
import torch

from specsched.runtime.sampling import (
    SamplingTensors,
    apply_top_k_top_p,
    logits_to_probs,
    make_generators,
    sample,
    sample_logits,
)
from specsched.scheduler.sampling_params import SamplingParams


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution: Q(dof/2, stat/2)."""
    half = torch.tensor([dof / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of integer samples to probs [V]; 0 if any sample
    falls outside the support."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs.double()[support] * samples.numel()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    return chi2_sf(float(stat), int(support.sum()) - 1)


def tensors(temperature, top_k=None, top_p=None, seeds=None) -> SamplingTensors:
    b = len(temperature)
    return SamplingTensors(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k or [0] * b, dtype=torch.int64),
        top_p=torch.tensor(top_p or [1.0] * b, dtype=torch.float32),
        generators=make_generators(seeds or [None] * b),
        all_greedy=all(t == 0 for t in temperature),
    )


def test_chi2_helper_matches_known_values() -> None:
    assert chi2_sf(6.0, 2) == pytest.approx(math.exp(-3.0), rel=1e-9)  # dof 2: exp(-x/2)
    assert chi2_sf(7.815, 3) == pytest.approx(0.05, abs=1e-4)  # table critical values
    assert chi2_sf(23.209, 10) == pytest.approx(0.01, abs=1e-4)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    st = SamplingTensors.greedy_batch(7)
    assert torch.equal(sample_logits(logits, st), logits.argmax(-1))
    probs = logits_to_probs(logits, st)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(7))


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    st = tensors([0.0, 1.0, 0.0, 0.7], seeds=[1, 2, 3, 4])
    probs = logits_to_probs(logits, st)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 30).float())
    assert torch.allclose(probs[1], logits[1].softmax(-1), atol=1e-6)
    assert torch.allclose(probs[3], (logits[3] / 0.7).softmax(-1), atol=1e-6)
    for _ in range(20):
        tokens = sample_logits(logits, st)
        assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.zeros(3, 1000)  # uniform: nothing but the seed decides
    st1, st2 = tensors([1.0] * 3, seeds=[5, 5, 6]), tensors([1.0] * 3, seeds=[5, 5, 6])
    seq1 = torch.stack([sample_logits(logits, st1) for _ in range(10)])
    seq2 = torch.stack([sample_logits(logits, st2) for _ in range(10)])
    assert torch.equal(seq1, seq2)
    assert torch.equal(seq1[:, 0], seq1[:, 1])
    assert not torch.equal(seq1[:, 0], seq1[:, 2])


def test_seeded_row_independent_of_batch_neighbours() -> None:
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(2))
    alone = sample_logits(logits, tensors([1.0], seeds=[42]))
    batch_logits = torch.cat([torch.randn(3, 200), logits])
    in_batch = sample_logits(batch_logits, tensors([1.0, 0.5, 0.0, 1.0], seeds=[None, 9, None, 42]))
    assert in_batch[3] == alone[0]


def test_top_k_mask_keeps_k_largest_and_ties() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 3.0, 3.0, 0.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 2]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [False, True, False, True, False]
    assert torch.isfinite(out[1]).tolist() == [False, True, True, False, False]
    off = apply_top_k_top_p(logits, torch.tensor([0, 9]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(off).all()


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.75, 2), (0.81, 3), (0.4, 1), (1e-6, 1), (0.99, 4), (1.0, 4)],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, kept: int) -> None:
    probs = torch.tensor([[0.3, 0.05, 0.5, 0.15]])
    out = apply_top_k_top_p(probs.log(), torch.tensor([0]), torch.tensor([top_p]))
    order = [2, 0, 3, 1]
    finite = torch.isfinite(out[0])
    assert [bool(finite[i]) for i in order] == [True] * kept + [False] * (4 - kept)


def test_bounded_top_k_path_equals_full_sort() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=gen)
    top_k = torch.tensor([1, 5, 40, 40, 7, 12])
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3, 0.95])
    full = apply_top_k_top_p(logits, top_k, top_p)
    bounded = apply_top_k_top_p(logits, top_k, top_p, max_top_k=40)
    assert torch.equal(full, bounded)
    st = tensors([1.0] * 6, top_k=top_k.tolist(), top_p=top_p.tolist())
    assert st.max_top_k == 40 and tensors([1.0, 1.0], top_k=[3, 0]).max_top_k == 0


def test_top_k_then_top_p_renormalizes_between() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k 2 leaves {0.4, 0.3} -> renormalized {0.571, 0.429}; top_p 0.55 then keeps one.
    st = tensors([1.0], top_k=[2], top_p=[0.55])
    assert torch.equal(logits_to_probs(probs.log(), st), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    st = tensors([1.0], top_k=[2], top_p=[0.6])
    assert torch.allclose(logits_to_probs(probs.log(), st), torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_sampled_frequencies_match_filtered_distribution() -> None:
    torch.manual_seed(0)
    base = torch.tensor([0.05, 0.25, 0.1, 0.3, 0.02, 0.18, 0.1])
    n = 100_000
    st = tensors([0.8] * n, top_k=[5] * n, top_p=[0.9] * n)
    probs = logits_to_probs(base.log().expand(n, -1).contiguous(), st)
    expected = probs[0]
    assert int((expected > 0).sum()) == 4  # 0.8 temperature sharpens; top-k 5, top-p 0.9 -> 4 left
    tokens = sample(probs, st.generators, st.greedy)
    assert chi2_pvalue(tokens, expected) > 1e-3
    wrong = (base.log() / 0.8).softmax(-1)  # the unfiltered distribution must be rejected
    assert chi2_pvalue(tokens, wrong) < 1e-12


def test_min_p_drops_tokens_below_its_share_of_the_most_likely() -> None:
    """vLLM's min_p, after temperature, top-k and top-p: min_p 0.2 of a 0.5 token drops those under 0.1; sampled
    frequencies follow the renormalized rest, not the unfiltered distribution; a row without min_p keeps them all."""
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * 20_000 + [SamplingParams(temperature=1.0)]
    st = SamplingTensors.from_params(params)
    probs = logits_to_probs(base.log().expand(len(params), -1).contiguous(), st)
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    torch.testing.assert_close(probs[0], expected)
    torch.testing.assert_close(probs[-1], base)
    torch.manual_seed(0)
    tokens = sample(probs[:-1], [None] * (len(params) - 1))
    assert chi2_pvalue(tokens, expected) > 1e-3 and int((tokens == 3).sum()) == 0
    assert SamplingTensors.from_params([SamplingParams(temperature=1.0)]).min_p is None  # no row: no work


def test_sampled_frequencies_with_seeded_generators() -> None:
    probs = torch.tensor([0.5, 0.2, 0.2, 0.1])
    gens = make_generators(range(4000))
    tokens = sample(probs.expand(4000, -1), gens)
    assert chi2_pvalue(tokens, probs) > 1e-3


def test_from_params_and_validation() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=3)]
    st = SamplingTensors.from_params(params)
    assert not st.all_greedy and st.any_greedy and st.any_top_k and st.any_top_p
    assert st.generators[0] is None and st.generators[1] is not None
    assert st.top_k.tolist() == [0, 5]
    with pytest.raises(ValueError, match="generators"):
        SamplingTensors(torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.ones(2), [None], True)
    with pytest.raises(ValueError, match="logits must be"):
        logits_to_probs(torch.zeros(3, 5), st)
    with pytest.raises(ValueError, match="probs must be"):
        sample(torch.zeros(5), [None])


def test_all_greedy_from_params_is_the_greedy_batch() -> None:
    """An all-greedy batch built from params (seeded or not) is an argmax with neutral
    parameters, whatever top-k / top-p the rows carry, and samples what argmax picks."""
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=1), SamplingParams(temperature=0.0)]
    st = SamplingTensors.from_params(params)
    ref = SamplingTensors.greedy_batch(2)
    assert st.all_greedy and st.any_greedy and not st.any_top_k and not st.any_top_p and st.max_top_k == 0
    for name in ("temperature", "top_k", "top_p"):
        assert torch.equal(getattr(st, name), getattr(ref, name)) and getattr(st, name).dtype == getattr(ref, name).dtype
    assert st.generators == [None, None]
    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_logits(logits, st), logits.argmax(-1))
    assert torch.equal(logits_to_probs(logits, st).argmax(-1), logits.argmax(-1))
