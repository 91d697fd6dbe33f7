"""Logit bias and penalties on a step's logits: every column of a verify, chain or tree, sees the request's prompt,
its output so far and the drafts on its own path -- checked against a per-column computation written out."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specsched.runtime.logits_processors import process_logits, window_paths
from specsched.runtime.token_state import SeqState, TokenBuffer
from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.sampling_params import LogitsAdjust, SamplingParams

V = 12


def _reference(logits, prompt, history, adjust):
    """vLLM's order, one column: bias, then repetition (prompt or output), frequency and presence (output)."""
    out = logits.clone()
    for t, b in adjust.logit_bias:
        out[t] += b
    counts = torch.bincount(torch.tensor(history, dtype=torch.int64), minlength=V).float()
    for t in range(V):
        if counts[t] > 0 or t in prompt:
            out[t] = out[t] / adjust.repetition_penalty if out[t] > 0 else out[t] * adjust.repetition_penalty
    return out - adjust.frequency_penalty * counts - adjust.presence_penalty * (counts > 0).float()


def _path(parents, c):
    """Columns on column c's path (its ancestors' and its own, the root's column 0 left out)."""
    got = []
    while c > 0:
        got.append(c)
        c = parents[c]
    return sorted(got)


@pytest.mark.parametrize("tree_parents", [(), (-1, -1, 0, 0, 1, 2)])
def test_each_column_is_penalized_by_the_prompt_the_output_and_the_drafts_on_its_path(tree_parents):
    g = torch.Generator().manual_seed(0)
    width = 1 + (len(tree_parents) or 4)
    parents = [-1, *(p + 1 for p in tree_parents)] if tree_parents else [-1, *range(width - 1)]
    adjusts = [LogitsAdjust(0.5, 0.7, 1.6, ((3, 2.0), (7, -1.5))), None, LogitsAdjust(repetition_penalty=0.8),
               LogitsAdjust(frequency_penalty=-0.4)]
    prompt_lens, ends = np.array([3, 2, 4, 5]), np.array([8, 5, 4, 9])  # row 2: its first output token
    buf = TokenBuffer(32, torch.device("cpu"))
    slots = np.array([5, 0, 2, 3])
    seqs = []
    for s in slots:
        seqs.append(torch.randint(0, V, (10,), generator=g).tolist())
        buf.register(int(s), seqs[-1])
    rows = [SeqState(0.0, 0, 1.0, None, prompt_len=int(p), adjust=a) for p, a in zip(prompt_lens, adjusts)]
    window = torch.randint(0, V, (4, width), generator=g)
    logits = torch.randn((4, width, V), generator=g)
    depths = np.array([len(_path(parents, c)) for c in range(width)])
    got = process_logits(logits, rows, buf, slots, ends, depths, window, window_paths(width, tree_parents))
    for i, a in enumerate(adjusts):
        for c in range(width):
            if a is None:
                assert torch.equal(got[i, c], logits[i, c])
                continue
            history = seqs[i][prompt_lens[i]:ends[i]] + [int(window[i, j]) for j in _path(parents, c)]
            want = _reference(logits[i, c], seqs[i][:prompt_lens[i]], history, a)
            torch.testing.assert_close(got[i, c], want)
    assert not torch.equal(got, logits)


def test_a_step_without_adjustments_keeps_its_logits():
    logits = torch.randn(2, 3, V)
    rows = [SeqState(0.0, 0, 1.0, None, prompt_len=2)] * 2
    got = process_logits(logits, rows, TokenBuffer(8, torch.device("cpu")), np.array([0, 1]), np.array([3, 3]),
                         np.arange(3))
    assert got is logits


def test_sampling_params_check_their_penalties_and_bias():
    assert SamplingParams().logits_adjust() is None
    assert SamplingParams(logit_bias={5: 0.0}).logits_adjust() is None  # a zero bias changes nothing
    assert SamplingParams(repetition_penalty=1.2, logit_bias={"9": 1, 4: -2}).logits_adjust() == LogitsAdjust(
        repetition_penalty=1.2, logit_bias=((4, -2.0), (9, 1.0)))
    for kw, field in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
                      ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {3: 101}}, "logit_bias"),
                      ({"logit_bias": {-1: 1}}, "logit_bias"), ({"logit_bias": {3: float("nan")}}, "logit_bias")]:
        with pytest.raises(InvalidRequestError, match=field):
            SamplingParams.make(**kw)
