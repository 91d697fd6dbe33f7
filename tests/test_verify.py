"""Tests for specsched.runtime.verify and runtime.tree_verify: greedy, lossless rejection sampling (chi-square), threshold mode,
token trees, acceptance statistics."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specsched.runtime.tree_verify import (
    TreeSpec,
    greedy_tree_verify,
    sampled_tree_verify,
    tree_attention_mask,
    tree_positions,
)
from specsched.runtime.verify import greedy_verify, greedy_verify_ids, rejection_verify, threshold_verify
from specsched.scheduler.errors import InvalidRequestError

N = 100_000  # rows per statistical test, run as one batch


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts [K] against probabilities [K]; 0 if any count
    falls outside the support. Survival function via the regularized upper gamma."""
    counts, probs = counts.double().flatten(), expected_probs.double().flatten()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


def random_dist(v: int, gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    p = torch.rand(v, generator=gen) + 0.05
    p[torch.randperm(v, generator=gen)[:zeros]] = 0
    return p / p.sum()


# --- greedy --------------------------------------------------------------------------


def reference_greedy(draft: list[int], n: int, target_ids: list[int]) -> list[int]:
    out = []
    for i in range(n):
        if draft[i] != target_ids[i]:
            break
        out.append(draft[i])
    out.append(target_ids[len(out)])
    return out


@pytest.mark.parametrize("seed", range(5))
def test_greedy_verify_matches_reference_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, d, v = 64, 5, 3  # tiny vocabulary: long accepted runs happen often
    draft = torch.randint(0, v, (b, d), generator=gen)
    draft_lens = torch.randint(0, d + 1, (b,), generator=gen)
    logits = torch.randn(b, d + 1, v, generator=gen)
    result = greedy_verify(draft, draft_lens, logits)
    target_ids = logits.argmax(-1)
    for i in range(b):
        expected = reference_greedy(draft[i].tolist(), int(draft_lens[i]), target_ids[i].tolist())
        assert result.to_lists()[i] == expected
        assert int(result.num_accepted[i]) == len(expected) - 1
        assert result.output_tokens[i, len(expected):].eq(-1).all()
    assert torch.equal(result.num_output, result.num_accepted + 1)
    assert result.num_accepted.max() >= 3


def test_greedy_verify_edge_cases() -> None:
    target = torch.tensor([[4, 5, 6]])
    assert greedy_verify_ids(torch.tensor([[4, 5]]), torch.tensor([2]), target).to_lists() == [[4, 5, 6]]
    assert greedy_verify_ids(torch.tensor([[4, 9]]), torch.tensor([2]), target).to_lists() == [[4, 5]]
    assert greedy_verify_ids(torch.tensor([[4, 5]]), torch.tensor([1]), target).to_lists() == [[4, 5]]
    assert greedy_verify_ids(torch.tensor([[4, 5]]), torch.tensor([0]), target).to_lists() == [[4]]
    empty = greedy_verify_ids(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.tensor([[7], [8]]))
    assert empty.to_lists() == [[7], [8]]


def test_verify_input_errors() -> None:
    with pytest.raises(ValueError, match="draft_lens must lie"):
        greedy_verify_ids(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([3]), torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_ids must be"):
        greedy_verify_ids(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_verify(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([2]), torch.ones(1, 2, 4), torch.ones(1, 3, 5), [None])


# --- lossless rejection sampling -----------------------------------------------------


def run_first_token(verifier, p0: torch.Tensor, q0: torch.Tensor | None, draft_token: int | None = None) -> torch.Tensor:
    """Counts of the first emitted token over N one-draft steps; drafts ~ q0 (or fixed)."""
    v = p0.numel()
    if q0 is None:
        draft = torch.full((N, 1), draft_token, dtype=torch.int64)
        draft_probs = None
    else:
        draft = torch.multinomial(q0, N, replacement=True).unsqueeze(-1)
        draft_probs = q0.expand(N, 1, v)
    bonus = random_dist(v, torch.Generator().manual_seed(99))
    target = torch.stack([p0, bonus]).expand(N, 2, v)
    result = verifier(draft, torch.ones(N, dtype=torch.int64), draft_probs, target, [None] * N)
    return torch.bincount(result.output_tokens[:, 0], minlength=v)


def accept_always_verify(draft, draft_lens, draft_probs, target_probs, generators):
    """WRONG: keeps every draft, so the first token follows q, not p."""
    bonus = target_probs[:, -1].argmax(-1, keepdim=True)
    return greedy_verify_ids(draft, draft_lens, torch.cat([draft, bonus], 1))


def resample_from_p_verify(draft, draft_lens, draft_probs, target_probs, generators):
    """WRONG: correct accept test, but a rejected draft is replaced by a sample from p."""
    p = target_probs[:, 0].gather(1, draft)
    q = torch.ones_like(p) if draft_probs is None else draft_probs[:, 0].gather(1, draft)
    accepted = torch.rand_like(p) * q < p
    first = torch.where(accepted, draft, torch.multinomial(target_probs[:, 0], 1))
    return SimpleNamespace(output_tokens=first)


CASES = {
    "overlapping": (dist([5, 3, 1, 1, 0, 0]), dist([1, 1, 1, 1, 3, 3])),
    "q_misses_support": (dist([2, 2, 2, 1, 1, 0, 0]), dist([0, 0, 1, 4, 4, 1, 0])),
    "near_equal": (dist([3, 3, 2, 2, 1]), dist([3, 2, 3, 2, 1])),
    "random_v8": (random_dist(8, torch.Generator().manual_seed(3), 2), random_dist(8, torch.Generator().manual_seed(4))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejection_first_token_follows_target(case: str) -> None:
    torch.manual_seed(1)
    p0, q0 = CASES[case]
    assert chi2_pvalue(run_first_token(rejection_verify, p0, q0), p0) > 1e-3


@pytest.mark.parametrize("draft_token", [0, 3, 5])
def test_rejection_one_hot_q_follows_target(draft_token: int) -> None:
    torch.manual_seed(2)
    p0 = dist([1, 4, 2, 2, 0, 3])  # draft_token 4 would be a zero-probability guess
    assert chi2_pvalue(run_first_token(rejection_verify, p0, None, draft_token), p0) > 1e-3
    assert chi2_pvalue(run_first_token(rejection_verify, p0, None, 4), p0) > 1e-3


@pytest.mark.parametrize("case", ["overlapping", "q_misses_support", "random_v8"])
def test_wrong_verifiers_fail_the_same_test(case: str) -> None:
    torch.manual_seed(3)
    p0, q0 = CASES[case]
    assert chi2_pvalue(run_first_token(accept_always_verify, p0, q0), p0) < 1e-12
    assert chi2_pvalue(run_first_token(resample_from_p_verify, p0, q0), p0) < 1e-12
    likely = int(p0.argmax())  # a zero-probability one-hot draft is always rejected: no signal
    assert chi2_pvalue(run_first_token(resample_from_p_verify, p0, None, likely), p0) < 1e-12


def test_rejection_second_token_conditional_on_first() -> None:
    """Given x_1 accepted, the second emitted token follows p_1(. | x_1), where p_1 depends on
    x_1; rows drafting 2 (accept/recover at position 2) and rows drafting 1 (bonus) alike."""
    torch.manual_seed(4)
    v, gen = 6, torch.Generator().manual_seed(5)
    p0, q0 = CASES["overlapping"]
    p1_table = torch.stack([random_dist(v, gen, zeros=i % 3) for i in range(v)])  # [V, V]
    q1_table = torch.stack([random_dist(v, gen) for _ in range(v)])
    x1 = torch.multinomial(q0, N, replacement=True)
    x2 = torch.multinomial(q1_table[x1], 1).squeeze(-1)
    draft = torch.stack([x1, x2], 1)
    draft_lens = torch.randint(1, 3, (N,))
    draft_probs = torch.stack([q0.expand(N, v), q1_table[x1]], 1)
    target = torch.stack([p0.expand(N, v), p1_table[x1], p1_table[x2]], 1)
    result = rejection_verify(draft, draft_lens, draft_probs, target, [None] * N)
    first, second = result.output_tokens[:, 0], result.output_tokens[:, 1]
    assert chi2_pvalue(torch.bincount(first, minlength=v), p0) > 1e-3
    kept = result.num_accepted >= 1
    for token in range(v):
        rows = kept & (first == token)
        if rows.sum() > 500:
            counts = torch.bincount(second[rows], minlength=v)
            assert chi2_pvalue(counts, p1_table[token]) > 1e-4, token


def test_rejection_with_one_hot_target_is_greedy() -> None:
    gen = torch.Generator().manual_seed(6)
    b, d, v = 200, 4, 3
    logits = torch.randn(b, d + 1, v, generator=gen)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), v).float()
    q = torch.softmax(torch.randn(b, d, v, generator=gen), -1)
    draft = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, d)
    draft_lens = torch.randint(0, d + 1, (b,), generator=gen)
    expected = greedy_verify(draft, draft_lens, logits)
    for probs in (q, None):
        got = rejection_verify(draft, draft_lens, probs, one_hot, [None] * b)
        assert torch.equal(got.output_tokens, expected.output_tokens)


def test_rejection_seeded_rows_reproducible() -> None:
    p = torch.softmax(torch.randn(8, 4, 10, generator=torch.Generator().manual_seed(7)), -1)
    draft = torch.randint(0, 10, (8, 3), generator=torch.Generator().manual_seed(8))
    runs = [
        rejection_verify(draft, torch.full((8,), 3), None, p, [torch.Generator().manual_seed(i) for i in range(8)])
        for _ in range(2)
    ]
    assert torch.equal(runs[0].output_tokens, runs[1].output_tokens)


def test_rejection_padded_rows_bonus_from_their_position() -> None:
    torch.manual_seed(9)
    v = 5
    bonus = dist([1, 2, 3, 4, 0])
    p_first = torch.nn.functional.one_hot(torch.tensor(2), v).float()  # draft 2 always accepted
    target = torch.stack([p_first, bonus, p_first, p_first]).expand(N, 4, v)
    draft = torch.tensor([2, 0, 0]).expand(N, 3)  # padding after the first draft
    result = rejection_verify(draft, torch.ones(N, dtype=torch.int64), None, target, [None] * N)
    assert result.num_accepted.eq(1).all() and result.output_tokens[:, 2].eq(-1).all()
    assert chi2_pvalue(torch.bincount(result.output_tokens[:, 1], minlength=v), bonus) > 1e-3


# --- threshold mode ------------------------------------------------------------------


def test_threshold_verify_keeps_confident_prefix() -> None:
    v = 4
    rows = [dist([0.9, 0.1, 0, 0]), dist([0.1, 0.6, 0.3, 0]), dist([0.2, 0.1, 0.3, 0.4]), dist([0, 0, 1, 0])]
    target = torch.stack(rows).unsqueeze(0)
    draft = torch.tensor([[0, 1, 0]])  # target probs of the drafts: 0.9, 0.6, 0.2
    assert threshold_verify(draft, torch.tensor([3]), target, 0.5).to_lists() == [[0, 1, 3]]
    assert threshold_verify(draft, torch.tensor([3]), target, 0.15).to_lists() == [[0, 1, 0, 2]]
    assert threshold_verify(draft, torch.tensor([3]), target, 0.95).to_lists() == [[0]]
    assert threshold_verify(draft, torch.tensor([1]), target, 0.5).to_lists() == [[0, 1]]
    sampled = threshold_verify(draft, torch.tensor([3]), target, 0.5, [torch.Generator().manual_seed(0)])
    assert sampled.to_lists()[0][:2] == [0, 1] and sampled.to_lists()[0][2] in (0, 1, 2, 3)
    with pytest.raises(ValueError, match="threshold"):
        threshold_verify(draft, torch.tensor([3]), target, 0.0)
    assert v == target.shape[-1]


def test_threshold_with_one_hot_target_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(100, 4, 3, generator=gen)
    draft = torch.randint(0, 3, (100, 3), generator=gen)
    draft_lens = torch.randint(0, 4, (100,), generator=gen)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 3).float()
    got = threshold_verify(draft, draft_lens, one_hot, 0.3)
    assert torch.equal(got.output_tokens, greedy_verify(draft, draft_lens, logits).output_tokens)


# --- trees ---------------------------------------------------------------------------

#        0 (root)
#       /        \
#    1:5          2:7
#    /  \           \
#  3:8  4:9         5:3
#   |
#  6:4
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
TOKENS = torch.tensor([0, 5, 7, 8, 9, 3, 4])


def logits_for(argmax_per_node: list[int], v: int = 12) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmax_per_node), v).float()


