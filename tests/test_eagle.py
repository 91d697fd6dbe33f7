"""Tests for the EAGLE-tree proposer: the verify tree mask against verifying each branch
sequentially, the head's tree expansion against dense per-branch runs, KV compaction of
the accepted path, greedy losslessness through the real pipeline, and the greedy-only rule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specsched.runtime.training.mtp_eval import run_requests, summarize
from specsched.runtime.verify import greedy_verify
from specsched.runtime.worker import ModelWorker
from specsched.scheduler.block_manager import BlockManager
from specsched.scheduler.step_batch import StepBatch
from specsched.scheduler.packing import verify_message
from specsched.scheduler.plan import build_plan
from specsched.scheduler.proposer import ProposerSpec, default_tree
from specsched.scheduler.request import Request
from specsched.scheduler.sampling_params import SamplingParams
from tests import device_messages
from tests.window_fills import record_window_fills

PAGE = 4
PAGES = 256
TREE = default_tree(3, 2, 8)  # (-1, -1, 0, 0, 1, 2, 2, 3)


# fixtures head_family, head_prompts, head_reference and one_thread: conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def eagle_worker(head_family, tree=TREE, num_pages=PAGES) -> ModelWorker:
    depth = int(ProposerSpec("eagle", 8, tuple(tree)).tree_depths().max())
    return ModelWorker(head_family.target, {"kind": "eagle", "draft_len": depth, "tree_parents": list(tree)},
                       proposer_dir=head_family.head, page_size=PAGE, num_pages=num_pages)


def prefill(worker: ModelWorker, prompt: list[int]) -> tuple[Request, BlockManager]:
    """Run the prefill forward + head fill for one request (slot 0) as the pipeline does."""
    blocks = BlockManager(PAGES, PAGE, ("target", "mtp"))
    req = Request("r", list(prompt), SamplingParams(max_tokens=64), 0)
    req.slot = 0
    n = len(prompt)
    blocks.allocate(np.array([0]), {"target": n + 1 + len(TREE), "mtp": n + 2 + len(TREE)})
    plan = build_plan([n], [n], [blocks.page_table(0)], PAGE)
    worker.execute("forward", device_messages.prefill_forward(list(prompt), plan))
    fplan = build_plan([n], [n], [blocks.page_table(0, "mtp")], PAGE)
    worker.execute("fill", device_messages.fill(fplan, 0, n, "forward"))
    req.extend_output([int(worker.tokens.data[0, n])])  # the sampled token, from the device
    req.num_computed_tokens = n
    req.state = req.state.RUNNING
    return req, blocks


def tokens_of(worker: ModelWorker, length: int) -> list[int]:
    """Slot 0's first `length` tokens, read from the worker's device token buffer."""
    return worker.tokens.data[0, :length].tolist()


def set_drafts(worker: ModelWorker, req: Request, drafts: list[int]) -> None:
    worker.set_drafts([0], np.array([req.num_tokens - 1]), torch.tensor([drafts]), [len(drafts)])


def verify_msg(req: Request, blocks: BlockManager, tree=TREE, step: int = 1) -> dict:
    spec = ProposerSpec("eagle", 3, tuple(tree))
    one = np.ones(1, dtype=np.int64)
    c = np.array([req.num_computed_tokens])
    batch = StepBatch(step, [req], np.array([0]), c, one, np.array([len(tree)]),
                      np.ones(1, dtype=bool), np.zeros(1, dtype=bool), np.zeros(1, dtype=np.int64))
    return verify_message(batch, blocks, spec)


# --- the target's tree mask ---------------------------------------------------------------


def test_tree_verify_matches_sequential_branches(head_family):
    worker = eagle_worker(head_family)
    prompt = [3, 14, 15, 9, 26, 5]
    req, blocks = prefill(worker, prompt)
    toks = tokens_of(worker, req.num_tokens)
    gen = torch.Generator().manual_seed(2)
    drafts = torch.randint(0, 32, (len(TREE),), generator=gen).tolist()
    set_drafts(worker, req, drafts)
    vmsg = verify_msg(req, blocks)
    plan, step, positions = worker.plan(vmsg.plan)
    ids = torch.tensor([toks[-1]] + drafts)
    out = worker.target(ids, step, worker.kv, positions)
    # each root-to-node branch, run as a plain causal sequence, gives the same logits
    for node in range(len(TREE)):
        path, a = [], node
        while a >= 0:
            path.insert(0, a)
            a = TREE[a]
        seq = torch.tensor([toks + [drafts[n] for n in path]])
        dense, _ = worker.target.forward_full(seq)
        torch.testing.assert_close(out.logits[1 + node], dense[0, -1], atol=1e-4, rtol=1e-4)
    root, _ = worker.target.forward_full(torch.tensor([toks]))
    torch.testing.assert_close(out.logits[0], root[0, -1], atol=1e-4, rtol=1e-4)


def test_tree_acceptance_is_the_best_branch(head_family):
    """accept_tree picks the longest branch greedy_verify accepts (first on ties)."""
    worker = eagle_worker(head_family)
    req, blocks = prefill(worker, [7, 7, 1, 30, 2])
    st = worker.states[0]
    toks = tokens_of(worker, req.num_tokens)
    g = [toks[-1]]
    for _ in range(3):
        g.append(int(worker.target.forward_full(torch.tensor([toks + g[1:]]))[0][0, -1].argmax()))
    rng = np.random.default_rng(0)
    leaves = [n for n in range(len(TREE)) if n not in TREE]
    for trial in range(6):
        drafts = rng.integers(0, 32, len(TREE)).tolist()
        if trial:  # plant greedy tokens along a random branch, to a random depth
            path, a = [], int(rng.choice(leaves))
            while a >= 0:
                path.insert(0, a)
                a = TREE[a]
            for k, n in enumerate(path[: int(rng.integers(1, len(path) + 1))]):
                drafts[n] = g[k + 1]
        set_drafts(worker, req, drafts)
        vmsg = verify_msg(req, blocks, step=trial + 1)
        plan, step, positions = worker.plan(vmsg.plan)
        out = worker.target(torch.tensor([toks[-1]] + drafts), step, worker.kv, positions,
                            return_hidden=True)
        res = worker.proposer.accept_tree(vmsg, [st], torch.tensor([drafts]), torch.tensor([toks[-1]]),
                                          out.logits[None], plan, out.hidden)
        emitted, accepted = res.to_lists(), res.num_accepted.tolist()
        best = []
        for leaf in leaves:
            path, a = [], leaf
            while a >= 0:
                path.insert(0, a)
                a = TREE[a]
            res = greedy_verify(torch.tensor([[drafts[n] for n in path]]), torch.tensor([len(path)]),
                                out.logits[[0] + [1 + n for n in path]][None])
            best.append(res.to_lists()[0])
        want = max(best, key=len)
        assert emitted[0] == want and accepted[0] == len(want) - 1


# --- the head's tree expansion --------------------------------------------------------------


def test_draft_tree_matches_dense_branches(head_family):
    worker = eagle_worker(head_family)
    req, blocks = prefill(worker, [5, 1, 22, 8, 8, 13, 2])
    toks = tokens_of(worker, req.num_tokens)
    L = len(toks)
    worker.execute("draft", device_messages.draft(3, blocks.page_table(0, "mtp"), PAGE, L))
    drafts = worker.tokens.after([0], np.array([L - 1]), len(TREE))[0].tolist()
    head, target = worker.proposer.head, worker.target
    seq = torch.tensor([toks])
    _, hidden = target.forward_full(seq)
    base = head.forward_full(seq[:, 1:], hidden[:, :-1])

    def run(path_tokens):
        """Dense head logits after feeding its own hidden along a path of draft tokens."""
        hid, seen = hidden[0, : L - 1].clone(), toks[1:]
        own, logits = base.hidden[0, -1], base.logits[0, -1]
        for t in path_tokens:
            hid = torch.cat([hid, own[None]])
            seen = seen + [t]
            out = head.forward_full(torch.tensor([seen]), hid[None])
            own, logits = out.hidden[0, -1], out.logits[0, -1]
        return logits

    children = {}
    for n, p in enumerate(TREE):
        children.setdefault(p, []).append(n)
    for parent, kids in children.items():
        path, a = [], parent
        while a >= 0:
            path.insert(0, drafts[a])
            a = TREE[a]
        want = run(path).topk(len(kids)).indices.tolist()
        assert [drafts[k] for k in kids] == want, f"children of node {parent}"


# --- compaction and the fill along the accepted path ----------------------------------------


def test_accepted_path_kv_is_compacted_and_filled(head_family):
    worker = eagle_worker(head_family)
    prompt = [9, 2, 6, 5, 3, 5]
    req, blocks = prefill(worker, prompt)
    st = worker.states[0]
    toks = tokens_of(worker, req.num_tokens)
    L = len(toks)
    g = []
    for _ in range(3):
        g.append(int(worker.target.forward_full(torch.tensor([toks + g]))[0][0, -1].argmax()))
    drafts = [(g[0] + 1) % 32] * len(TREE)
    drafts[1], drafts[4] = g[0], g[1]  # branch 1 -> 4: slots of nodes 1, 4 move to L, L+1
    set_drafts(worker, req, drafts)
    res = worker.execute("verify", verify_msg(req, blocks))
    assert res.accepted.tolist() == [2] and res.tokens[0, :3].tolist() == g
    # target KV of positions 0..L+1 equals a plain prefill of the accepted sequence
    full = tokens_of(worker, L + 2)
    fresh = worker.target.make_kv_cache(8, PAGE)
    plan = build_plan([len(full)], [len(full)], [list(range(8))], PAGE)
    worker.target(torch.tensor(full), worker.backend.prepare(plan), fresh, torch.as_tensor(plan.positions))
    table = blocks.page_table(0)
    slots = [table[p // PAGE] * PAGE + p % PAGE for p in range(L + 2)]
    for layer in range(worker.target.config.num_hidden_layers):
        got_k, got_v = worker.kv.read_slots(layer, slots)
        want_k, want_v = fresh.read_slots(layer, plan.slot_mapping)
        torch.testing.assert_close(got_k, want_k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_v, want_v, atol=1e-4, rtol=1e-4)
    # the host-planned fill over [L-1, L+2) leaves the dense head's logits carried
    fplan = build_plan([3], [L + 2], [blocks.page_table(0, "mtp")], PAGE)
    worker.execute("fill", device_messages.fill(fplan, L - 1, L + 2, "verify", step=1))
    seq = torch.tensor([tokens_of(worker, L + 3)])
    _, hidden = worker.target.forward_full(seq)
    dense = worker.proposer.head.forward_full(seq[:, 1:], hidden[:, :-1])
    torch.testing.assert_close(st.carried, dense.logits[0, -1], atol=1e-4, rtol=1e-4)


def test_a_window_fill_carries_the_head_after_each_rows_accepted_path(monkeypatch, head_family, head_prompts,
                                                                      head_reference):
    """Under `mtp` the fill is launched right behind the tree's verify, over the root and one
    position per depth, before the host knows which path was accepted: it must leave the head
    exactly where a fill of the accepted path would -- its carried logits and hidden state those
    of the head run teacher-forced on the target's hidden states up to each row's new last
    token -- whether a row accepted no node, some, a whole branch, or drafted no tree at all."""
    from specsched.runtime.proposers.mtp import EagleProposer

    def distance(proposer, slot: int, end: int) -> float:
        """The carried logits and hidden state against the head run teacher-forced on the
        target's hidden states up to the new last token (head position end - 1)."""
        w = proposer.worker
        seq = w.tokens.data[slot, : end + 1].unsqueeze(0)
        _, hidden = w.target.forward_full(seq)
        ref = proposer.head.forward_full(seq[:, 1:], hidden[:, :-1])
        st = w.states[slot]
        return max(float((ref.logits[0, end - 1] - st.carried).abs().max()),
                   float((ref.hidden[0, end - 1] - st.extra["hidden"]).abs().max()))

    seen = record_window_fills(monkeypatch, EagleProposer, 0, distance)
    worker = eagle_worker(head_family)
    reqs = run_requests(worker, head_prompts, SamplingParams(max_tokens=24, ignore_eos=True),
                        schedule="eager_fill", num_pages=PAGES)
    assert [r.output_token_ids for r in reqs] == head_reference
    depth = 3
    assert {n for n, _, _ in seen} == {1, 1 + depth}  # whole trees, and rows too near their end for one
    counts = np.bincount([a for n, a, _ in seen if n > 1], minlength=depth + 1)
    assert counts[0] and counts[depth] and counts[1:depth].any()
    assert max(err for _, _, err in seen) < 1e-4


