"""Tests for specsched.runtime.mtp_head and the MTP proposer: paged head == dense head, greedy
losslessness through the real pipeline (D = 1, 3, 5; mtp and sync schedules), sampled
drafting, agreement, checkpoint io and its errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specsched.runtime.checkpoint import CheckpointError, load_model, save_llama
from specsched.runtime.config import ModelConfig
from specsched.runtime.model import LlamaModel
from specsched.runtime.mtp_head import MTPHead, load_head, save_head, target_fingerprint
from specsched.runtime.training.mtp import head_rollout
from specsched.runtime.training.mtp_eval import run_requests, summarize
from specsched.runtime.worker import ModelWorker
from specsched.scheduler.messages import AgreementMessage
from specsched.scheduler.plan import build_plan
from specsched.scheduler.sampling_params import SamplingParams
from tests import device_messages

PAGE = 4
PAGES = 256


# fixtures head_family, head_prompts, head_reference and one_thread: conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                max_position_embeddings=256)
    return ModelConfig(**(base | kw))


# --- the module: paged == dense ------------------------------------------------------------


@pytest.mark.parametrize("norms", [True, False])
def test_paged_fill_and_draft_equal_dense(norms):
    target = LlamaModel.random(tiny_config(), seed=3, std=0.2)
    head = MTPHead.for_target(target, norms=norms, seed=4, std=0.2)
    seq = torch.randint(0, 40, (23,), generator=torch.Generator().manual_seed(5))
    _, hidden = target.forward_full(seq[None])
    dense = head.forward_full(seq[None, 1:], hidden[:, :-1])  # positions 0..21

    kv = head.make_kv_cache(16, PAGE)
    backend = target.attention_backend()
    pages = [7, 2, 9, 4, 11, 1]
    logits, hid = [], []
    for a, b in ((0, 5), (5, 6), (6, 15)):  # prefill chunks, a decode, a chunk
        plan = build_plan([b - a], [b], [pages], PAGE)
        out = head(seq[a + 1 : b + 1], hidden[0, a:b], backend.prepare(plan), kv,
                   torch.as_tensor(plan.positions))
        logits.append(out.logits)
        hid.append(out.hidden)
    torch.testing.assert_close(torch.cat(logits), dense.logits[0, :15], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(hid), dense.hidden[0, :15], atol=1e-4, rtol=1e-4)

    # a draft step at position 15 on the head's own hidden from position 14 equals the dense
    # pass with H_15 replaced by that hidden
    own = hid[-1][-1]
    plan = build_plan([1], [16], [pages], PAGE)
    step = head(seq[16:17], own[None], backend.prepare(plan), kv, torch.as_tensor(plan.positions))
    swapped = hidden[:, :16].clone()
    swapped[0, 15] = own
    want = head.forward_full(seq[None, 1:17], swapped)
    torch.testing.assert_close(step.logits[0], want.logits[0, 15], atol=1e-4, rtol=1e-4)


def test_training_rollout_matches_paged_draft_step():
    """The training's second-draft-step pass sees exactly what a paged draft step sees."""
    target = LlamaModel.random(tiny_config(), seed=3, std=0.2)
    head = MTPHead.for_target(target, seed=4, std=0.2)
    seq = torch.randint(0, 40, (14,), generator=torch.Generator().manual_seed(6))
    _, hidden = target.forward_full(seq[None])
    out1, out2 = head_rollout(head, seq[None], hidden)
    backend = target.attention_backend()
    pages = [3, 0, 5, 6]
    for i in (0, 4, 10):
        kv = head.make_kv_cache(8, PAGE)
        plan = build_plan([i + 1], [i + 1], [pages], PAGE)
        fill = head(seq[1 : i + 2], hidden[0, : i + 1], backend.prepare(plan), kv, torch.as_tensor(plan.positions))
        torch.testing.assert_close(fill.hidden[-1], out1.hidden[0, i], atol=1e-4, rtol=1e-4)
        plan = build_plan([1], [i + 2], [pages], PAGE)
        step = head(seq[i + 2 : i + 3], fill.hidden[-1:], backend.prepare(plan), kv, torch.as_tensor(plan.positions))
        torch.testing.assert_close(step.logits[0], out2.logits[0, i], atol=1e-4, rtol=1e-4)