def test_tree_spec_mask_and_positions() -> None:
    tree = TreeSpec.from_parents(PARENTS)
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3] and tree.max_depth == 3
    assert tree.paths.tolist() == [[-1, -1, -1], [1, -1, -1], [2, -1, -1], [1, 3, -1], [1, 4, -1], [2, 5, -1],
                                   [1, 3, 6]]
    assert tree.children.tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert TreeSpec.from_parents([-1]).paths.shape == (1, 0)
    mask = tree_attention_mask(tree)
    assert torch.nonzero(mask[6]).flatten().tolist() == [0, 1, 3, 6]
    assert torch.nonzero(mask[5]).flatten().tolist() == [0, 2, 5]
    assert mask.diagonal().all() and not mask.triu(1).any()
    assert tree_positions(tree, 10).tolist() == [10, 11, 11, 12, 12, 12, 13]
    assert tree_positions(tree, torch.tensor([0, 5])).tolist()[1] == [5, 6, 6, 7, 7, 7, 8]
    assert TreeSpec.chain(3).mask.equal(torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="root"):
        TreeSpec.from_parents([0, 0])
    with pytest.raises(ValueError, match="bad nodes \\[2\\]"):
        TreeSpec.from_parents([-1, 0, 3, 1])


@pytest.mark.parametrize(
    ("argmax", "nodes", "out"),
    [
        ([5, 9, 0, 0, 2, 0, 0], [1, 4, -1], [5, 9, 2]),
        ([7, 0, 3, 0, 0, 11, 0], [2, 5, -1], [7, 3, 11]),
        ([1, 0, 0, 0, 0, 0, 0], [-1, -1, -1], [1]),
        ([5, 8, 0, 4, 0, 0, 6], [1, 3, 6], [5, 8, 4, 6]),
        ([5, 1, 0, 0, 0, 0, 0], [1, -1, -1], [5, 1]),
    ],
)
def test_greedy_tree_verify_hand_built(argmax: list[int], nodes: list[int], out: list[int]) -> None:
    result = greedy_tree_verify(TOKENS, PARENTS, logits_for(argmax))
    assert result.accepted_nodes[0].tolist() == nodes
    assert result.to_lists() == [out]
    assert int(result.num_accepted[0]) == len(out) - 1


