"""Tests for specsched.runtime.proposers.ngram against a brute-force reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specsched.runtime.proposers import NgramProposer


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; for that n, the most recent earlier occurrence of the last n tokens."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
    k=st.integers(1, 6),
)
def test_matches_brute_force(tokens: list[int], min_n: int, extra_n: int, k: int) -> None:
    proposer = NgramProposer(min_n, min_n + extra_n, k)
    expected = reference(tokens, min_n, min_n + extra_n, k)
    assert proposer.propose(tokens) == expected
    assert proposer.propose(np.array(tokens, dtype=np.int64)) == expected


def test_hand_cases() -> None:
    p = NgramProposer(1, 3, 4)
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2, 3]
    assert p.propose([1, 2, 9, 1, 2, 7, 1, 2]) == [7, 1, 2]  # most recent occurrence wins
    assert p.propose([8, 2, 3, 9, 5, 3]) == [9, 5, 3]  # only a 1-gram matches
    assert p.propose([5, 5, 5, 5]) == [5]  # the continuation stops at the end of the sequence
    assert p.propose([1, 2, 3]) == [] and p.propose([]) == [] and p.propose([7]) == []
    assert p.propose([1, 2, 3, 4, 1, 2, 3], num_tokens=2) == [4, 1]
    assert NgramProposer(2, 3, 4).propose([8, 2, 3, 9, 5, 3]) == []
    assert p.find_match([1, 2, 3, 4, 1, 2, 3]) == (3, 3)


def test_long_sequence_prefers_longer_ngram() -> None:
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 1000, 4000)
    seq[100:104] = [1, 2, 3, 4]
    seq[104:108] = [11, 12, 13, 14]
    seq[3000:3002] = [3, 4]
    seq[3002:3006] = [21, 22, 23, 24]
    seq[-4:] = [1, 2, 3, 4]
    p = NgramProposer(2, 4, 4)
    assert p.propose(seq) == [11, 12, 13, 14]  # the 4-gram beats the more recent 2-gram
    assert NgramProposer(2, 2, 4).propose(seq) == [21, 22, 23, 24]
    assert p.propose(seq) == reference(seq.tolist(), 2, 4, 4)


def test_propose_batch_pads_and_counts() -> None:
    p = NgramProposer(1, 2, 3)
    tokens, counts = p.propose_batch([[1, 2, 3, 1, 2], [4, 5], [7, 7], np.array([1, 2, 1])])
    assert counts.tolist() == [3, 0, 1, 2]
    assert tokens.tolist() == [[3, 1, 2], [0, 0, 0], [7, 0, 0], [2, 1, 0]]
    assert tokens.dtype == torch.int64
    tokens, counts = p.propose_batch([[4, 5, 4]], num_tokens=5, pad_id=-1)
    assert tokens.tolist() == [[5, 4, -1, -1, -1]] and counts.tolist() == [2]


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="min_n must be >= 1"):
        NgramProposer(0, 2, 3)
    with pytest.raises(ValueError, match="max_n must be >= min_n"):
        NgramProposer(3, 2, 3)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        NgramProposer(1, 2, 0)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        NgramProposer(1, 2, 3).propose([1, 2, 1], num_tokens=0)
    with pytest.raises(ValueError, match="1-D"):
        NgramProposer(1, 2, 3).propose(np.zeros((2, 2), dtype=np.int64))


def _host_batch(reqs, draft_lens):
    from types import SimpleNamespace
    return SimpleNamespace(requests=reqs, draft_lens=np.asarray(draft_lens, dtype=np.int64))


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20),
    appends=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12),
    d=st.integers(0, 4),
)
def test_host_drafter_matches_the_lookup_as_outputs_grow(prompt, appends, d) -> None:
    """The host drafter's per-slot buffers, extended step by step (past their first size),
    draft what the plain lookup drafts from prompt + output at every step."""
    from specsched.runtime.proposers.ngram import NgramHostDrafter
    from specsched.scheduler.request import Request
    from specsched.scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=200)
    reqs = [Request("a", list(prompt), params, 0), Request("b", list(reversed(prompt)) + [1, 2], params, 0)]
    for i, r in enumerate(reqs):
        r.slot = i
    host = NgramHostDrafter(1, 3, 4)
    for step in [[]] + appends:
        for r in reqs:
            r.extend_output(step * 12)  # 12x: the buffers outgrow their first allocation
        tokens, counts = host.draft(_host_batch(reqs, [d, max(d - 1, 0)]))
        for i, (r, k) in enumerate(zip(reqs, [d, max(d - 1, 0)])):
            want = reference(r.all_token_ids, 1, 3, k) if k else []
            assert counts[i] == len(want)
            assert tokens[i, : counts[i]].tolist() == want


def test_host_drafter_rebuilds_for_a_new_request_in_the_slot() -> None:
    """A slot taken over by another request (or one whose output list shrank) is looked up
    in that request's tokens, not the previous occupant's."""
    from specsched.runtime.proposers.ngram import NgramHostDrafter
    from specsched.scheduler.request import Request
    from specsched.scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=50)
    host = NgramHostDrafter(1, 2, 2)
    first = Request("r", [5, 6, 7, 5], params, 0)
    first.slot = 0
    tokens, counts = host.draft(_host_batch([first], [2]))
    assert tokens[0, : counts[0]].tolist() == [6, 7]
    second = Request("r", [9, 8, 9], params, 0)  # same id, same slot, another request
    second.slot = 0
    tokens, counts = host.draft(_host_batch([second], [2]))
    assert tokens[0, : counts[0]].tolist() == [8, 9]
    second.extend_output([3, 9])
    tokens, counts = host.draft(_host_batch([second], [2]))
    assert tokens[0, : counts[0]].tolist() == [3, 9]
    del second.output_token_ids[:]  # shrank: rebuilt from the prompt
    second.num_output_tokens = 0
    tokens, counts = host.draft(_host_batch([second], [2]))
    assert tokens[0, : counts[0]].tolist() == [8, 9]