def test_worker_fill_carries_dense_logits(head_family, head_prompts):
    worker = ModelWorker(head_family.target, {"kind": "mtp", "draft_len": 2}, proposer_dir=head_family.head,
                         page_size=PAGE, num_pages=PAGES)
    reqs = run_requests(worker, head_prompts, SamplingParams(max_tokens=5, ignore_eos=True), num_pages=PAGES)
    # after the run every state is released; redo one request's prefill through the ops
    p = head_prompts[2]
    msg_plan = build_plan([len(p)], [len(p)], [list(range(8))], PAGE)
    worker.execute("forward", device_messages.prefill_forward(p, msg_plan))
    worker.execute("fill", device_messages.fill(build_plan([len(p)], [len(p)], [list(range(8, 16))], PAGE),
                                                0, len(p), "forward"))
    st = worker.states[0]
    seq = worker.tokens.data[0:1, : len(p) + 1]  # the prompt and the sampled token, on the device
    _, hidden = worker.target.forward_full(seq)
    dense = worker.proposer.head.forward_full(seq[:, 1:], hidden[:, :-1])
    torch.testing.assert_close(st.carried, dense.logits[0, -1], atol=1e-4, rtol=1e-4)
    assert int(seq[0, len(p)]) == reqs[2].output_token_ids[0]


# --- greedy losslessness through the pipeline ------------------------------------------------


@pytest.mark.parametrize("draft_len,schedule", [(1, "eager_fill"), (3, "eager_fill"), (3, "sync"), (5, "eager_fill")])
def test_mtp_greedy_is_lossless(head_family, head_prompts, head_reference, draft_len, schedule):
    worker = ModelWorker(head_family.target, {"kind": "mtp", "draft_len": draft_len}, proposer_dir=head_family.head,
                         page_size=PAGE, num_pages=PAGES)
    reqs = run_requests(worker, head_prompts, SamplingParams(max_tokens=24, ignore_eos=True),
                        schedule=schedule, num_pages=PAGES)
    assert [r.error for r in reqs] == [None] * len(reqs)
    assert [r.output_token_ids for r in reqs] == head_reference
    s = summarize(reqs)
    assert s.mean_acceptance_length > 1.05  # the trained head's drafts do get accepted
    if draft_len > 1:
        assert any(r.accepted_per_pos[1] for r in reqs)  # multi-token acceptances happened


def test_mtp_with_preemption_is_lossless(head_family, head_prompts, head_reference):
    """A small KV pool forces preemption and recompute; the head refills from scratch."""
    worker = ModelWorker(head_family.target, {"kind": "mtp", "draft_len": 3}, proposer_dir=head_family.head,
                         page_size=PAGE, num_pages=40)
    reqs = run_requests(worker, head_prompts, SamplingParams(max_tokens=24, ignore_eos=True), num_pages=40)
    assert [r.output_token_ids for r in reqs] == head_reference
    assert any(r.num_preemptions for r in reqs)


def test_mtp_sampled_runs_with_draft_distributions(head_family, head_prompts):
    worker = ModelWorker(head_family.target, {"kind": "mtp", "draft_len": 3}, proposer_dir=head_family.head,
                         page_size=PAGE, num_pages=PAGES)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    a = run_requests(worker, head_prompts, params, num_pages=PAGES)
    assert [r.error for r in a] == [None] * len(a)
    assert all(r.num_output_tokens == 16 for r in a)
    assert sum(r.num_drafts for r in a) > 0
    b = run_requests(worker, head_prompts, params, num_pages=PAGES)  # seeded: reproducible
    assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]


def test_agreement_matches_dense_guesses(head_family, head_prompts, head_reference):
    worker = ModelWorker(head_family.target, {"kind": "mtp", "draft_len": 1}, proposer_dir=head_family.head,
                         page_size=PAGE, num_pages=PAGES)
    prompt, out = head_prompts[3], head_reference[3]
    agree = worker.execute("agreement", AgreementMessage(prompt, out)).agreement
    assert len(agree) == len(out) and set(agree) <= {0, 1}
    seq = torch.tensor([prompt + out])
    _, hidden = worker.target.forward_full(seq)
    guess = worker.proposer.head.forward_full(seq[:, 1:], hidden[:, :-1]).logits[0].argmax(-1)
    p = len(prompt)
    assert agree == [int(guess[p + j - 2] == t) for j, t in enumerate(out)]
    assert sum(agree) > 0
    one = worker.execute("agreement", AgreementMessage([prompt[0]], out[:3])).agreement
    assert one[0] == 0  # output 0 after a 1-token prompt has no head position


# --- checkpoint io ------------------------------------------------------------------------


def test_save_load_roundtrip(tmp_path):
    target = LlamaModel.random(tiny_config(), seed=1)
    for norms in (True, False):
        head = MTPHead.for_target(target, norms=norms, seed=2)
        save_head(head, tmp_path / f"h{norms}", target)
        cfg = json.loads((tmp_path / f"h{norms}" / "config.json").read_text())
        assert cfg["architectures"] == ["SpecschedMTPHead"] and cfg["norms"] is norms
        assert cfg["target_fingerprint"] == target_fingerprint(target)
        tensors = load_file(str(tmp_path / f"h{norms}" / "model.safetensors"))
        assert not any("embed" in k or "lm_head" in k for k in tensors)
        assert ("enorm.weight" in tensors) is norms
        loaded = load_head(tmp_path / f"h{norms}", target)
        ids, hid = torch.randint(0, 40, (1, 6)), torch.randn(1, 6, 32)
        torch.testing.assert_close(loaded.forward_full(ids, hid).logits, head.forward_full(ids, hid).logits)
    bf16 = load_head(tmp_path / "hTrue", target.to(torch.bfloat16))  # same fingerprint in bf16
    assert bf16.dtype == torch.bfloat16


