"""MTP-head and EAGLE-tree proposers: one decoder layer on the target's hidden states.

Invariant between steps (L = tokens known for a request): the head's KV covers positions
0..L-2, `SeqState.carried` holds its logits at L-2 (predicting t_L, the first draft token)
and `SeqState.extra["hidden"]` its output hidden state there (fed back for deeper drafts).

- fill after a target forward: the head runs over the forward's rows with the target's
  hidden states H_i and tokens t_{i+1}; carried = logits at each row's last position.
- fill after an MTP verify (same batch, launched before the host knows the accepted
  lengths): positions [L-1, L+D], tokens t_{i+1} where known (wasted work elsewhere);
  carried = logits at row `accepted` -- picked on the device, no host round trip.
- MTP draft: d_1 from carried; d_k (k >= 2) from a head step at position L+k-3 on (its own
  previous hidden, d_{k-1}), writing head KV that the next fill overwrites. One launch.
- EAGLE draft: the same head expands spec.tree_parents (BFS): children of a node are the
  top-c tokens of its logits; one head forward per depth over that depth's parents, with a
  custom mask (prefix + ancestors) and tree positions. `accept_tree` verifies greedily,
  compacts the accepted path's target KV into contiguous slots, and hands the fill the
  hidden states along that path. Trees are greedy only.
"""
from __future__ import annotations

import numpy as np
import torch

from specsched.runtime.mtp_head import load_head
from specsched.runtime.proposers.base import DraftCollector, NoProposer, one_hot_or
from specsched.runtime.verify import TreeSpec, check_tree_greedy, greedy_tree_verify
from specsched.scheduler.messages import DraftMessage, FillMessage
from specsched.scheduler.plan import build_plan


