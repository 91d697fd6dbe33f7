"""MTP-head and EAGLE-tree proposers: one decoder layer on the target's hidden states.

Invariant between steps (L = tokens known for a request): the head's KV covers positions
0..L-2, `SeqState.carried` holds its logits at L-2 (predicting t_L, the first draft token)
and `SeqState.extra["hidden"]` its output hidden state there (fed back for deeper drafts).

- fill after a target forward: the head runs over the forward's rows with the target's
  hidden states H_i and tokens t_{i+1}; carried = logits at each row's last position.
- fill that catches up (after plain steps of an adaptive draft length, whose fills waited):
  the positions the head missed, from the target hidden states those forwards kept
  (`HiddenLog`); carried = logits at each row's last position.
- fill after an MTP verify (same batch, launched before the host knows the accepted
  lengths): positions [L-1, L+D], tokens t_{i+1} where known (wasted work elsewhere);
  carried = logits at row `accepted` -- picked on the device, no host round trip.
- MTP draft: d_1 from carried; d_k (k >= 2) from a head step at position L+k-3 on (its own
  previous hidden, d_{k-1}), writing head KV that the next fill overwrites. One launch.
- EAGLE draft: the same head expands spec.tree_parents (BFS): children of a node are the
  top-c tokens of its logits (a sampled row: c draws from the head's distribution there); one
  head forward per depth over that depth's parents, with a custom mask (prefix + ancestors)
  and tree positions. `accept_tree` verifies greedily (the deepest path matching the target's
  argmax chain) or, where a row samples, by `sampled_tree_verify` against the distributions
  the children were drawn from (multi-draft rejection: lossless); it compacts the accepted
  path's target KV into contiguous slots and hands the fill the hidden states along that path.
"""
from __future__ import annotations

import numpy as np
import torch

from specsched.runtime.dummy import load_head_for
from specsched.runtime.proposers.base import DraftCollector, Proposer, one_hot_or, one_token_forwards, window_reads
from specsched.runtime.proposers.hidden_log import HiddenLog
from specsched.runtime.structured_output import mask_next
from specsched.runtime.sync_guard import to_device
from specsched.runtime.sampling import logits_to_probs, sample
from specsched.runtime.tree_verify import TreeSpec, greedy_tree_verify, sampled_tree_verify, synthetic_tree_verify
from specsched.runtime.verify import allowed_drafts
from specsched.scheduler.messages import DraftMessage, FillMessage
from specsched.scheduler.plan import build_plan


