"""The runtime's decoder matches transformers' LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM and MistralForCausalLM, logits within 1e-4 (fp32), for prefill, paged
incremental decode across page boundaries, multi-token verify chunks, ragged batches, shuffled
page tables and tree (custom mask) verification; greedy generation matches `generate` up to
the first near-tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specsched.runtime.attention import get_backend  # noqa: E402
from specsched.runtime.checkpoint import load_model  # noqa: E402
from specsched.scheduler.plan import build_plan  # noqa: E402

ATOL = 1e-4
VOCAB = 97
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
VARIANTS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=1, rope_scaling=LLAMA3,
                        rope_theta=500000.0),
    "llama_bias": dict(attention_bias=True),
    "qwen2_gqa_tied": dict(family="qwen2", tie_word_embeddings=True),
    "qwen2_mha": dict(family="qwen2", num_attention_heads=4, num_key_value_heads=4),
    "qwen3_head_dim": dict(family="qwen3", head_dim=16),  # 16 != 48 / 4
    "qwen3_mha_tied": dict(family="qwen3", num_key_value_heads=4, tie_word_embeddings=True),
    "mistral": dict(family="mistral", sliding_window=None),
}
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


def make_pair(tmp_path, seed: int = 0, family: str = "llama", **overrides):
    """(transformers model, runtime model) with identical random weights."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                  max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  initializer_range=0.2)  # large enough that attention is far from uniform
    kwargs.update(overrides)
    name = FAMILIES[family]
    config = getattr(transformers, f"{name}Config")(**kwargs)
    hf = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a missing one shows up
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    path = tmp_path / f"model_{seed}"
    hf.save_pretrained(path)
    return hf, load_model(path)


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.as_tensor(ids)[None]).logits[0]


def step(model, kv, seqs, backend=None, **kwargs):
    """Run one packed step. seqs: list of dicts with ids (new tokens), kv_len, pages and
    optional positions / mask. Returns the ModelOutput."""
    backend = backend or get_backend("torch")
    plan = build_plan(
        [len(s["ids"]) for s in seqs], [s["kv_len"] for s in seqs], [s["pages"] for s in seqs],
        kv.page_size, positions=[s.get("positions") for s in seqs],
        custom_masks=[s.get("mask") for s in seqs],
    )
    ids = torch.tensor([t for s in seqs for t in s["ids"]])
    with torch.inference_mode():
        return model(ids, backend.prepare(plan, "cpu"), kv, torch.from_numpy(plan.positions), **kwargs)


@pytest.fixture(params=sorted(VARIANTS))
def pair(request, tmp_path):
    return make_pair(tmp_path, **VARIANTS[request.param])


