"""Every proposer is lossless on every model family: a tiny random Qwen2, Qwen3 and Mistral target
(written as the family's checkpoint and loaded back), with a draft model and an MTP / EAGLE head
of the same family, gives token for token what plain greedy decoding of that target gives."""
from __future__ import annotations

import pytest

from specsched.runtime.checkpoint import load_model
from specsched.runtime.config import ModelConfig
from specsched.runtime.training.mtp_eval import run_requests
from specsched.scheduler.sampling_params import SamplingParams
from tests.proposer_cases import family_worker, save_tiny_family

SHAPE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=24),  # != 64 / 4
    "mistral": dict(architectures=["MistralForCausalLM"], sliding_window=None),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 40, 41, 40, 41, 40], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
CASES = {"draft": (3, "overlap"), "mtp": (2, "eager_fill"), "eagle": (3, "sync"), "ngram": (3, "sync")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(folder, plain greedy outputs) of a family's target, draft and head."""
    root = tmp_path_factory.mktemp(request.param)
    config = ModelConfig.from_hf({**SHAPE, **FAMILIES[request.param]})
    save_tiny_family(root, config)
    target = load_model(root / "target")
    assert target.config.model_type == request.param and target.config == config
    worker = family_worker(root, "none", 0, num_pages=128, page_size=8)
    plain = [r.output_token_ids for r in run_requests(worker, PROMPTS, PARAMS, num_pages=128)]
    return root, plain


PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_every_proposer_is_lossless_on_every_family(family, kind):
    root, plain = family
    d, schedule = CASES[kind]
    worker = family_worker(root, kind, d, num_pages=128, page_size=8)
    reqs = run_requests(worker, PROMPTS, PARAMS, schedule=schedule, num_pages=128)
    assert [r.output_token_ids for r in reqs] == plain
    if kind in ("draft", "mtp", "eagle"):
        assert sum(r.spec_stats()["drafts"] for r in reqs) > 0