# --- end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("tree,schedule", [
    (TREE, "sync"), (TREE, "overlap"), (TREE, "mtp"), (default_tree(1, 3), "sync"), (default_tree(1, 3), "mtp"),
    (default_tree(5, 2, 16), "sync"), (default_tree(5, 2, 16), "mtp"), ((-1, 0, 1), "sync"), ((-1, 0, 1), "mtp"),
])
def test_eagle_greedy_is_lossless(head_family, head_prompts, head_reference, tree, schedule):
    worker = eagle_worker(head_family, tree)
    reqs = run_requests(worker, head_prompts, SamplingParams(max_tokens=24, ignore_eos=True),
                        schedule=schedule, num_pages=PAGES)
    assert [r.error for r in reqs] == [None] * len(reqs)
    assert [r.output_token_ids for r in reqs] == head_reference
    assert summarize(reqs).mean_acceptance_length > 1.05


def test_eagle_with_preemption_is_lossless(head_family, head_prompts, head_reference):
    worker = eagle_worker(head_family, num_pages=48)
    reqs = run_requests(worker, head_prompts, SamplingParams(max_tokens=24, ignore_eos=True), num_pages=48)
    assert [r.output_token_ids for r in reqs] == head_reference
    assert any(r.num_preemptions for r in reqs)