def test_prefill_and_full_forward_match_transformers(pair):
    hf, model = pair
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        logits, hidden = model.forward_full(ids)
    assert logits.dtype == torch.float32 and logits.shape == (2, 13, VOCAB)
    torch.testing.assert_close(logits, ref.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(model.final_norm(hidden), ref.hidden_states[-1], atol=ATOL, rtol=0)

    kv = model.make_kv_cache(num_pages=8, page_size=4)
    out = step(model, kv, [dict(ids=ids[0].tolist(), kv_len=13, pages=[5, 2, 7, 0])],
               return_hidden=True)
    torch.testing.assert_close(out.logits, ref.logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, hidden[0], atol=ATOL, rtol=0)


def test_incremental_decode_and_verify_chunk_cross_pages(pair):
    hf, model = pair
    ids = torch.randint(0, VOCAB, (30,)).tolist()
    ref = hf_logits(hf, ids)
    kv = model.make_kv_cache(num_pages=12, page_size=4)
    pages = [9, 3, 11, 0, 6, 1, 8, 4]  # shuffled, non-contiguous
    out = step(model, kv, [dict(ids=ids[:6], kv_len=6, pages=pages)])
    torch.testing.assert_close(out.logits, ref[:6], atol=ATOL, rtol=0)
    for t in range(6, 17):  # one token at a time, crossing page boundaries at 8, 12, 16
        out = step(model, kv, [dict(ids=[ids[t]], kv_len=t + 1, pages=pages)])
        torch.testing.assert_close(out.logits[0], ref[t], atol=ATOL, rtol=0)
    out = step(model, kv, [dict(ids=ids[17:23], kv_len=23, pages=pages)])  # verify chunk of 6
    torch.testing.assert_close(out.logits, ref[17:23], atol=ATOL, rtol=0)
    last = torch.tensor([1, 5])
    out = step(model, kv, [dict(ids=ids[23:30], kv_len=30, pages=pages)], logits_indices=last)
    torch.testing.assert_close(out.logits, ref[23:30][last], atol=ATOL, rtol=0)


def test_ragged_batch_equals_each_sequence_alone(tmp_path):
    hf, model = make_pair(tmp_path, **VARIANTS["gqa"])
    rng = np.random.default_rng(0)
    lens = [(11, 3), (5, 1), (2, 2), (9, 9)]  # (cached, new): verify, decode, short, prefill
    seqs, refs = [], []
    kv = model.make_kv_cache(num_pages=40, page_size=4)
    free = list(rng.permutation(40))
    for cached, new in lens:
        ids = rng.integers(0, VOCAB, cached + new).tolist()
        pages = [int(free.pop()) for _ in range((cached + new + 3) // 4)]
        if cached > new:
            step(model, kv, [dict(ids=ids[:cached - new], kv_len=cached - new, pages=pages)])
        seqs.append(dict(pages=pages, full=ids))
        refs.append(hf_logits(hf, ids[:cached]))
    # one step for all four: the last `new` tokens of each sequence's first `cached`
    batch = []
    for s, (cached, new) in zip(seqs, lens):
        batch.append(dict(ids=s["full"][cached - new:cached], kv_len=cached, pages=s["pages"]))
    out = step(model, kv, batch)
    offset = 0
    for ref, (cached, new) in zip(refs, lens):
        torch.testing.assert_close(out.logits[offset:offset + new], ref[cached - new:cached],
                                   atol=ATOL, rtol=0)
        offset += new


def test_batched_decode_with_unequal_lengths(tmp_path):
    hf, model = make_pair(tmp_path, **VARIANTS["mha_tied"])
    kv = model.make_kv_cache(num_pages=30, page_size=4)
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in (3, 10, 7)]
    tables = [[0, 1], [2, 29, 4], [28, 5]]
    for ids, pages in zip(seqs, tables):
        step(model, kv, [dict(ids=ids[:-1], kv_len=len(ids) - 1, pages=pages)])
    out = step(model, kv, [dict(ids=[ids[-1]], kv_len=len(ids), pages=pages)
                           for ids, pages in zip(seqs, tables)])
    for i, ids in enumerate(seqs):
        torch.testing.assert_close(out.logits[i], hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def test_tree_verification_matches_sequential_branches(tmp_path):
    hf, model = make_pair(tmp_path, **VARIANTS["llama3_rope"])
    prefix = torch.randint(0, VOCAB, (9,)).tolist()
    parents = [-1, 0, 0, 1, 2, 2, -1, 6]  # two roots; node j's parent is parents[j]
    tokens = torch.randint(0, VOCAB, (len(parents),)).tolist()
    depth, branch = [], []
    for j, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        branch.append(([] if p < 0 else branch[p]) + [j])
    n, m = len(prefix), len(parents)
    mask = np.zeros((m, n + m), dtype=bool)
    mask[:, :n] = True
    for j in range(m):
        mask[j, [n + a for a in branch[j]]] = True
    kv = model.make_kv_cache(num_pages=10, page_size=4)
    pages = [7, 2, 9, 4, 0]
    step(model, kv, [dict(ids=prefix, kv_len=n, pages=pages)])
    out = step(model, kv, [dict(ids=tokens, kv_len=n + m, pages=pages,
                                positions=np.array([n + d for d in depth]), mask=mask)])
    for j in range(m):
        ref = hf_logits(hf, prefix + [tokens[a] for a in branch[j]])[-1]
        torch.testing.assert_close(out.logits[j], ref, atol=ATOL, rtol=0)


def test_tree_in_a_batch_next_to_a_causal_sequence(tmp_path):
    hf, model = make_pair(tmp_path, **VARIANTS["gqa"])
    a = torch.randint(0, VOCAB, (6,)).tolist()
    b = torch.randint(0, VOCAB, (8,)).tolist()
    kv = model.make_kv_cache(num_pages=12, page_size=4)
    pa, pb = [3, 8, 1], [10, 0, 5, 6]
    step(model, kv, [dict(ids=a[:4], kv_len=4, pages=pa), dict(ids=b[:5], kv_len=5, pages=pb)])
    tree = [a[4], a[5], b[0]]  # root, child, sibling of child (parents -1, 0, 0)
    mask = np.array([[1] * 4 + [1, 0, 0], [1] * 4 + [1, 1, 0], [1] * 4 + [1, 0, 1]], dtype=bool)
    out = step(model, kv, [dict(ids=tree, kv_len=7, pages=pa, positions=np.array([4, 5, 5]),
                                mask=mask),
                           dict(ids=b[5:], kv_len=8, pages=pb)])
    torch.testing.assert_close(out.logits[0], hf_logits(hf, a[:5])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[1], hf_logits(hf, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[2], hf_logits(hf, a[:5] + [b[0]])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits[3:], hf_logits(hf, b)[5:], atol=ATOL, rtol=0)


def test_inputs_embeds_and_copy_slots_compaction(tmp_path):
    hf, model = make_pair(tmp_path, **VARIANTS["gqa"])
    ids = torch.randint(0, VOCAB, (10,)).tolist()
    kv = model.make_kv_cache(num_pages=6, page_size=4)
    pages = [4, 1, 3]
    embeds = model.embed_tokens(torch.tensor(ids[:7])).detach()
    out = step(model, kv, [dict(ids=ids[:7], kv_len=7, pages=pages)], inputs_embeds=embeds)
    torch.testing.assert_close(out.logits, hf_logits(hf, ids[:7]), atol=ATOL, rtol=0)
    # a "tree" wrote token 7 at logical slot 9; compact it back to logical slot 7
    junk = torch.randint(0, VOCAB, (2,)).tolist()
    mask = np.ones((3, 10), dtype=bool)
    mask[2, 7:9] = False
    step(model, kv, [dict(ids=junk + [ids[7]], kv_len=10, pages=pages, mask=mask,
                          positions=np.array([7, 8, 7]))])

    def slot(i):
        return pages[i // 4] * 4 + i % 4

    kv.copy_slots([slot(9)], [slot(7)])
    out = step(model, kv, [dict(ids=[ids[8]], kv_len=9, pages=pages)])
    torch.testing.assert_close(out.logits[0], hf_logits(hf, ids[:9])[-1], atol=ATOL, rtol=0)


def test_bfloat16_model_tracks_float32(tmp_path):
    hf, _ = make_pair(tmp_path, **VARIANTS["gqa"])
    model = load_model(tmp_path / "model_0", dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32
    ids = torch.randint(0, VOCAB, (1, 12))
    logits, _ = model.forward_full(ids)
    assert logits.dtype == torch.float32
    ref = hf_logits(hf, ids[0])
    assert (logits[0] - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("variant", ["gqa", "qwen2_gqa_tied", "qwen3_head_dim", "mistral"])
def test_greedy_generation_matches_transformers_up_to_a_near_tie(tmp_path, variant):
    hf, model = make_pair(tmp_path, **VARIANTS[variant])
    prompt = torch.randint(0, VOCAB, (1, 5))
    hf.generation_config.eos_token_id = None  # 20 tokens whatever they are
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    kv = model.make_kv_cache(num_pages=16, page_size=4)
    pages = list(range(16))
    ids, got = prompt[0].tolist(), []
    out = step(model, kv, [dict(ids=ids, kv_len=len(ids), pages=pages)], logits_indices=torch.tensor([4]))
    for _ in range(20):
        got.append(int(out.logits[-1].argmax()))
        out = step(model, kv, [dict(ids=got[-1:], kv_len=len(ids) + len(got), pages=pages)])
    if got != want:  # allowed only where the two top logits are within float32 noise
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        top2 = hf_logits(hf, ids + want[:k])[-1].topk(2).values
        assert float(top2[0] - top2[1]) < 1e-4, f"{variant}: outputs part at token {k}"


def test_a_sliding_window_is_refused_by_name(tmp_path):
    from specsched.runtime.config import ConfigError, ModelConfig

    raw = dict(architectures=["MistralForCausalLM"], vocab_size=VOCAB, hidden_size=48, intermediate_size=80,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               sliding_window=64)
    assert ModelConfig.from_hf(raw).sliding_window == 64
    with pytest.raises(ConfigError, match="sliding_window 64"):
        ModelConfig.from_hf(raw).check_servable(128)
    assert ModelConfig.from_hf({**raw, "sliding_window": None}).sliding_window is None
    qwen = {**raw, "architectures": ["Qwen2ForCausalLM"]}
    assert ModelConfig.from_hf(qwen).sliding_window is None  # a window Qwen does not use
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).sliding_window == 64