@pytest.fixture()
def saved(tmp_path):
    target = LlamaModel.random(tiny_config(), seed=1)
    save_head(MTPHead.for_target(target, seed=2), tmp_path / "head", target)
    return target, tmp_path / "head"


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("breakage,message", [
    (lambda p: shutil.rmtree(p), "directory not found"),
    (lambda p: (p / "config.json").unlink(), "missing config.json"),
    (lambda p: (p / "config.json").write_text("{nope"), "cannot read"),
    (lambda p: _edit_config(p, architectures=["LlamaForCausalLM"]), "full model"),
    (lambda p: _edit_config(p, norms="yes"), "'norms' must be true or false"),
    (lambda p: _edit_config(p, hidden_size=-3), "hidden_size"),
    (lambda p: _edit_config(p, vocab_size=41), "vocab_size 41 does not match"),
    (lambda p: _edit_config(p, target_fingerprint="sha256:0000"), "trained for target sha256:0000"),
    (lambda p: (p / "model.safetensors").unlink(), "missing weights model.safetensors"),
    (lambda p: (p / "model.safetensors").write_bytes(b"garbage"), "cannot read"),
    (lambda p: _edit_tensors(p, lambda t: t.pop("layer.self_attn.q_proj.weight")), "missing tensor 'layer.self_attn.q_proj.weight'"),
    (lambda p: _edit_tensors(p, lambda t: t.update({"eh_proj.weight": torch.zeros(32, 32)})), "shape mismatch for tensor 'eh_proj.weight'"),
    (lambda p: _edit_tensors(p, lambda t: t.update({"lm_head.weight": torch.zeros(40, 32)})), "unexpected tensor 'lm_head.weight'"),
    (lambda p: _edit_config(p, norms=False), "unexpected tensor 'enorm.weight'"),
])
def test_checkpoint_errors_name_the_problem(saved, breakage, message):
    target, path = saved
    breakage(path)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        load_head(path, target)


def test_fingerprint_check_can_be_skipped_and_names_both(saved):
    target, path = saved
    other = LlamaModel.random(tiny_config(), seed=9)
    with pytest.raises(CheckpointError, match=target_fingerprint(other)):
        load_head(path, other)
    assert load_head(path, other, check_target=False) is not None


def test_worker_without_head_dir_fails_clearly(head_family):
    with pytest.raises(ValueError, match="needs an MTP head directory"):
        ModelWorker(head_family.target, {"kind": "mtp", "draft_len": 1}, page_size=PAGE, num_pages=16)


def test_save_llama_roundtrip(tmp_path):
    model = LlamaModel.random(tiny_config(tie_word_embeddings=False), seed=4)
    save_llama(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    ids = torch.randint(0, 40, (1, 5))
    torch.testing.assert_close(loaded.forward_full(ids)[0], model.forward_full(ids)[0])


def test_validate_head_and_draft_report_acceptance_through_the_pipeline(head_family, head_prompts, tiny_family,
                                                                      one_thread):
    """The model cards' acceptance figures: served through Pipeline + ModelWorker, lossless, and
    consistent with the per-position rates (AL = 1 + sum of per-position acceptance)."""
    from specsched.runtime.training.mtp_eval import validate_draft, validate_head

    windows = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(2))
    head = validate_head(head_family.target, head_family.head, windows, head_prompts, max_tokens=12,
                         draft_lens=(2,), eagle=(2, 2, 4), log=lambda *_: None)
    assert 0.0 <= head["paged_agreement"] <= 1.0
    assert head["mtp D=2"]["identical_to_greedy"] and head["eagle(depth=2,top_k=2,nodes=4)"]["identical_to_greedy"]
    draft = validate_draft(tiny_family["target"], tiny_family["draft"], [[5, 6, 7], [9] * 11], max_tokens=12,
                           draft_lens=(1, 3), log=lambda *_: None)
    for key, d in (("draft D=1", 1), ("draft D=3", 3)):
        run = draft[key]
        assert run["identical_to_greedy"] and len(run["acceptance_per_position"]) == d
        assert 1.0 <= run["mean_acceptance_length"] <= 1 + d
    # one draft per step: the mean acceptance length is one plus the acceptance rate
    assert draft["draft D=1"]["mean_acceptance_length"] == pytest.approx(
        1.0 + draft["draft D=1"]["acceptance_per_position"][0], abs=2e-3)