def reference_tree(tokens: list[int], parents: list[int], argmax: list[int]) -> list[int]:
    depth = [0] * len(parents)
    ok = [True] + [False] * (len(parents) - 1)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
        ok[i] = ok[parents[i]] and tokens[i] == argmax[parents[i]]
    best = max(range(len(parents)), key=lambda i: (ok[i] * (depth[i] + 1), -i))
    path = []
    while best != 0:
        path.append(best)
        best = parents[best]
    return [tokens[i] for i in reversed(path)] + [argmax[path[0] if path else 0]]


def test_greedy_tree_verify_random_trees_vs_reference() -> None:
    gen = torch.Generator().manual_seed(11)
    for _ in range(30):
        t = int(torch.randint(2, 16, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
        b, v = 16, 3
        tokens = torch.randint(0, v, (b, t), generator=gen)
        logits = torch.randn(b, t, v, generator=gen)
        result = greedy_tree_verify(tokens, parents, logits)
        argmax = logits.argmax(-1)
        for i in range(b):
            assert result.to_lists()[i] == reference_tree(tokens[i].tolist(), parents, argmax[i].tolist())


def test_tree_chain_equals_linear_greedy() -> None:
    gen = torch.Generator().manual_seed(12)
    d = 4
    draft = torch.randint(0, 3, (50, d), generator=gen)
    logits = torch.randn(50, d + 1, 3, generator=gen)
    tokens = torch.cat([torch.zeros(50, 1, dtype=torch.int64), draft], 1)
    tree = greedy_tree_verify(tokens, TreeSpec.chain(d), logits)
    linear = greedy_verify(draft, torch.full((50,), d), logits)
    assert torch.equal(tree.output_tokens, linear.output_tokens)


def test_tree_rejects_sampled_requests() -> None:
    with pytest.raises(InvalidRequestError, match="greedily only.*rows \\[1\\].*sampled_tree_verify"):
        greedy_tree_verify(TOKENS, PARENTS, logits_for([0] * 7), temperature=torch.tensor([0.0, 0.7]))
    with pytest.raises(ValueError, match="tree of 7 nodes"):
        greedy_tree_verify(TOKENS[:5], PARENTS, logits_for([0] * 5))


def test_sampled_tree_walk_follows_the_target_along_every_path() -> None:
    """Tree sampling is lossless: the first emitted token follows the root's distribution, and
    each next token, given the tokens before it went down a path of the tree, follows the
    target's distribution at that path's node (a bonus from a leaf included). Tokens that
    are no child of the node -- recovered ones -- end the step."""
    torch.manual_seed(13)
    v, gen = 12, torch.Generator().manual_seed(14)
    probs = torch.stack([random_dist(v, gen, zeros=i % 3) for i in range(len(PARENTS))])
    probs[0, 5] = probs[0, 7] = 0.2  # the root's children are likely, and still rejected often
    probs[0] /= probs[0].sum()
    result = sampled_tree_verify(TOKENS.expand(N, -1), PARENTS, probs.expand(N, -1, -1), [None] * N)
    out, n = result.output_tokens, result.num_output
    assert chi2_pvalue(torch.bincount(out[:, 0], minlength=v), probs[0]) > 1e-3
    children = {0: {5: 1, 7: 2}, 1: {8: 3, 9: 4}, 2: {3: 5}, 3: {4: 6}}
    paths = [((), 0), ((5,), 1), ((7,), 2), ((5, 8), 3), ((5, 9), 4), ((7, 3), 5), ((5, 8, 4), 6)]
    for prefix, node in paths:
        rows = n > len(prefix)
        for i, tok in enumerate(prefix):
            rows &= out[:, i] == tok
        counts = torch.bincount(out[rows, len(prefix)], minlength=v)
        assert chi2_pvalue(counts, probs[node]) > 1e-4, prefix
        # a token that is a child of the node continues the step; any other token ends it
        nxt = out[rows, len(prefix)]
        goes_on = torch.tensor([int(t) in children.get(node, {}) for t in nxt.tolist()])
        assert torch.equal(n[rows] > len(prefix) + 1, goes_on), prefix
    expect_nodes = {tuple(TOKENS[c].item() for c in path): path for path in ([1, 3, 6], [2, 5])}
    for i in range(200):  # the accepted nodes are the path of the accepted tokens
        k = int(result.num_accepted[i])
        toks = tuple(out[i, :k].tolist())
        path = [c for c in result.accepted_nodes[i].tolist() if c >= 0]
        assert [int(TOKENS[c]) for c in path] == list(toks)
        assert int(result.best_node[i]) == (path[-1] if path else 0)
        if toks in expect_nodes:
            assert path == expect_nodes[toks]


def test_a_tree_of_children_drawn_from_the_draft_follows_the_target() -> None:
    """Children drawn independently from the head's q (with replacement: siblings may repeat)
    and verified against q (multi-draft rejection) emit exactly the target's tokens, whose
    distribution after a prefix depends on its tokens, as a model's would. Verified as picks
    (no q) they are still exact -- a pick's rule holds whatever chose it -- but keep fewer
    drafts: with q equal to the target every draft is kept. Verified against a q they were not
    drawn from, they are biased, and the test says so."""
    torch.manual_seed(16)
    v, gen = 6, torch.Generator().manual_seed(17)
    p0 = dist([4, 1, 1, 3, 1, 2])
    q0 = dist([1, 4, 1, 1, 2, 3])  # a draft that disagrees with the target
    tables = {name: torch.stack([random_dist(v, gen, zeros=i % 2) for i in range(v)]) for name in ("p1", "p2", "p3")}
    q1, q2 = (torch.stack([random_dist(v, gen) for _ in range(v)]) for _ in range(2))
    draw = lambda q: torch.multinomial(q, 1, replacement=True).squeeze(-1)  # noqa: E731
    t1, t2 = draw(q0.expand(N, v)), draw(q0.expand(N, v))
    t3, t4, t5 = draw(q1[t1]), draw(q1[t1]), draw(q1[t2])
    t6 = draw(q2[t3])
    tokens = torch.stack([torch.zeros_like(t1), t1, t2, t3, t4, t5, t6], 1)
    q = torch.stack([q0.expand(N, v), q0.expand(N, v), q0.expand(N, v), q1[t1], q1[t1], q1[t2], q2[t3]], 1)
    target = torch.stack([p0.expand(N, v), tables["p1"][t1], tables["p1"][t2], tables["p2"][t3], tables["p2"][t4],
                          tables["p2"][t5], tables["p3"][t6]], 1)

    def follows_the_target(result) -> bool:
        out, n = result.output_tokens, result.num_output
        if chi2_pvalue(torch.bincount(out[:, 0], minlength=v), p0) < 1e-4:
            return False
        for depth, table in ((1, tables["p1"]), (2, tables["p2"])):
            for prev in range(v):
                rows = (n > depth) & (out[:, depth - 1] == prev)
                if rows.sum() > 500 and chi2_pvalue(torch.bincount(out[rows, depth], minlength=v), table[prev]) < 1e-4:
                    return False
        return True

    assert follows_the_target(sampled_tree_verify(tokens, PARENTS, target, [None] * N, draft_probs=q))
    assert follows_the_target(sampled_tree_verify(tokens, PARENTS, target, [None] * N))
    uniform = torch.full_like(q, 1.0 / v)
    assert not follows_the_target(sampled_tree_verify(tokens, PARENTS, target, [None] * N, draft_probs=uniform))
    # a draft equal to the target: each node's children drawn from the target's distribution there
    like = torch.stack([q0.expand(N, v), q1[t1], q1[t2], q2[t3], *[torch.full((N, v), 1.0 / v)] * 3], 1)
    same = sampled_tree_verify(tokens, PARENTS, like, [None] * N, draft_probs=q)
    picks = sampled_tree_verify(tokens, PARENTS, like, [None] * N)
    assert (same.num_accepted == 3).all() and picks.num_accepted.float().mean() < 1.5
    with pytest.raises(ValueError, match="draft_probs must be shaped"):
        sampled_tree_verify(tokens, PARENTS, target, [None] * N, draft_probs=q[:, :3])


def test_sampled_tree_with_one_hot_target_is_greedy_and_seeded_rows_repeat() -> None:
    gen = torch.Generator().manual_seed(15)
    for _ in range(20):
        t = int(torch.randint(2, 12, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
        b, v = 24, 4 * t
        tokens = torch.randperm(v, generator=gen)[:t].expand(b, -1).clone()  # siblings distinct, as top-k picks
        tokens[: b // 2, 1:] = torch.randint(0, v, (b // 2, t - 1), generator=gen)  # ... and some not
        logits = torch.randn(b, t, v, generator=gen)
        logits[b // 2:, torch.arange(t), tokens[b // 2]] += 3.0  # rows whose drafts often win
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), v).float()
        got = sampled_tree_verify(tokens, parents, one_hot, [None] * b)
        want = greedy_tree_verify(tokens, parents, logits)
        distinct = b // 2  # rows with repeated siblings may take another, equally long path
        assert torch.equal(got.output_tokens[distinct:], want.output_tokens[distinct:])
        assert torch.equal(got.accepted_nodes[distinct:], want.accepted_nodes[distinct:])
        tokens[:, 0] = -1  # a row without a tree accepts nothing
        probs = torch.softmax(logits, -1)
        none = sampled_tree_verify(torch.full_like(tokens, -1), parents, probs, [None] * b)
        assert (none.num_accepted == 0).all() and (none.output_tokens[:, 1:] == -1).all()
        seeded = [sampled_tree_verify(tokens, parents, probs, [torch.Generator().manual_seed(i) for i in range(b)])
                  for _ in range(2)]
        assert torch.equal(seeded[0].output_tokens, seeded[1].output_tokens)
    with pytest.raises(ValueError, match="tree of 7 nodes"):
        sampled_tree_verify(TOKENS[:5].unsqueeze(0), PARENTS, torch.ones(1, 5, 12) / 12, [None])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verifiers_on_cuda_match_cpu() -> None:
    gen = torch.Generator().manual_seed(13)
    b, d, v = 32, 4, 5
    logits = torch.randn(b, d + 1, v, generator=gen)
    draft = torch.randint(0, v, (b, d), generator=gen)
    draft_lens = torch.randint(0, d + 1, (b,), generator=gen)
    cpu = greedy_verify(draft, draft_lens, logits)
    gpu = greedy_verify(draft.cuda(), draft_lens.cuda(), logits.cuda())
    assert torch.equal(gpu.output_tokens.cpu(), cpu.output_tokens)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), v).float().cuda()
    gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(b)]
    sampled = rejection_verify(draft.cuda(), draft_lens.cuda(), None, one_hot, gens)
    assert torch.equal(sampled.output_tokens.cpu(), cpu.output_tokens)
    tree = greedy_tree_verify(TOKENS.cuda(), PARENTS, logits_for([5, 9, 0, 0, 2, 0, 0]).cuda())
    assert tree.to_lists() == [[5, 9, 2]]
    one_hot_tree = logits_for([5, 9, 0, 0, 2, 0, 0]).unsqueeze(0).cuda()
    walk = sampled_tree_verify(TOKENS.unsqueeze(0).cuda(), PARENTS, one_hot_tree, [None],
                               draft_probs=torch.softmax(torch.randn(1, 7, 12, generator=gen), -1).cuda())
    assert walk.to_lists() == [[5, 9, 2]]
