"""EAGLE-3 heads in their published layout: a checkpoint written from random weights computes what
the layout means (checked against a reference written from vLLM's description, on features taken
from transformers' hidden states), loads as the eagle and mtp proposers' head, drafts and verifies
losslessly, maps a smaller draft vocabulary through d2t, and a malformed one is refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specsched.runtime.checkpoint import CheckpointError, load_model, save_llama
from specsched.runtime.config import ModelConfig
from specsched.runtime.eagle3 import Eagle3Head, load_eagle3_head, save_eagle3_head
from specsched.runtime.model import LlamaModel
from specsched.runtime.training.mtp_eval import run_requests
from specsched.runtime.worker import ModelWorker
from specsched.scheduler import wiring
from specsched.scheduler.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, DRAFT_VOCAB, LAYERS = 211, 150, 8
TARGET = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 40, 41, 40, 41, 40], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def random_head(target: LlamaModel, *, hidden: int = 64, draft_vocab: int = DRAFT_VOCAB, seed: int = 0) -> Eagle3Head:
    """A head of its target's width with a draft vocabulary of `draft_vocab` target ids in
    increasing order (d2t: offsets from draft to target ids)."""
    config = ModelConfig.from_hf(dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=80,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
                                      model_type="llama"))
    head = Eagle3Head(config, target_hidden=64, draft_vocab=draft_vocab, layer_ids=(2, LAYERS // 2, LAYERS - 3))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=gen) * 0.3)
        ids = torch.randperm(VOCAB, generator=gen)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
    return head.eval().bind(target)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    save_llama(LlamaModel.random(ModelConfig.from_hf(TARGET), seed=1, std=0.3), root / "target")
    target = load_model(root / "target")
    save_eagle3_head(random_head(target), root / "head")
    worker = ModelWorker(str(root / "target"), {"kind": "none", "draft_len": 0}, num_pages=128, page_size=8)
    plain = [r.output_token_ids for r in run_requests(worker, PROMPTS, PARAMS, num_pages=128)]
    return root, target, plain


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference(t: dict, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 as vLLM describes it, in plain ops: draft-vocabulary logits mapped to target ids."""
    m = "midlayer."
    h = feats @ t["fc.weight"].T
    e = _rms(t["embed"][ids], t[m + "input_layernorm.weight"])
    x = torch.cat([e, _rms(h, t[m + "hidden_norm.weight"])], -1)
    n = ids.shape[0]
    q = (x @ t[m + "self_attn.q_proj.weight"].T).view(n, 4, 16)
    k = (x @ t[m + "self_attn.k_proj.weight"].T).view(n, 2, 16)
    v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, 2, 16)
    pos = torch.arange(n)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / 4.0
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, 64)
    r = h + attn @ t[m + "self_attn.o_proj.weight"].T
    g = _rms(r, t[m + "post_attention_layernorm.weight"])
    r = r + (torch.nn.functional.silu(g @ t[m + "mlp.gate_proj.weight"].T) * (g @ t[m + "mlp.up_proj.weight"].T)) \
        @ t[m + "mlp.down_proj.weight"].T
    draft = _rms(r, t["norm.weight"]) @ t["lm_head.weight"].T
    out = torch.full((n, VOCAB), float("-inf"))
    out[:, torch.arange(DRAFT_VOCAB) + t["d2t"]] = draft
    return out


def test_the_head_computes_the_published_layout_on_the_target_layers_it_names(family):
    root, target, _ = family
    head = load_eagle3_head(root / "head", target)
    assert head.layer_ids == (2, 4, 5) and head.aux_layers == (1, 3, 4)  # the residual stream entering each
    hf = transformers.LlamaForCausalLM.from_pretrained(root / "target").eval()
    ids = torch.tensor(PROMPTS[0] + PROMPTS[2])
    with torch.no_grad():
        states = hf(ids[None], output_hidden_states=True).hidden_states  # [0] embeddings, [L] entering layer L
        feats = torch.cat([states[i][0] for i in head.layer_ids], -1)
        _, ours = target.forward_full(ids[None], head.aux_layers)
        out = head.forward_full(ids[None, 1:], ours[:, :-1])
    t = {**load_file(str(root / "head" / "model.safetensors")), "embed": target.embed_tokens.weight}
    want = reference(t, ids[1:], feats[:-1])
    got = out.logits[0]
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # -inf exactly off the draft vocabulary
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-4, rtol=0)
    assert set(got.argmax(-1).tolist()) <= set((torch.arange(DRAFT_VOCAB) + t["d2t"]).tolist())


@pytest.mark.parametrize("kind, d, schedule", [("eagle", 3, "eager_fill"), ("eagle", 3, "sync"),
                                               ("mtp", 2, "eager_fill")])
