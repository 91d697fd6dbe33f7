"""Padded step shapes (runtime/padding.py), the shapes CUDA graphs are captured for: the pad rows
read and write the scratch page only, the real rows' outputs and pages are what the unpadded step
gives, and every proposer under every schedule stays lossless with its uniform steps padded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specsched.runtime.config import ModelConfig
from specsched.runtime.engine_config import EngineConfig
from specsched.runtime.model import LlamaModel
from specsched.runtime.padding import Padding
from specsched.scheduler.run_config import DEFAULT_CAPTURE_SIZES, capture_sizes
from specsched.runtime.training.mtp_eval import run_requests
from specsched.scheduler.errors import ConfigurationError
from specsched.scheduler.plan import build_plan
from specsched.scheduler.sampling_params import SamplingParams
from tests.proposer_cases import CASES, family_worker, save_tiny_family

PAGE = 8
SHAPE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
             architectures=["LlamaForCausalLM"])


def _plan(qo, kv, pages_per_row=4, masks=None):
    """A plan of rows with `qo` new tokens over `kv` KV tokens, row i on pages i*pages_per_row...."""
    b = len(qo)
    tables = np.arange(b * pages_per_row, dtype=np.int64).reshape(b, pages_per_row)
    return build_plan(np.asarray(qo), np.asarray(kv), tables, PAGE, table_lens=np.full(b, pages_per_row),
                      custom_masks=masks)


def test_capture_sizes_are_checked_and_sorted():
    assert capture_sizes(None) == DEFAULT_CAPTURE_SIZES
    assert capture_sizes([8, 1, 2, 2]) == (1, 2, 8)
    for bad in ([0], [2, -1], ["4"], [True], []):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            capture_sizes(bad)


def test_uniform_steps_take_the_next_capture_size_others_their_own():
    p = Padding((1, 2, 4), scratch_page=99, page_size=PAGE, max_tokens_per_row=4)
    assert p.shape(_plan([1, 1, 1], [5, 9, 3])) == (4, 1)  # three decodes -> four rows
    assert p.shape(_plan([3, 3], [10, 4])) == (2, 3)  # a full size is its own shape
    assert p.shape(_plan([1] * 5, [5] * 5, pages_per_row=1)) is None  # above the largest size
    assert p.shape(_plan([2, 1], [5, 5])) is None  # rows of different lengths (a mixed step)
    assert p.shape(_plan([5], [5])) is None  # more tokens a row than a verify has
    assert p.pad(_plan([2, 1], [5, 5])) is None


def test_pad_rows_use_the_scratch_page_only():
    p = Padding((4,), scratch_page=99, page_size=PAGE, max_tokens_per_row=4)
    tree = [np.tril(np.ones((3, 7), dtype=bool), 4)] * 2  # each row's 3 new tokens over 7 of KV
    plan = _plan([3, 3], [7, 7], masks=tree)
    padded = p.pad(plan)
    assert padded.num_seqs == 4 and padded.num_tokens == 12
    n, k = plan.num_tokens, int(plan.paged_kv_indptr[-1])
    for name in ("positions", "slot_mapping"):  # the real rows' arrays are unchanged
        assert np.array_equal(getattr(padded, name)[:n], getattr(plan, name))
    assert np.array_equal(padded.paged_kv_indices[:k], plan.paged_kv_indices)
    assert set(padded.paged_kv_indices[k:].tolist()) == {99}
    assert set((padded.slot_mapping[n:] // PAGE).tolist()) == {99}
    assert padded.positions[n:].tolist() == [0, 1, 2, 0, 1, 2]
    assert padded.kv_lens.tolist() == [7, 7, 3, 3]
    pad_mask = padded.custom_mask[plan.custom_mask.size:].reshape(2, 3, 3)
    assert (pad_mask == np.tril(np.ones((3, 3), dtype=bool))).all()  # causal over their own tokens


def test_a_plan_of_pad_rows_alone_runs_on_the_scratch_page():
    p = Padding((4,), scratch_page=16, page_size=PAGE, max_tokens_per_row=4)
    plan = p.scratch_plan(4, 3, tree=True)
    assert p.shape(plan) == (4, 3) and p.pad(plan) is plan  # a capture size's shape, as is
    assert set(plan.paged_kv_indices.tolist()) == {16} and plan.kv_lens.tolist() == [3] * 4
    model = LlamaModel.random(ModelConfig.from_hf(SHAPE), seed=0, std=0.3)
    backend = model.attention_backend("torch")
    kv = model.make_kv_cache(16, PAGE, backend=backend)
    out = model(torch.zeros(12, dtype=torch.int64), backend.prepare(plan, "cpu"), kv, torch.from_numpy(plan.positions))
    assert torch.isfinite(out.logits).all() and out.logits.shape[0] == 12
    assert kv.data[:, :16].abs().sum() == 0 and kv.data[:, 16].abs().sum() > 0


def test_a_padded_forward_gives_the_real_rows_their_outputs_and_leaves_other_pages_alone():
    model = LlamaModel.random(ModelConfig.from_hf(SHAPE), seed=0, std=0.3)
    backend = model.attention_backend("torch")
    base = model.make_kv_cache(16, PAGE, backend=backend)
    base.data.normal_(generator=torch.Generator().manual_seed(1))  # every page holds something
    plan = _plan([2, 2, 2], [9, 12, 6], pages_per_row=2)  # rows on pages 0-5
    padding = Padding((4,), base.scratch_page, PAGE, max_tokens_per_row=4)
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    outs, caches = [], []
    for run in (plan, padding.pad(plan)):
        kv = model.make_kv_cache(16, PAGE, backend=backend)
        kv.data.copy_(base.data)
        outs.append(model(ids, backend.prepare(run, "cpu"), kv, torch.from_numpy(run.positions), return_hidden=True))
        caches.append(kv.data)
    assert outs[1].logits.shape == outs[0].logits.shape and outs[1].hidden.shape == outs[0].hidden.shape
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1][:, :6], caches[0][:, :6], rtol=1e-5, atol=1e-5)  # the rows' pages
    assert torch.equal(caches[1][:, 6:16], base.data[:, 6:16])  # nobody's pages: untouched
    assert not torch.equal(caches[1][:, 16], base.data[:, 16])  # the pad row wrote the scratch page


def test_cuda_graph_options_are_validated():
    assert EngineConfig().graph_sizes() == ()
    assert EngineConfig(cuda_graphs=True).graph_sizes() == DEFAULT_CAPTURE_SIZES
    assert EngineConfig(cuda_graphs=True, cuda_graph_sizes=[4, 1]).graph_sizes() == (1, 4)
    with pytest.raises(ConfigurationError, match="enforce-eager"):
        EngineConfig.make(cuda_graphs=False, cuda_graph_sizes=[1, 2])
    with pytest.raises(ConfigurationError, match="cuda_graph_sizes"):
        EngineConfig.make(cuda_graphs=True, cuda_graph_sizes=[0])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(folder, plain greedy outputs) of a tiny random target, a one-layer draft and a head."""
    root = tmp_path_factory.mktemp("padding")
    save_tiny_family(root, ModelConfig.from_hf(SHAPE))
    plain = run_requests(_worker(root, "none", 0), PROMPTS, PARAMS, num_pages=64)
    return root, [r.output_token_ids for r in plain]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 40, 41, 40, 41, 40], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 9, 17)]  # the batch shrinks: 3, 2, 1 rows


def _worker(root, kind, d, **kw):
    return family_worker(root, kind, d, num_pages=64, page_size=16, **kw)


@pytest.mark.parametrize("kind,schedule", [(k, s) for k, (_, _, schedules) in CASES.items() for s in schedules])
def test_every_proposer_and_schedule_is_lossless_with_padded_steps(models, kind, schedule):
    root, plain = models
    worker = _worker(root, kind, CASES[kind][0], cuda_graph_sizes=(1, 4))
    reqs = run_requests(worker, PROMPTS, PARAMS, schedule=schedule, num_pages=64)
    assert [r.output_token_ids for r in reqs] == plain
    caches = [worker.kv] + ([worker.proposer.kv] if kind != "none" and kind != "ngram" else [])
    for kv in caches:  # pad rows ran in the target and in the proposer (and wrote there only)
        assert kv.data[:, kv.scratch_page].abs().sum() > 0


def test_an_adaptive_draft_length_is_lossless_with_padded_steps(models):
    root, plain = models
    worker = _worker(root, "mtp", 3, cuda_graph_sizes=(2, 4))
    reqs = run_requests(worker, PROMPTS, PARAMS, schedule="eager_fill", num_pages=64, adaptive=True)
    assert [r.output_token_ids for r in reqs] == plain