class HeadProposer(Proposer):
    """A linear MTP head (spec.kind == "mtp"); `EagleProposer` adds the tree."""

    needs_hidden = True

    def __init__(self, worker, spec, proposer_dir: str | None, num_pages: int):
        super().__init__(worker)
        if proposer_dir is None:
            raise ValueError(f"proposer {spec.kind!r} needs an MTP head directory")
        self.spec = spec
        self.head = load_head_for(proposer_dir, worker.target, worker.load_format)
        self.kv = self.head.make_kv_cache(num_pages, worker.page_size, backend=worker.backend)
        self.kept = HiddenLog()  # target hidden states of forwards whose fill waits

    def _tensor(self, values) -> torch.Tensor:
        return to_device(values, self.worker.device, torch.int64)

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.head,)

    @property
    def aux_layers(self) -> tuple[int, ...]:  # the target layers the head reads besides the last
        return self.head.aux_layers

    def release(self, slot: int) -> None:
        self.kept.release(slot)

    def keep_hidden(self, slots: np.ndarray, starts: np.ndarray, qo_indptr: np.ndarray, hidden: torch.Tensor) -> None:
        """A forward whose fill waits: its rows' target hidden states, for the catch-up."""
        self.kept.keep(slots, starts, qo_indptr, hidden)

    # -- fill -------------------------------------------------------------------------------
    def fill(self, msg: FillMessage) -> None:
        if msg.after == "catch_up":
            self._catch_up(msg)
            return
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
        slots = msg.slots.tolist()
        rows, gather = [], []
        for b, slot in enumerate(slots):
            j = where.get(slot)
            n = int(qo[b])
            if j is None or int(hq[j + 1] - hq[j]) < n:
                raise RuntimeError(f"fill row for slot {slot} has {n} positions, the target launch "
                                   f"recorded {None if j is None else int(hq[j + 1] - hq[j])}")
            gather.extend(range(int(hq[j]), int(hq[j]) + n))  # a tree's row: its accepted path first
            rows.append(w.states[slot])
        # the head reads, at position p, the target's hidden state there and token p + 1
        if msg.window:
            # the verify batch runs past the accepted tokens: beyond a row's new last token
            # (start + 1 + accepted) it reads that token, and the carried logits are the ones after it
            ids, carry_t = window_reads(w, msg, plan, 1)
        else:
            ids = w.tokens.at(np.repeat(msg.slots, qo), plan.positions + 1)
            carry_t = self._tensor(plan.qo_indptr[1:] - 1)
        hidden = lh["hidden"]
        if len(gather) != hidden.shape[0] or gather != list(range(len(gather))):
            hidden = hidden.index_select(0, self._tensor(gather))
        self._run_fill(rows, ids, hidden, step, positions, carry_t)

    def _catch_up(self, msg: FillMessage) -> None:
        """Positions [start, end) of each row from the hidden states the device kept."""
        w = self.worker
        plan, step, positions = w.plan(msg.plan)
        ids = w.tokens.ranges(msg.slots, msg.start + 1, msg.end + 1)  # the head reads token p + 1 at position p
        hidden = self.kept.gather(msg.slots, msg.start, msg.end)
        rows = [w.states[s] for s in msg.slots.tolist()]
        self._run_fill(rows, ids, hidden, step, positions, self._tensor(plan.qo_indptr[1:] - 1))

    def _run_fill(self, rows, ids: torch.Tensor, hidden: torch.Tensor, step, positions: torch.Tensor,
                  carry_t: torch.Tensor) -> None:
        """The head over a fill's positions; each row's logits and hidden state at `carry_t`
        are carried into its next draft."""
        out = self.head(ids, hidden, step, self.kv, positions, logits_indices=carry_t)
        carried_hidden = out.hidden.index_select(0, carry_t)
        for i, st in enumerate(rows):
            st.carried = out.logits[i]
            st.extra["hidden"] = carried_hidden[i]

    # -- linear drafting ----------------------------------------------------------------------
    def draft(self, msg: DraftMessage) -> np.ndarray:
        w = self.worker
        slots = msg.slots.tolist()
        rows = [w.states[s] for s in slots]
        drafts = DraftCollector(w, slots, msg.start, rows, msg.draft_lens.tolist())
        drafts.first(torch.stack([st.carried for st in rows]))
        hidden = torch.stack([st.extra["hidden"] for st in rows])  # [B, H]
        # forward j drafts token j + 2 on its previous hidden state, over a head KV of start + 1 + j
        for j, active, step, pos in one_token_forwards(w, msg, drafts, msg.start + 1):
            out = self.head(drafts.last(active, j + 1), hidden if active is None else hidden[active],
                            step, self.kv, pos)
            if active is None:
                hidden = out.hidden
            else:
                hidden = hidden.clone()
                hidden[active] = out.hidden
            drafts.extend(active, j + 1, out.logits)
        return drafts.finish()

    def draft_probs(self, rows, slots, starts, num: int) -> torch.Tensor | None:
        return one_hot_or(self.worker, rows, slots, starts, num, self.worker.target.config.vocab_size)

    # -- teacher-forced agreement ---------------------------------------------------------------
    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        """Per output token: does the head's greedy guess from the target's teacher-forced
        hidden states (head position P+j-2 for output j) equal it? 0 where no head position."""
        if not output:
            return []
        seq = prompt + output
        ids = self._tensor([seq])
        _, hidden = self.worker.target.forward_full(ids, self.aux_layers)
        out = self.head.forward_full(ids[:, 1:], hidden[:, :-1])
        pred = out.logits[0].argmax(-1).tolist()  # pred[i] guesses seq[i + 2]
        p = len(prompt)
        return [int(p + j - 2 >= 0 and pred[p + j - 2] == t) for j, t in enumerate(output)]