class HeadProposer(NoProposer):
    """A linear MTP head (spec.kind == "mtp"); `EagleProposer` adds the tree."""

    needs_hidden = True

    def __init__(self, worker, spec, proposer_dir: str | None, num_pages: int):
        super().__init__(worker)
        if proposer_dir is None:
            raise ValueError(f"proposer {spec.kind!r} needs an MTP head directory")
        self.spec = spec
        self.head = load_head(proposer_dir, worker.target)
        self.kv = self.head.make_kv_cache(num_pages, worker.page_size)

    def _tensor(self, values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64, device=self.worker.device)

    # -- fill -------------------------------------------------------------------------------
    def fill(self, msg: FillMessage) -> None:
        w = self.worker
        lh = w.last_hidden
        after = msg.after
        if lh is None or lh["op"] != after or lh["step"] not in (msg.step, None):
            got = None if lh is None else (lh["op"], lh["step"])
            raise RuntimeError(f"head fill after {after!r} of step {msg.step} needs that launch's "
                               f"target hidden states; the latest recorded are {got}")
        plan, step, positions = w.plan(msg.plan)
        where = {int(s): j for j, s in enumerate(lh["slots"])}
        hq, qo = lh["qo_indptr"], plan.qo_lens
        rows, ids, gather, carry = [], [], [], []
        starts = msg.start.tolist()
        for b, slot in enumerate(msg.slots.tolist()):
            j = where.get(slot)
            n = int(qo[b])
            if j is None or int(hq[j + 1] - hq[j]) != n:
                raise RuntimeError(f"fill row for slot {slot} has {n} positions, the target launch "
                                   f"recorded {None if j is None else int(hq[j + 1] - hq[j])}")
            st = w.states[slot]
            toks = st.tokens
            start = starts[b]
            ids.extend(toks[p + 1] if p + 1 < len(toks) else toks[-1] for p in range(start, start + n))
            gather.extend(range(int(hq[j]), int(hq[j + 1])))
            k = int(lh["accepted"][j]) if (after == "verify" and self.spec.kind == "mtp") else n - 1
            carry.append(int(plan.qo_indptr[b]) + k)
            rows.append(st)
        hidden = lh["hidden"]
        if len(gather) != hidden.shape[0] or gather != list(range(len(gather))):
            hidden = hidden.index_select(0, self._tensor(gather))
        carry_t = self._tensor(carry)
        out = self.head(self._tensor(ids), hidden, step, self.kv, positions, logits_indices=carry_t)
        carried_hidden = out.hidden.index_select(0, carry_t)
        for i, st in enumerate(rows):
            st.carried = out.logits[i]
            st.extra["hidden"] = carried_hidden[i]

    # -- linear drafting ----------------------------------------------------------------------
    def _step(self, active: list[int], msg: DraftMessage, kv_lens: list[int], ids: list[int],
              hidden: torch.Tensor, positions=None, masks=None):
        """One head forward over the given rows of a draft launch (plans from the page tables)."""
        w = self.worker
        qo = [len(x) for x in positions] if positions is not None else [1] * len(active)
        plan = build_plan(qo, kv_lens, msg.page_tables[active], w.page_size,
                          table_lens=msg.table_lens[active], positions=positions, custom_masks=masks)
        step = w.backend.prepare(plan, w.device)
        pos = torch.as_tensor(plan.positions, device=w.device)
        return self.head(self._tensor(ids), hidden, step, self.kv, pos)

    def draft(self, msg: DraftMessage) -> np.ndarray:
        w = self.worker
        rows = [w.states[s] for s in msg.slots.tolist()]
        num_draft = msg.num_draft.tolist()
        L = [len(st.tokens) for st in rows]
        drafts = DraftCollector(w, rows, num_draft)
        drafts.first(torch.stack([st.carried for st in rows]))
        hidden = torch.stack([st.extra["hidden"] for st in rows])  # [B, H]
        for k in range(2, max(num_draft, default=0) + 1):
            active = [i for i in range(len(rows)) if num_draft[i] >= k]
            out = self._step(active, msg, [L[i] + k - 2 for i in active],
                             [rows[i].drafts[-1] for i in active], hidden[active])
            hidden = hidden.clone()
            hidden[active] = out.hidden
            drafts.extend(active, out.logits)
        return drafts.finish()

    def draft_probs(self, rows, num: int) -> torch.Tensor | None:
        return one_hot_or(rows, num, self.worker.target.config.vocab_size, self.worker.device)

    # -- teacher-forced agreement ---------------------------------------------------------------
    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        """Per output token: does the head's greedy guess from the target's teacher-forced
        hidden states (head position P+j-2 for output j) equal it? 0 where no head position."""
        if not output:
            return []
        seq = prompt + output
        ids = self._tensor([seq])
        _, hidden = self.worker.target.forward_full(ids)
        out = self.head.forward_full(ids[:, 1:], hidden[:, :-1])
        pred = out.logits[0].argmax(-1).tolist()  # pred[i] guesses seq[i + 2]
        p = len(prompt)
        return [int(p + j - 2 >= 0 and pred[p + j - 2] == t) for j, t in enumerate(output)]