def test_an_eagle3_head_drafts_and_verifies_losslessly(family, kind, d, schedule):
    root, _, plain = family
    spec = wiring.proposer_spec(kind, d)
    worker = ModelWorker(str(root / "target"), {"kind": kind, "draft_len": d, "tree_parents": list(spec.tree_parents)},
                         proposer_dir=str(root / "head"), num_pages=128, page_size=8)
    reqs = run_requests(worker, PROMPTS, PARAMS, schedule=schedule, num_pages=128)
    assert [r.output_token_ids for r in reqs] == plain
    assert sum(r.spec_stats()["drafts"] for r in reqs) > 0


def _rewrite(src, dst, config=None, drop=(), change=None):
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **(config or {})}))
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
    tensors.update(change or {})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_malformed_head_is_refused_naming_the_tensor_or_field(family, tmp_path):
    root, target, _ = family
    src = root / "head"
    with pytest.raises(CheckpointError, match="missing tensor 'd2t'.*draft_vocab_size is smaller"):
        load_eagle3_head(_rewrite(src, tmp_path / "no_d2t", drop=("d2t",)), target)
    with pytest.raises(CheckpointError, match=r"shape mismatch for tensor 'fc.weight'.*\(64, 128\).*\(64, 192\)"):
        load_eagle3_head(_rewrite(src, tmp_path / "fc", change={"fc.weight": torch.zeros(64, 128)}), target)
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        load_eagle3_head(_rewrite(src, tmp_path / "ids", config={"eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [0, 3, 5]}}), target)
    with pytest.raises(CheckpointError, match="'d2t'.*outside the target's vocabulary"):
        load_eagle3_head(_rewrite(src, tmp_path / "range", change={"d2t": torch.full((DRAFT_VOCAB,), VOCAB)}), target)
    with pytest.raises(CheckpointError, match="hidden_size 48.*'embed_tokens.weight'"):
        narrow = random_head(target, hidden=48)
        save_eagle3_head(narrow, tmp_path / "narrow")
        load_eagle3_head(tmp_path / "narrow", target)
    # a head whose draft vocabulary is the target's needs no d2t
    full = random_head(target, draft_vocab=VOCAB)
    full.d2t.zero_()
    save_eagle3_head(full, tmp_path / "full")
    _rewrite(tmp_path / "full", tmp_path / "full_no_d2t", drop=("d2t",))
    assert load_eagle3_head(tmp_path / "full_no_d2t", target).compute_logits(torch.zeros(1, 64)).isfinite().all()


def test_dummy_weights_build_an_eagle3_head_from_its_config_alone(family):
    from specsched.runtime.dummy import load_head_for

    root, target, _ = family
    head = load_head_for(root / "head", target, "dummy")
    assert isinstance(head, Eagle3Head) and head.aux_layers == (1, 3, 4)
    logits = head.compute_logits(torch.randn(2, 64))
    assert logits.isfinite().sum() == 2 * DRAFT_VOCAB  # d2t of a dummy head: the first ids
    assert logits[:, :DRAFT_VOCAB].isfinite().all()


def test_train_mtp_trains_an_eagle3_head_in_the_published_layout(family, tmp_path):
    from specsched.runtime.training.mtp import TrainConfig, precompute_hidden, train_head

    root, target, plain = family
    seqs = torch.tensor([(p + out)[:23] for p, out in zip(PROMPTS, plain)])  # the target's own continuations
    feats = precompute_hidden(target, seqs, aux_layers=(1, 3, 4))
    cfg = TrainConfig(seq_len=21, batch_size=3, lr=3e-3, steps=80, seed=0, bf16=False)
    head, stats = train_head(target, seqs, feats, cfg=cfg, aux_layers=(1, 3, 4), eagle3=True, log=lambda *_: None)
    assert stats.final_loss["kl"] < 0.5 * stats.first_loss["kl"]
    save_eagle3_head(head, tmp_path / "head")
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    weights = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (64, 128) and weights["fc.weight"].shape == (64, 192)
    spec = wiring.proposer_spec("eagle", 3)
    worker = ModelWorker(str(root / "target"), {"kind": "eagle", "draft_len": 3, "tree_parents": list(spec.tree_parents)},
                         proposer_dir=str(tmp_path / "head"), num_pages=128, page_size=8)
    reqs = run_requests(worker, PROMPTS, PARAMS, schedule="eager_fill", num_pages=128)
    assert [r.output_token_ids for r in reqs] == plain
    drafts = sum(r.spec_stats()["drafts"] for r in reqs)
    assert 1 + sum(r.spec_stats()["accepted_tokens"] for r in reqs) / drafts > 2.0  # it learnt them
    with pytest.raises(ValueError, match="three target layers"):
        train_head(target, seqs, feats, cfg=cfg, aux_layers=(1, 3), eagle3=True, log=lambda *_: None)