class EagleProposer(HeadProposer):
    """The head expanded as a tree of a fixed shape (top-k children, or draws for sampled
    rows), verified in one target forward over every node."""

    def __init__(self, worker, spec, proposer_dir: str | None, num_pages: int):
        super().__init__(worker, spec, proposer_dir, num_pages)
        parents = list(spec.tree_parents)
        self.tree = TreeSpec.from_parents([-1] + [p + 1 for p in parents])  # node 0 = root
        self.depths = [int(d) for d in spec.tree_depths()]
        # each tree node's drafts from depth 1 down to it, as columns of a draft's tokens (node n at column n - 1)
        self.node_paths = [[n - 1 for n in path if n > 0] for path in self.tree.paths.tolist()]
        self._draft_step = None  # step of the latest draft: its verify is the same step's
        self.children: dict[int, list[int]] = {}
        for n, p in enumerate(parents):
            self.children.setdefault(p, []).append(n)

    def draft(self, msg: DraftMessage) -> np.ndarray:
        w = self.worker
        slots = msg.slots.tolist()
        rows = [w.states[s] for s in slots]
        self._draft_step = msg.step
        L = (msg.start + 1).tolist()  # tokens per row
        b, t = len(rows), len(self.depths)
        tokens = torch.zeros(b, t, dtype=torch.int64, device=w.device)
        draw = None if all(st.greedy for st in rows) else _TreeDraws(w, rows, t, msg.draft_lens.tolist())
        guided = rows if any(st.guide is not None for st in rows) else None  # structured rows: their grammar's nodes
        self._expand(-1, torch.stack([st.carried for st in rows]), tokens, draw, guided)
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
            ids = tokens[:, run].reshape(-1)
            parents = [self.spec.tree_parents[n] for n in run]
            hid = torch.stack([carried_hidden if p < 0 else node_hidden[p] for p in parents], 1)
            plan = build_plan([len(run)] * b, [L[i] - 1 + used for i in range(b)], msg.page_tables, w.page_size,
                              table_lens=msg.table_lens, positions=positions, custom_masks=masks)
            _, step, pos = w.plan(plan)
            out = self.head(ids, hid.reshape(b * len(run), -1), step, self.kv, pos)
            logits = out.logits.view(b, len(run), -1)
            hs = out.hidden.view(b, len(run), -1)
            for r, n in enumerate(run):
                node_hidden[n] = hs[:, r]
                self._expand(n, logits[:, r], tokens, draw, guided)
        counts = [t if d > 0 else 0 for d in msg.draft_lens.tolist()]
        w.set_drafts(slots, msg.start, tokens, counts)
        for i, st in enumerate(rows):
            st.draft_q = None if draw is None or st.greedy else draw.q[i]
        return np.asarray(counts, dtype=np.int64)

    def _expand(self, parent: int, logits: torch.Tensor, tokens: torch.Tensor, draw: "_TreeDraws | None",
                guided: list | None = None) -> None:
        """The children of `parent` from its logits [B, V]: its top-k tokens, or for sampled rows
        (`draw`) k independent draws from the head's distribution there; `guided`: the rows, some structured, whose
        grammar after the nodes down to `parent` masks the head's logits first."""
        kids = self.children.get(parent, [])
        if not kids:
            return
        if guided is not None:
            logits = mask_next(logits, guided, tokens[:, self.node_paths[parent + 1]])
        top = logits.topk(len(kids), dim=-1).indices
        tokens[:, kids] = top if draw is None else draw.children(kids, logits, top)

    def accept_tree(self, msg, rows, drafts: torch.Tensor, last: torch.Tensor, logits: torch.Tensor, plan,
                    hidden: torch.Tensor):
        """Tree verification of logits [B, 1+T, V] (drafts [B, T], last [B] the roots): greedy
        where every row is, else lossless sampling (greedy rows of a mixed batch keep their
        greedy outcome); compacts the accepted path's target KV to slots of positions L, L+1,
        ... and records its hidden states for the fill, all on the device. Returns the
        TreeVerifyResult."""
        w = self.worker
        b, width = logits.shape[:2]
        has_tree = [st.draft_len == width - 1 for st in rows]
        whole = to_device(has_tree, w.device)
        nodes = torch.where(whole.unsqueeze(-1), drafts, torch.full_like(drafts, -1))  # no tree: nothing to accept
        tokens = torch.cat([last.unsqueeze(-1), nodes], dim=1)
        if w.acceptance == "synthetic":  # a path of the drawn depth (none where the row has no tree)
            probs = logits_to_probs(logits.reshape(b * width, -1), w.sampling_tensors(rows, width))
            drawn = w.synthetic.accepted(self.tree.max_depth, [st.key for st in rows], msg.start,
                                         [st.synthetic for st in rows])
            allowed = allowed_drafts(logits, drafts, self.tree.to(w.device).parents)  # the tree's copy on the device
            res = synthetic_tree_verify(tokens, self.tree, probs.view(b, width, -1), torch.where(whole, drawn, 0),
                                        [st.generator for st in rows], allowed)
        elif all(st.greedy for st in rows):
            res = greedy_tree_verify(tokens, self.tree, logits)
        else:
            probs = logits_to_probs(logits.reshape(b * width, -1), w.sampling_tensors(rows, width))
            q = one_hot_or(w, rows, msg.slots.tolist(), msg.start, width - 1, probs.shape[-1])
            if q is not None:  # the root's row is never read
                q = torch.cat([q.new_zeros((b, 1, q.shape[-1])), q], dim=1)
            res = sampled_tree_verify(tokens, self.tree, probs.view(b, width, -1), [st.generator for st in rows],
                                      draft_probs=q, has_tree=has_tree)
        depth = res.accepted_nodes.shape[1]
        base = self._tensor(plan.qo_indptr[:-1]).unsqueeze(-1)  # [B, 1] each row's first token
        sm = self._tensor(plan.slot_mapping)
        k = torch.arange(1, depth + 1, device=w.device)
        path = res.accepted_nodes.clamp(min=0)  # node at depth k (k <= accepted), else padding
        move = (k <= res.num_accepted.unsqueeze(-1)) & (path != k)
        dst = sm[base + k]
        src = torch.where(move, sm[base + path], dst)  # the rest copy a slot onto itself
        w.kv.copy_slots(src, dst)
        # the fill reads each row's accepted path: the root, then a node per accepted depth
        at = torch.cat([base, base + path], dim=1).reshape(-1)
        w.last_hidden = {
            "step": self._draft_step, "op": "verify", "hidden": hidden.index_select(0, at),
            "qo_indptr": np.arange(b + 1, dtype=np.int64) * (depth + 1), "slots": msg.slots.tolist(),
        }
        return res


