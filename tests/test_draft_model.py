"""The draft-model proposer's fill over the verify window (the `mtp` schedule): launched before
the host knows the accepted lengths, it must leave the draft exactly where a fill of the
accepted tokens would -- its carried logits those of the draft run teacher-forced up to each
row's new last token -- whatever each row accepted."""
from __future__ import annotations

import numpy as np
import pytest

from specsched.runtime import bundled
from specsched.runtime.proposers.draft_model import DraftModelProposer
from specsched.runtime.tokenizer import Tokenizer
from specsched.runtime.training.mtp_eval import run_requests
from specsched.runtime.worker import ModelWorker
from specsched.runtime.workload import load_workload
from specsched.scheduler import packing, wiring
from specsched.scheduler.proposer import ProposerSpec
from specsched.scheduler.sampling_params import SamplingParams
from tests.window_fills import record_window_fills

D = 3


def _worker(kind: str) -> ModelWorker:
    pdir = bundled.draft_dir() if kind == "draft" else None
    return ModelWorker(str(bundled.target_dir()), {"kind": kind, "draft_len": D if pdir else 0},
                       proposer_dir=str(pdir) if pdir else None, num_pages=256)


def test_only_the_mtp_schedule_fills_a_draft_model_over_the_verify_window():
    assert wiring.proposer_spec("draft", D, schedule="eager_fill").fill_same_batch
    assert not wiring.proposer_spec("draft", D, schedule="overlap").fill_same_batch
    assert not wiring.proposer_spec("draft", D).fill_same_batch
    assert not wiring.proposer_spec("mtp", D).window_fill  # a head's fill is its verify batch anyway
    with pytest.raises(ValueError, match="cannot fill over the verify window"):
        ProposerSpec("ngram", 2, window_fill=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_window_fill_carries_the_logits_after_each_rows_new_last_token(monkeypatch, temperature):
    """Greedy: outputs equal plain decoding's. Sampled (rejection sampling): the fill reads the
    recovered token where a draft was rejected, as it reads the bonus one where none was."""
    tok = Tokenizer(bundled.target_dir())
    prompts = [tok.encode(it.prompt) for it in load_workload(bundled.workload_path(), limit=4)]
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=temperature, seed=5)

    def distance(proposer, slot: int, end: int) -> float:
        """The carried logits against the draft run teacher-forced up to the new last token."""
        w = proposer.worker
        ref = proposer.model.forward_full(w.tokens.data[slot, : end + 1].unsqueeze(0))[0][0, end]
        return float((ref - w.states[slot].carried).abs().max())

    seen = record_window_fills(monkeypatch, DraftModelProposer, 1, distance)
    got = run_requests(_worker("draft"), prompts, params, schedule="eager_fill", max_num_seqs=2)
    assert [r.error for r in got] == [None] * len(got) and all(r.num_output_tokens == 32 for r in got)
    if temperature == 0.0:
        plain = run_requests(_worker("none"), prompts, params)
        assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain]
    counts = np.bincount([a for _, a, _ in seen], minlength=D + 1)
    assert counts[0] and counts[D] and counts[1:D].any()  # rejected at once, partly, all accepted
    assert max(err for _, _, err in seen) < 1e-4


def test_the_window_fill_message_covers_the_verified_positions_one_ahead():
    from specsched.scheduler.block_manager import BlockManager
    from specsched.scheduler.step_batch import StepBatch

    slots, start, nd = np.array([0, 1]), np.array([8, 13]), np.array([3, 1])
    batch = StepBatch(5, [None, None], slots, start, np.ones(2, dtype=np.int64), nd, np.ones(2, dtype=bool),
                      np.zeros(2, dtype=bool), np.zeros(2, dtype=np.int64), [], 1 + D)
    for kind, ahead in (("draft", 1), ("mtp", 0)):  # a draft model reads the emitted tokens, a head the verified
        spec = wiring.proposer_spec(kind, D, schedule="eager_fill")
        msg = packing.verify_fill_message(batch, BlockManager(64, 4, ("target", kind)), spec, with_plan=False)
        assert msg.window and msg.after == "verify"
        assert msg.start.tolist() == (start + ahead).tolist()
        assert msg.end.tolist() == (start + ahead + 1 + nd).tolist()
    # a tree: the root and a position per depth where the row drafted its tree, the root alone where not
    spec = wiring.proposer_spec("eagle", D, schedule="eager_fill")
    batch.draft_lens = np.array([spec.num_candidates, 0])
    msg = packing.verify_fill_message(batch, BlockManager(64, 4, ("target", "mtp")), spec, with_plan=False)
    assert msg.window and msg.start.tolist() == start.tolist()
    assert msg.end.tolist() == (start + 1 + np.array([spec.max_accept, 0])).tolist()