@pytest.mark.parametrize("schedule", ["sync", "eager_fill"])
def test_eagle_samples_beside_greedy_rows(head_family, head_prompts, head_reference, schedule):
    """Sampled requests are verified by tree sampling (its distribution: tests/test_verify.py):
    greedy requests sharing their batches stay token-identical to plain greedy decoding,
    seeded sampled requests repeat run after run, and they accept drafts."""
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    params = [greedy, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=7), greedy,
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=8)]
    runs = [run_requests(eagle_worker(head_family), head_prompts, params, num_pages=PAGES, schedule=schedule)
            for _ in range(2)]
    for reqs in runs:
        assert not [r.error for r in reqs if r.finish_reason == "error"]
        assert [reqs[i].output_token_ids for i in (0, 2)] == [head_reference[i] for i in (0, 2)]
    assert [r.output_token_ids for r in runs[0]] == [r.output_token_ids for r in runs[1]]
    sampled = [runs[0][1], runs[0][3]]
    assert [r.output_token_ids for r in sampled] != [head_reference[1], head_reference[3]]
    assert summarize(sampled).mean_acceptance_length > 1.2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,schedule", [("mtp", "eager_fill"), ("eagle", "overlap")])
def test_heads_on_cuda_are_lossless(head_family, head_prompts, kind, schedule):
    kw = {"page_size": PAGE, "num_pages": PAGES, "device": "cuda"}
    plain = ModelWorker(head_family.target, {"kind": "none", "draft_len": 0}, **kw)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [r.output_token_ids for r in run_requests(plain, head_prompts, params, num_pages=PAGES)]
    prop = {"kind": kind, "draft_len": 3}
    if kind == "eagle":
        prop["tree_parents"] = list(TREE)
    worker = ModelWorker(head_family.target, prop, proposer_dir=head_family.head, **kw)
    reqs = run_requests(worker, head_prompts, params, schedule=schedule, num_pages=PAGES)
    assert [r.output_token_ids for r in reqs] == want
    sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3)
    runs = [run_requests(ModelWorker(head_family.target, prop, proposer_dir=head_family.head, **kw), head_prompts,
                         sampled, schedule=schedule, num_pages=PAGES) for _ in range(2)]
    assert not [r.error for r in runs[0] + runs[1] if r.finish_reason == "error"]
    assert [r.output_token_ids for r in runs[0]] == [r.output_token_ids for r in runs[1]]