class _TreeDraws:
    """A sampled tree's children: where a row samples, each child of a node is an independent
    draw from the head's distribution q there (temperature, top-k, top-p as the row's target),
    kept in `q` [B, T, V] for the verifier (`sampled_tree_verify`'s multi-draft rejection);
    greedy rows keep their top-k children."""

    def __init__(self, worker, rows, num_nodes: int, draft_lens: list[int]):
        self.st = worker.sampling_tensors(rows)
        self.greedy = to_device([st.greedy for st in rows], worker.device).unsqueeze(-1)
        # a row drafting no tree draws from the global RNG, not its own generator (its tokens do not depend on its
        # neighbours)
        self.generators = [st.generator if d > 0 else None for st, d in zip(rows, draft_lens)]
        self.q: torch.Tensor | None = None
        self.num_nodes = num_nodes

    def children(self, kids: list[int], logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        q = logits_to_probs(logits, self.st)
        if self.q is None:
            self.q = q.new_zeros((q.shape[0], self.num_nodes, q.shape[1]))
        self.q[:, kids] = q.unsqueeze(1)
        drawn = torch.stack([sample(q, self.generators) for _ in kids], dim=1)
        return torch.where(self.greedy, top, drawn)


def make_head_proposer(worker, spec, proposer_dir: str | None, num_pages: int):
    if spec.kind == "eagle":
        return EagleProposer(worker, spec, proposer_dir, num_pages)
    if spec.kind == "mtp":
        return HeadProposer(worker, spec, proposer_dir, num_pages)
    raise ValueError(f"no head proposer for kind {spec.kind!r}")