class EagleProposer(HeadProposer):
    """The head expanded as a fixed top-k tree; greedy verification of the whole tree."""

    def __init__(self, worker, spec, proposer_dir: str | None, num_pages: int):
        super().__init__(worker, spec, proposer_dir, num_pages)
        parents = list(spec.tree_parents)
        self.tree = TreeSpec.from_parents([-1] + [p + 1 for p in parents])  # node 0 = root
        self.depths = [int(d) for d in spec.tree_depths()]
        self._draft_step = None  # step of the latest draft: its verify is the same step's
        self.children: dict[int, list[int]] = {}
        for n, p in enumerate(parents):
            self.children.setdefault(p, []).append(n)

    def draft(self, msg: DraftMessage) -> np.ndarray:
        w = self.worker
        rows = [w.states[s] for s in msg.slots.tolist()]
        check_tree_greedy([st.temperature for st in rows])
        self._draft_step = msg.step
        L = [len(st.tokens) for st in rows]
        b, t = len(rows), len(self.depths)
        tokens = torch.zeros(b, t, dtype=torch.int64, device=w.device)
        self._expand(-1, torch.stack([st.carried for st in rows]), tokens)
        node_hidden: dict[int, torch.Tensor] = {}
        run_slot: dict[int, int] = {}  # node -> head-tree slot (after the L-1 prefix slots)
        carried_hidden = torch.stack([st.extra["hidden"] for st in rows])
        for depth in range(1, max(self.depths, default=0)):
            run = [n for n in range(t) if self.depths[n] == depth and n in self.children]
            if not run:
                continue
            for n in run:
                run_slot[n] = len(run_slot)
            used = len(run_slot)
            block = np.zeros((len(run), used), dtype=bool)
            for r, n in enumerate(run):
                a = n
                while a >= 0:
                    block[r, run_slot[a]] = True
                    a = self.spec.tree_parents[a]
            masks = [np.concatenate([np.ones((len(run), L[i] - 1), dtype=bool), block], axis=1) for i in range(b)]
            positions = [np.full(len(run), L[i] - 2 + depth) for i in range(b)]
            ids = tokens[:, run].reshape(-1).tolist()
            parents = [self.spec.tree_parents[n] for n in run]
            hid = torch.stack([carried_hidden if p < 0 else node_hidden[p] for p in parents], 1)
            out = self._step(list(range(b)), msg, [L[i] - 1 + used for i in range(b)], ids,
                             hid.reshape(b * len(run), -1), positions, masks)
            logits = out.logits.view(b, len(run), -1)
            hs = out.hidden.view(b, len(run), -1)
            for r, n in enumerate(run):
                node_hidden[n] = hs[:, r]
                self._expand(n, logits[:, r], tokens)
        counts = []
        nd = msg.num_draft.tolist()
        for i, st in enumerate(rows):
            st.drafts = tokens[i].tolist() if nd[i] > 0 else []
            st.draft_q = None
            counts.append(len(st.drafts))
        return np.asarray(counts, dtype=np.int64)

    def _expand(self, parent: int, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        kids = self.children.get(parent, [])
        if kids:
            tokens[:, kids] = logits.topk(len(kids), dim=-1).indices

    def accept_tree(self, rows, logits: torch.Tensor, plan, hidden: torch.Tensor):
        """Greedy tree verification of logits [B, 1+T, V]; compacts the accepted path's target
        KV to slots of positions L, L+1, ... and records its hidden states for the fill.
        Returns (emitted token lists, accepted counts)."""
        w = self.worker
        check_tree_greedy([st.temperature for st in rows])
        b, width = logits.shape[:2]
        tree_tokens = torch.full((b, width), -1, dtype=torch.int64, device=logits.device)
        for i, st in enumerate(rows):
            tree_tokens[i, 0] = st.tokens[-1]
            if len(st.drafts) == width - 1:
                tree_tokens[i, 1:] = self._tensor(st.drafts)
        res = greedy_tree_verify(tree_tokens, self.tree, logits)
        accepted = res.num_accepted.tolist()
        paths = res.accepted_nodes.tolist()
        src, dst, gather, indptr = [], [], [], [0]
        for i in range(b):
            base = int(plan.qo_indptr[i])
            path = paths[i][: accepted[i]]
            for k, n in enumerate(path, start=1):
                if n != k:
                    src.append(int(plan.slot_mapping[base + n]))
                    dst.append(int(plan.slot_mapping[base + k]))
            gather.extend([base] + [base + n for n in path])
            indptr.append(len(gather))
        w.kv.copy_slots(src, dst)
        emitted = res.to_lists()
        slot_of = {id(st): slot for slot, st in w.states.items()}
        w.last_hidden = {
            "step": self._draft_step, "op": "verify",
            "hidden": hidden.index_select(0, self._tensor(gather)),
            "qo_indptr": np.asarray(indptr, dtype=np.int64), "slots": [slot_of[id(st)] for st in rows],
            "accepted": accepted, "emitted": emitted,
        }
        return emitted, accepted


def make_head_proposer(worker, spec, proposer_dir: str | None, num_pages: int):
    if spec.kind == "eagle":
        return EagleProposer(worker, spec, proposer_dir, num_pages)
    if spec.kind == "mtp":
        return HeadProposer(worker, spec, proposer_dir, num_pages)
    raise ValueError(f"no head proposer for kind {spec.kind!r}")
