"""The device-side proposer interface and what every proposer shares (the factory that
picks one is runtime/proposers/factory.py, so this module imports no proposer).

A proposer lives inside the worker next to the target. It answers four calls:
  draft(msg)            make up to D tokens per row, after its last token in the worker's
                        token buffer (`ModelWorker.set_drafts`; one launch)
  fill(msg)             extend its own KV over tokens it has not seen; carry logits
  draft_probs(rows, slots, starts, D)  [B, D, V] distributions the drafts were sampled from,
                        or None (one-hot)
  agreement(p, o)       teacher-forced greedy agreement with an output (for trace replay)
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specsched.runtime.sampling import logits_to_probs, sample
from specsched.runtime.structured_output import mask_next
from specsched.runtime.sync_guard import to_device
from specsched.scheduler.plan import build_plan

if TYPE_CHECKING:
    from specsched.runtime.token_state import SeqState
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.messages import DraftMessage, FillMessage
    from specsched.scheduler.plan import AttentionPlan


class Proposer:
    """The interface every device-side proposer implements (see the module docstring), with the
    hooks a proposer may leave alone: requests registered and released, emitted tokens, no draft
    distributions (one-hot), no agreement."""

    needs_hidden = False
    aux_layers: tuple[int, ...] = ()  # earlier target layers whose outputs join the hidden states (EAGLE-3)

    def __init__(self, worker: "ModelWorker"):
        self.worker = worker

    # the worker tells its proposer about requests and the tokens each op emitted
    def register(self, slot: int, token_ids: list[int]) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def emitted(self, slots: list[int], tokens: torch.Tensor, accepted: torch.Tensor | None) -> None:
        """An op's emitted tokens, as host-side result buffers (readable once the op is done):
        a forward's [B] (-1 where a row did not sample), or a verify's [B, W] with the rows'
        accepted counts [B] (row i's first accepted[i] + 1 tokens)."""

    def draft(self, msg: "DraftMessage") -> np.ndarray:
        raise NotImplementedError

    def fill(self, msg: "FillMessage") -> None:
        raise NotImplementedError

    def draft_probs(self, rows: list["SeqState"], slots: list[int], starts: np.ndarray, num: int
                    ) -> torch.Tensor | None:
        return None

    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        return []

    def models(self) -> tuple[torch.nn.Module, ...]:
        """The modules this proposer runs (the worker packs their linear layers)."""
        return ()


class NoProposer(Proposer):
    """Plain decoding: nothing is drafted or filled."""

    def draft(self, msg: "DraftMessage") -> np.ndarray:
        raise RuntimeError("no proposer configured: this engine does not speculate")

    def fill(self, msg: "FillMessage") -> None:
        raise RuntimeError("no proposer configured: nothing to fill")


class NgramDrafter(Proposer):
    """Prompt lookup on the worker side: only its teacher-forced agreement (for trace replay).
    Its drafts are made on the host, where the tokens are (`NgramHostDrafter`, the pipeline's
    `HostDrafter`), and reach the worker in the verify message: it makes no draft launch and
    keeps no copy of the requests' tokens."""

    def __init__(self, worker: "ModelWorker", min_n: int, max_n: int, num_tokens: int):
        super().__init__(worker)
        from specsched.runtime.proposers.ngram import NgramProposer

        self.lookup = NgramProposer(min_n, max_n, num_tokens)

    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        seq = list(prompt)
        agree = []
        for t in output:
            guess = self.lookup.propose(seq, 1)
            agree.append(int(bool(guess) and guess[0] == t))
            seq.append(t)
        return agree


def sample_next(worker: "ModelWorker", rows: list["SeqState"], logits: torch.Tensor, greedy: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens [B] from logits [B, V] (on the device); probs [B, V] when any row samples.
    `greedy`: the caller knows every row is greedy (no sampling parameters are built)."""
    if greedy:
        return logits.argmax(-1), None
    st = worker.sampling_tensors(rows)
    if st.all_greedy:
        return logits.argmax(-1), None
    probs = logits_to_probs(logits, st)
    return sample(probs, st.generators), probs


class DraftCollector:
    """One draft launch's tokens, sampled step by step into a [B, D] device tensor, and the
    distributions q they were drawn from, stacked into `SeqState.draft_q` by `finish`."""

    def __init__(self, worker: "ModelWorker", slots: list[int], starts: np.ndarray, rows: list["SeqState"],
                 draft_lens: list[int]):
        self.worker = worker
        self.slots = slots
        self.starts = starts
        self.rows = rows
        self.draft_lens = draft_lens
        self.tokens = torch.zeros((len(rows), worker.draft_width), dtype=torch.int64, device=worker.device)
        self.qs: list[list[torch.Tensor]] = [[] for _ in rows]
        self.greedy = all(st.greedy for st in rows)
        # every row drafts as many: each step runs over all rows (`active` None below)
        self.uniform = len(set(draft_lens)) <= 1
        self.guided = any(st.guide is not None for st in rows)  # structured rows draft what their grammar allows

    def first(self, logits: torch.Tensor) -> None:
        """The first draft token of every row from [B, V] (a row drafting none draws nothing: a seeded row's
        tokens do not depend on its neighbours)."""
        active = [i for i, n in enumerate(self.draft_lens) if n > 0]
        if len(active) == len(self.rows):
            self.extend(None, 0, logits)
        elif active:
            self.extend(active, 0, logits[to_device(active, self.worker.device)])

    def active(self, k: int) -> list[int] | None:
        """The rows that draft token k (0-based column): None where every row does."""
        return None if self.uniform else [i for i, n in enumerate(self.draft_lens) if n > k]

    def last(self, active: list[int] | None, k: int) -> torch.Tensor:
        """[len(active)] the rows' draft token k-1 (the input of their k-th draft step)."""
        if active is None:
            return self.tokens[:, k - 1]
        return self.tokens[to_device(active, self.worker.device), k - 1]

    def extend(self, active: list[int] | None, k: int, logits: torch.Tensor) -> None:
        """Draft token k (0-based column) for rows `active` (None: all) from logits [len(active), V]."""
        rows = self.rows if active is None else [self.rows[i] for i in active]
        if self.guided:  # each structured row's grammar after its drafts so far
            drafted = self.tokens[:, :k] if active is None else self.tokens[to_device(active, self.worker.device), :k]
            logits = mask_next(logits, rows, drafted)
        toks, probs = sample_next(self.worker, rows, logits, self.greedy)
        if active is None:
            self.tokens[:, k] = toks
        else:
            self.tokens[to_device(active, self.worker.device), k] = toks
        if probs is not None:
            for j, i in enumerate(range(len(self.rows)) if active is None else active):
                self.qs[i].append(probs[j])

    def finish(self) -> np.ndarray:
        """Store the drafts in the worker's draft buffer and sampled rows' draft_q [n, V];
        returns the draft counts (what each row was asked for: a model always drafts them)."""
        counts = [d if d > 0 else 0 for d in self.draft_lens]
        self.worker.set_drafts(self.slots, self.starts, self.tokens, counts)
        for i, st in enumerate(self.rows):
            st.draft_q = torch.stack(self.qs[i][: counts[i]]) if (self.qs[i] and counts[i] and not st.greedy) else None
        return np.asarray(counts, dtype=np.int64)


def one_token_forwards(worker: "ModelWorker", msg: "DraftMessage", drafts: DraftCollector, kv_first: np.ndarray
                       ) -> Iterator[tuple[int, list[int] | None, Any, torch.Tensor]]:
    """The forwards of a draft launch after its first token, as (j, active rows -- None: all --,
    attention, RoPE positions): forward j reads draft column j and drafts column j + 1, row i's
    KV kv_first[i] + j tokens long (its new token at position kv - 1). Where every row drafts as
    many tokens and the attention backend plans runs of steps (`prepare_steps`), the run is
    planned once; otherwise each forward is planned when it runs (a FlashInfer wrapper holds one
    plan at a time), over the rows still drafting."""
    w = worker
    num_steps = max(drafts.draft_lens, default=0) - 1
    if num_steps <= 0:
        return
    kv_first = np.asarray(kv_first, dtype=np.int64)
    # (a padded step is planned on its own: the run's plans would not be the padded shapes)
    prepare_steps = getattr(w.backend, "prepare_steps", None) if drafts.uniform and w.padding is None else None
    if prepare_steps is not None:
        last = build_plan(np.ones_like(kv_first), kv_first + num_steps - 1, msg.page_tables, w.page_size,
                          table_lens=msg.table_lens)
        run = prepare_steps(last, num_steps, w.device)
    for j in range(num_steps):
        active = drafts.active(j + 1)
        if prepare_steps is not None:
            yield j, active, run.step(j), run.positions[j]
            continue
        rows = slice(None) if active is None else active
        plan = build_plan(np.ones(len(kv_first[rows]), dtype=np.int64), kv_first[rows] + j, msg.page_tables[rows],
                          w.page_size, table_lens=msg.table_lens[rows])
        _, step, positions = w.plan(plan)
        yield j, active, step, positions


def one_hot_or(worker: "ModelWorker", rows: list["SeqState"], slots: list[int], starts: np.ndarray, num: int,
               vocab: int) -> torch.Tensor | None:
    """Stack rows' draft distributions [B, num, V]; rows drafted greedily get one-hot rows of
    their drafts (from the token buffer, on the device)."""
    if all(st.draft_q is None for st in rows):
        return None
    drafts = worker.tokens.after(slots, starts, num)
    out = torch.zeros(len(rows), num, vocab, device=worker.device)
    out.scatter_(2, drafts.unsqueeze(-1), 1.0)  # one-hot everywhere; sampled rows overwritten
    for i, st in enumerate(rows):
        if st.draft_q is not None:
            n = min(num, st.draft_q.shape[0])
            out[i, :n] = st.draft_q[:n]
    return out


def window_reads(worker: "ModelWorker", msg: "FillMessage", plan: "AttentionPlan",
                 shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fill over the verify window (`FillMessage.window`), launched before the host knows the
    accepted lengths: (token ids, index of each row's carried logits), both following the
    verify's accepted counts on the device. At position p the proposer reads token p + `shift`
    (a draft model 0, a head 1); past its new last token -- at start + `shift` + accepted -- a row
    reads that one again (KV the next steps overwrite), and it carries the logits at its accepted
    index."""
    got = worker.last_verify
    if got is None or got[0] != msg.step or not np.array_equal(got[1], msg.slots):
        raise RuntimeError(f"fill over the verify window of step {msg.step} needs that verify's accepted "
                           f"lengths; the latest verify is step {None if got is None else got[0]}")
    acc, dev = got[2], worker.device
    qo, qo_indptr = plan.qo_lens, plan.qo_indptr
    total = int(qo_indptr[-1])
    limit = torch.repeat_interleave(to_device(msg.start + shift, dev, torch.int64) + acc,
                                    to_device(qo, dev, torch.int64), output_size=total)
    pos = to_device(plan.positions + shift, dev, torch.int64)
    ids = worker.tokens.at(np.repeat(msg.slots, qo), torch.minimum(pos, limit))
    return ids, to_device(qo_indptr[:-1], dev, torch.int64) + acc
