"""ModelWorker: executes the pipeline's ops inside the device (worker process or CUDA).

Why: the device, not the host, owns weights, KV caches and per-request token state. The
host's messages say which positions to compute; the tokens the device itself produced
(samples, accepted drafts, bonus tokens) never need a round trip before the next launch.
That is what lets the `overlap` and `mtp` schedules keep the host off the critical path.

Ops (scheduler/messages.py defines their typed messages and results):
  forward  target forward of prefill chunks / decodes, sampling rows that reach their end
  draft    the proposer's D tokens for each row, in one launch
  verify   target over [last token, candidates]; acceptance; emits accepted + 1 tokens
  fill     the proposer's KV fill (and the logits carried into the next step's draft)
  agreement  teacher-forced per-position agreement of the proposer with given outputs
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specsched.runtime.checkpoint import load_model
from specsched.runtime.proposers.factory import make_proposer
from specsched.runtime.sampling import SamplingTensors, logits_to_probs, make_generator, sample_logits
from specsched.runtime.verify import greedy_verify, rejection_verify, threshold_verify
from specsched.scheduler.messages import (AgreementMessage, AgreementResult, DraftMessage, DraftResult, FillMessage, FillResult, ForwardMessage,
                                          ForwardResult, VerifyMessage, VerifyResult)
from specsched.scheduler.plan import AttentionPlan
from specsched.scheduler.proposer import ProposerSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class SeqState:
    tokens: list[int]  # every token the device knows for this request
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None
    carried: torch.Tensor | None = None  # [V] proposer logits for the next token
    drafts: list[int] = field(default_factory=list)  # this step's draft tokens
    draft_q: torch.Tensor | None = None  # [D, V] draft distributions (sampled requests)
    extra: dict = field(default_factory=dict)  # proposer-specific state

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ModelWorker:
    def __init__(
        self,
        model_dir: str,
        proposer: dict,
        proposer_dir: str | None = None,
        num_pages: int = 1024,
        page_size: int = 16,
        dtype: str = "float32",
        attention: str = "torch",
        device: str = "cpu",
        acceptance: str = "lossless",
        threshold: float = 0.3,
        ngram: tuple[int, int] = (1, 3),
        num_threads: int | None = None,
    ):
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.set_grad_enabled(False)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.page_size = page_size
        self.target = load_model(model_dir, dtype=self.dtype, device=self.device)
        self.kv = self.target.make_kv_cache(num_pages, page_size)
        self.backend = self.target.attention_backend(attention)
        self.spec = ProposerSpec(proposer["kind"], proposer["draft_len"], tuple(proposer.get("tree_parents", ())))
        self.acceptance = acceptance
        self.threshold = threshold
        self.states: dict[int, SeqState] = {}
        self.proposer = make_proposer(self, self.spec, proposer_dir, num_pages, ngram)
        self.last_hidden: dict | None = None  # target hidden states of the latest target launch

    # -- dispatch -------------------------------------------------------------------------------
    def execute(self, op: str, batch: Any) -> Any:
        """Run one op on its typed message (scheduler/messages.py); `ping` takes anything."""
        for slot in getattr(batch, "release", ()):
            self.states.pop(slot, None)
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise ValueError(f"unknown op {op!r}")
        with torch.inference_mode():
            return fn(batch)

    def op_ping(self, batch: dict) -> dict:
        return {"ok": True, "num_states": len(self.states)}

    def _register(self, msg: ForwardMessage) -> None:
        for r in msg.register:
            self.states[r.slot] = SeqState(list(r.token_ids), float(r.temperature), int(r.top_k),
                                           float(r.top_p), make_generator(r.seed, self.device))

    def sampling_tensors(self, rows: list[SeqState], repeat: int = 1) -> SamplingTensors:
        """The rows' sampling parameters on this device, each row repeated `repeat` times."""
        rows = [s for s in rows for _ in range(repeat)]
        return SamplingTensors.from_params(rows, [s.generator for s in rows], self.device)

    def plan(self, plan: AttentionPlan) -> tuple[AttentionPlan, Any, torch.Tensor]:
        step = self.backend.prepare(plan, self.device)
        positions = torch.as_tensor(plan.positions, device=self.device)
        return plan, step, positions

    # -- target forward (prefill / decode / mixed) ----------------------------------------------
    def op_forward(self, msg: ForwardMessage) -> ForwardResult:
        self._register(msg)
        slots = msg.slots.tolist()
        rows = [self.states[s] for s in slots]
        samples = msg.samples.tolist()
        ids = []
        for st, a, n in zip(rows, msg.start.tolist(), msg.num_new.tolist()):
            ids.extend(st.tokens[a : a + n])
        plan, step, positions = self.plan(msg.plan)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        last = plan.qo_indptr[1:] - 1
        sample_rows = [i for i in range(len(slots)) if samples[i]]
        out = self.target(
            input_ids, step, self.kv, positions,
            logits_indices=torch.as_tensor(last[sample_rows], dtype=torch.int64, device=self.device),
            return_hidden=self.proposer.needs_hidden,
        )
        tokens = np.full(len(slots), -1, dtype=np.int64)
        if sample_rows:
            srows = [rows[i] for i in sample_rows]
            new = sample_logits(out.logits, self.sampling_tensors(srows)).tolist()
            for i, t in zip(sample_rows, new):
                rows[i].tokens.append(int(t))
                tokens[i] = t
        if self.proposer.needs_hidden:
            self.last_hidden = {"step": msg.step, "op": "forward", "hidden": out.hidden,
                                "qo_indptr": plan.qo_indptr, "slots": slots}
        return ForwardResult(tokens)

    # -- speculation ------------------------------------------------------------------------------
    def op_draft(self, msg: DraftMessage) -> DraftResult:
        return DraftResult(self.proposer.draft(msg))

    def op_verify(self, msg: VerifyMessage) -> VerifyResult:
        t0 = time.monotonic_ns()
        slots = msg.slots.tolist()
        rows = [self.states[s] for s in slots]
        plan, step, positions = self.plan(msg.plan)
        width = int(plan.qo_lens[0])
        ids = []
        num_drafts = []
        for st in rows:
            d = st.drafts[: width - 1]
            # a tree is scored by depth: position k = a node at depth k accepted
            num_drafts.append(min(len(d), self.spec.max_accept) if self.spec.is_tree else len(d))
            ids.append(st.tokens[-1])
            ids.extend(d)
            ids.extend([st.tokens[-1]] * (width - 1 - len(d)))
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        out = self.target(input_ids, step, self.kv, positions, return_hidden=self.proposer.needs_hidden)
        b = len(rows)
        logits = out.logits.view(b, width, -1)
        t1 = time.monotonic_ns()
        if self.spec.is_tree:
            emitted, accepted = self.proposer.accept_tree(rows, logits, plan, out.hidden)
        else:
            draft_t = torch.tensor([ids[i * width + 1 : (i + 1) * width] for i in range(b)],
                                   dtype=torch.int64, device=self.device).view(b, width - 1)
            nd = torch.tensor(num_drafts, dtype=torch.int64, device=self.device)
            all_greedy = all(st.greedy for st in rows)
            if self.acceptance == "threshold":
                probs = logits_to_probs(logits.reshape(b * width, -1), self.sampling_tensors(rows, width))
                res = threshold_verify(draft_t, nd, probs.view(b, width, -1), self.threshold,
                                       generators=[st.generator for st in rows])
            elif all_greedy:
                res = greedy_verify(draft_t, nd, logits)
            else:
                probs = logits_to_probs(logits.reshape(b * width, -1), self.sampling_tensors(rows, width))
                q = self.proposer.draft_probs(rows, width - 1)
                res = rejection_verify(draft_t, nd, q, probs.view(b, width, -1),
                                       [st.generator for st in rows])
            emitted = res.to_lists()
            accepted = res.num_accepted.tolist()
            if self.proposer.needs_hidden:
                self.last_hidden = {"step": msg.step, "op": "verify", "hidden": out.hidden,
                                    "qo_indptr": plan.qo_indptr, "slots": slots, "accepted": accepted,
                                    "emitted": emitted}
        for st, toks in zip(rows, emitted):
            st.tokens.extend(toks)
            st.drafts = []
            st.draft_q = None
        t2 = time.monotonic_ns()
        return VerifyResult(np.asarray(accepted, dtype=np.int64), emitted,
                            np.asarray(num_drafts, dtype=np.int64), (("verify", t0, t1), ("accept", t1, t2)))

    def op_fill(self, msg: FillMessage) -> FillResult:
        self.proposer.fill(msg)
        return FillResult()

    def op_agreement(self, msg: AgreementMessage) -> AgreementResult:
        """Per output position: does the proposer's greedy guess equal the emitted token?"""
        return AgreementResult(self.proposer.agreement(msg.prompt, msg.output))
