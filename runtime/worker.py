"""ModelWorker: executes the pipeline's ops inside the device (worker process or CUDA).

Why: the device, not the host, owns weights, KV caches and per-request token state (a `TokenBuffer`
on the device; a step's drafts follow each row's last token there). The host's messages say which
positions to compute; the tokens the device itself produced (samples, accepted drafts, bonus tokens)
never need a round trip before the next launch, and no op reads a device value on the host: what the
host needs back is copied into host-side buffers, read after the op's event. That is what lets the
`overlap` and `eager_fill` schedules keep the host off the critical path (`sync_guard=True` fails an op
that does read the device; see runtime/sync_guard.py).

Ops (scheduler/messages.py defines their typed messages and results):
  forward  target forward of prefill chunks / decodes, sampling rows that reach their end
  draft    the proposer's D tokens for each row, in one launch
  verify   target over [last token, candidates]; acceptance; emits accepted + 1 tokens
  fill     the proposer's KV fill (and the logits carried into the next step's draft)
  agreement  teacher-forced per-position agreement of the proposer with given outputs
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict, is_dataclass, replace
from typing import Any

import numpy as np
import torch

from specsched.runtime.attention import resolve_backend
from specsched.runtime.dummy import load
from specsched.runtime.layers import kernel_notes, pack_linears, use_cpu_kernels
from specsched.runtime.proposers.factory import make_proposer
from specsched.runtime.logprobs import forward_logprobs, prompt_logprobs, prompt_spans, verify_logprobs
from specsched.runtime.logits_processors import process_logits, window_paths
from specsched.runtime.sampling import SamplingTensors, make_generator, sample_logits
from specsched.runtime.verify import SyntheticDraws, accept_chain, as_grid
from specsched.runtime.worker_config import WorkerConfig
from specsched.scheduler.messages import (AgreementMessage, AgreementResult, DraftMessage, DraftResult, FillMessage, FillResult, ForwardMessage,
                                          ForwardResult, VerifyMessage, VerifyResult)
from specsched.runtime.sync_guard import guarded, host_side, to_device
from specsched.runtime.grammars import Grammars
from specsched.runtime.structured_output import Guide, advance_guides
from specsched.runtime.token_state import SeqState, TokenBuffer
from specsched.runtime.tokenizer import Tokenizer
from specsched.runtime.padding import Padding
from specsched.scheduler.plan import AttentionPlan
from specsched.scheduler.proposer import ProposerSpec
from specsched.scheduler.step_trace import device_span_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _as_numpy(result: Any) -> dict[str, Any]:
    """The result's tensor fields (its log-probabilities' too) as numpy arrays, by field name (for
    `dataclasses.replace`)."""
    out = {}
    for f in getattr(result, "__dataclass_fields__", ()):
        v = getattr(result, f)
        if isinstance(v, torch.Tensor):
            out[f] = v.numpy()
        elif is_dataclass(v):
            out[f] = replace(v, **_as_numpy(v))
    return out


class ModelWorker:
    def __init__(self, config: WorkerConfig | str, proposer: ProposerSpec | dict | None = None, **settings: Any):
        """`config`: the worker's configuration (the engine's: `WorkerConfig.from_engine`); or
        a target checkpoint dir, with the proposer and WorkerConfig's other fields as keywords
        (`WorkerConfig.of`: tests and tools build workers in-process this way)."""
        if not isinstance(config, WorkerConfig):
            if proposer is None:
                raise TypeError("ModelWorker needs a WorkerConfig, or a model dir and a proposer")
            config = WorkerConfig.of(config, proposer, **settings)
        elif proposer is not None or settings:
            raise TypeError("ModelWorker takes a WorkerConfig alone (its fields are set there)")
        self.config = c = config
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        torch.set_grad_enabled(False)
        self.device = torch.device(c.device)
        self.dtype = _DTYPES[c.dtype]
        self.page_size = c.page_size
        # tensor parallelism: this worker is rank 0 of the group; the sharded modules' calls
        # run on every rank (runtime/tp/ranks.py), everything else only here
        self.tp_leader = None
        if c.tensor_parallel_size > 1:
            from specsched.runtime.tp.ranks import Leader

            head_dir = c.proposer_dir if c.proposer.rules.checkpoint == "mtp_head" else None
            self.tp_leader = Leader(c.tensor_parallel_size, model_dir=c.model_dir, head_dir=head_dir, dtype=c.dtype,
                                    device=c.device, attention=c.attention, num_pages=c.num_pages,
                                    page_size=c.page_size, num_threads=c.num_threads or 1, channel=c.tp_channel,
                                    load_format=c.load_format, linear=c.linear, ops=c.ops)
        try:  # a failed start stops the ranks it started
            tp = self.tp_leader.tp if self.tp_leader is not None else None
            self.load_format = c.load_format
            self.target = load(c.model_dir, c.load_format, self.dtype, self.device, tp)
            self.attention, self.attention_note = resolve_backend(c.attention, self.device, self.dtype,
                                                                  self.target.config.head_dim)
            self.backend = self.target.attention_backend(self.attention)
            self.kv = self.target.make_kv_cache(c.num_pages, c.page_size, backend=self.backend)
            self.spec = c.proposer
            # uniform steps padded to capture sizes, pad rows on every cache's scratch page
            self.padding = Padding(c.cuda_graph_sizes, self.kv.scratch_page, c.page_size,
                                   1 + max(1, self.spec.num_candidates)) if c.cuda_graph_sizes else None
            # on CUDA the padded steps replay CUDA graphs (FlashInfer attention); on a CPU they run eagerly
            self.graphs = None
            if self.padding is not None and self.device.type == "cuda":
                from specsched.runtime.cuda_graphs import CudaGraphs

                self.graphs = CudaGraphs(self.backend, self.device, c.num_pages + self.padding.sizes[-1], c.page_size)
            self.acceptance = c.acceptance
            self.threshold = c.threshold
            if c.acceptance == "synthetic" and c.synthetic is None:
                raise ValueError("acceptance 'synthetic' needs its definition (WorkerConfig.synthetic)")
            self.synthetic = SyntheticDraws(c.synthetic, self.device, c.seed) if c.synthetic is not None else None
            self.states: dict[int, SeqState] = {}
            self.model_dir, self._grammars = c.model_dir, None
            self.scoring: set[int] = set()  # slots whose state is `scored`: a step with none reads no further
            # request tokens live on the device, indexed by slot; a step's drafts sit right after
            # each row's last token, where the verify reads them with it in one gather
            self.draft_width = max(1, self.spec.num_candidates)
            # a tree verify's columns: the last token (depth 0), then each node at its depth
            self.column_depths = (np.concatenate([[0], self.spec.tree_depths()]) if self.spec.is_tree
                                  else np.arange(1 + self.draft_width))
            # which of a verify's columns come before each on its path (the drafts a penalty counts)
            self.window_paths = window_paths(len(self.column_depths), self.spec.tree_parents)
            # (room past the last position for a verify's window: its emitted columns, its drafts)
            self.tokens = TokenBuffer((c.max_model_len or self.target.config.max_position_embeddings) + 1
                                      + self.draft_width, self.device)
            self.ngram = c.ngram  # n-gram lookup lengths (the host drafts with them: `host_drafter`)
            self.proposer = make_proposer(self, self.spec, c.proposer_dir, c.num_pages, c.ngram)
            # float32 CPU linears also keep their weights packed for a faster kernel, and decoder layers
            # run their small ops in C (runtime/layers.py)
            models = (self.target, *self.proposer.models())
            self.kernel_notes = kernel_notes(pack_linears(*models) if c.linear == "auto" else 0,
                                             use_cpu_kernels(*models) if c.ops == "auto" else 0, *models)
            self.last_hidden: dict | None = None  # target hidden states of the latest target launch
            self.last_verify: tuple | None = None  # (step, slots, accepted [B] on the device) of the latest verify
            # ops enqueue device work only; with the guard a host read of a device value fails the op
            self.sync_guard = c.sync_guard
            # a verify's rows as this many target forwards back to back (on a tensor-parallel
            # target one half's compute would overlap the other's communication)
            self.verify_micro_batches = c.verify_micro_batches
            if self.tp_leader is not None:  # the sharded modules, as every rank must run them
                self.target = self.tp_leader.wrap(self.target, "target")
                self.kv = self.tp_leader.wrap_kv(self.kv, "target")
                head = getattr(self.proposer, "head", None)
                if head is not None:
                    self.proposer.head = self.tp_leader.wrap(head, "head")
                self.tp_leader.started()
            if self.graphs is not None:
                self._capture_target()
        except BaseException:
            self.close()
            raise

    def _capture_target(self) -> None:
        """The target's decode and verify graphs at every capture size (and both wrapper sets),
        captured over steps of pad rows alone before any request runs; other shapes (a
        proposer's, a shorter verify) are captured at their first step."""
        from specsched.runtime.cuda_graphs import SLOTS

        widths = sorted({q for q in (1, 1 + self.spec.num_candidates) if q <= self.page_size})
        hid = dict(return_hidden=self.proposer.needs_hidden, aux_layers=self.proposer.aux_layers)
        none = torch.zeros(0, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            for rows in self.padding.sizes:
                for q in widths:
                    plan = self.padding.scratch_plan(rows, q, tree=q > 1 and self.spec.is_tree)
                    for _ in range(SLOTS):
                        _, step, positions = self.plan(plan)
                        ids = torch.zeros(rows * q, dtype=torch.int64, device=self.device)
                        self.target(ids, step, self.kv, positions, logits_indices=none, **hid)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (the worker process calls this as it exits)."""
        if self.tp_leader is not None:
            self.tp_leader.close()

    # -- dispatch -------------------------------------------------------------------------------
    def execute(self, op: str, batch: Any) -> Any:
        """Run one op on its typed message (scheduler/messages.py); `ping` takes anything."""
        for slot in getattr(batch, "release", ()):
            self.states.pop(slot, None)
            self.scoring.discard(slot)
            self.proposer.release(slot)
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise ValueError(f"unknown op {op!r}")
        tp = self.tp_leader
        if tp is not None:  # the followers' intervals are named after the op that made the call
            shape = getattr(batch, "shape", None)
            tp.current = (device_span_name(op, shape.attrs()) if shape is not None else op, getattr(batch, "step", None))
            comm0 = (tp.stats.broadcast_ns, tp.stats.all_reduce_ns)
        guard = self.sync_guard and hasattr(batch, "shape")  # the pipeline's ops are guarded
        with torch.inference_mode(), (guarded(self.device, f"op {op}") if guard else nullcontext()):
            result = fn(batch)
        # The result goes back as a new (frozen) result with its final values, in one replace:
        # on a tensor-parallel device with the other ranks' intervals and the op's communication
        # time; on the CPU, where an op has finished when it returns, with its host-side tensors
        # as numpy arrays (the engine's process needs no torch to read them). On CUDA they are
        # read after the op's event, by whoever waits on it.
        final = {}
        if tp is not None and hasattr(result, "ranks"):
            final["ranks"] = tp.collect()
            final["comm"] = (tp.stats.broadcast_ns - comm0[0], tp.stats.all_reduce_ns - comm0[1])
        if self.device.type == "cpu":
            final.update(_as_numpy(result))
        return replace(result, **final) if final else result

    def op_ping(self, batch: dict) -> dict:
        graphs = self.graphs
        return {"ok": True, "num_states": len(self.states), "cuda_graphs": 0 if graphs is None else graphs.num_graphs,
                "capture_s": 0.0 if graphs is None else graphs.capture_ns / 1e9,
                "linears": self.kernel_notes[0], "attention": self.attention_note, "ops": self.kernel_notes[1]}

    def op_tp_stats(self, batch: Any) -> dict:
        """Tensor parallelism's communication so far: the size, and the leader's broadcasts
        (count, bytes, ns) and all-reduces (count, ns)."""
        if self.tp_leader is None:
            return {"size": 1}
        return {"size": self.tp_leader.size, **asdict(self.tp_leader.stats)}

    def _register(self, msg: ForwardMessage) -> None:
        for r in msg.register:
            st = self.states[r.slot] = SeqState.registered(r, make_generator(r.seed, self.device))
            if r.grammar is not None:  # a walk that can step back over a verify's window
                if r.grammar_index is not None:  # compiled by the engine: no compile inside this step
                    self.grammars().adopt(r.grammar, r.grammar_index)
                st.guide = self.grammars().walk(r.grammar, 1 + self.draft_width, Guide)
                st.guide.advance(r.token_ids[r.prompt_len:])  # its output so far, after a preemption
            (self.scoring.add if st.scored else self.scoring.discard)(r.slot)
            self.tokens.register(r.slot, list(r.token_ids))
            self.proposer.register(r.slot, r.token_ids)

    def grammars(self) -> Grammars:
        """The target tokenizer's grammar compiler, made at the first structured request."""
        if self._grammars is None:
            self._grammars = Grammars(Tokenizer(self.model_dir))
        return self._grammars

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A result's copy on the host, read once the op's completion event is done: a
        non-blocking copy into pinned memory on CUDA, a copy on the CPU."""
        if self.device.type == "cuda":
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            return host_side(h)
        return host_side(t)  # already in host memory; the op made it and writes it no more

    def set_drafts(self, slots: list[int], starts: np.ndarray, drafts: torch.Tensor, counts: list[int]) -> None:
        """This step's drafts [B, draft_width] (columns past a row's count: any valid token) go
        right after each row's last token (at starts[i]); their counts are kept on the host."""
        if slots and drafts.shape[1]:
            self.tokens.write_after(slots, starts, drafts)
        for s, n in zip(slots, counts):
            self.states[s].draft_len = n

    def sampling_tensors(self, rows: list[SeqState], repeat: int = 1) -> SamplingTensors:
        """The rows' sampling parameters on this device, each row repeated `repeat` times."""
        rows = [s for s in rows for _ in range(repeat)]
        return SamplingTensors.from_params(rows, [s.generator for s in rows], self.device)

    def plan(self, plan: AttentionPlan) -> tuple[AttentionPlan, Any, torch.Tensor]:
        """(plan, its prepared attention, its positions on the device). With padding, a uniform
        step's attention and positions are the padded step's (the models pad their inputs to
        the positions and cut their outputs back to the plan's tokens)."""
        run = self.padding.pad(plan) if self.padding is not None else None
        if run is None:
            return plan, self.backend.prepare(plan, self.device), to_device(plan.positions, self.device)
        step = self.graphs.prepare(run) if self.graphs is not None else self.backend.prepare(run, self.device)
        return plan, step, to_device(run.positions, self.device)

    # -- target forward (prefill / decode / mixed) ----------------------------------------------
    def op_forward(self, msg: ForwardMessage) -> ForwardResult:
        self._register(msg)
        slots = msg.slots.tolist()
        ends = msg.start + msg.num_new
        input_ids = self.tokens.ranges(msg.slots, msg.start, ends)
        plan, step, positions = self.plan(msg.plan)
        last = plan.qo_indptr[1:] - 1
        sample_rows = np.flatnonzero(msg.samples)
        rows = [self.states[s] for s in slots] if self.scoring else []
        spans = prompt_spans(rows, msg.start, ends)
        at = last[sample_rows]
        if spans:  # the positions scoring prompt tokens too, after the sampling rows'
            at = np.concatenate([at, *(plan.qo_indptr[i] + np.arange(n) for i, _, n in spans)])
        out = self.target(
            input_ids, step, self.kv, positions, logits_indices=to_device(at, self.device, torch.int64),
            return_hidden=self.proposer.needs_hidden, aux_layers=self.proposer.aux_layers,
        )
        logits = out.logits[: sample_rows.size] if spans else out.logits
        scored, prompt_lps = (prompt_logprobs(rows, msg.slots, spans, out.logits[sample_rows.size:], self.tokens,
                                               self.to_host) if spans else ((), None))
        logprobs = None
        if sample_rows.size:
            srows = [self.states[slots[i]] for i in sample_rows.tolist()]
            held = (process_logits(logits.unsqueeze(1), srows, self.tokens, msg.slots[sample_rows], ends[sample_rows],
                                   np.zeros(1)).squeeze(1) if rows else logits)
            new = sample_logits(held, self.sampling_tensors(srows)).to(torch.int64)
            advance_guides(srows, new.unsqueeze(-1), None)
            self.tokens.write(msg.slots[sample_rows], ends[sample_rows], new)  # each row's next token
            if sample_rows.size == len(slots):
                tokens = new
            else:
                tokens = torch.full((len(slots),), -1, dtype=torch.int64, device=self.device)
                tokens[to_device(sample_rows, self.device)] = new
            if rows:
                logprobs = forward_logprobs(srows, sample_rows, logits, tokens, self.to_host)
        else:
            tokens = torch.full((len(slots),), -1, dtype=torch.int64, device=self.device)
        if self.proposer.needs_hidden:
            self.last_hidden = {"step": msg.step, "op": "forward", "hidden": out.hidden,
                                "qo_indptr": plan.qo_indptr, "slots": slots}
            if msg.keep_hidden:  # the head's fill of these rows waits: it reads them later
                self.proposer.keep_hidden(msg.slots, msg.start, plan.qo_indptr, out.hidden)
        host = self.to_host(tokens)
        self.proposer.emitted(slots, host, None)
        return ForwardResult(host, logprobs, scored, prompt_lps)

    # -- speculation ------------------------------------------------------------------------------
    def op_draft(self, msg: DraftMessage) -> DraftResult:
        return DraftResult(self.proposer.draft(msg))

    def op_verify(self, msg: VerifyMessage) -> VerifyResult:
        t0 = time.monotonic_ns()
        slots = msg.slots.tolist()
        rows = [self.states[s] for s in slots]
        if msg.drafts is not None:  # drafted on the host (a lookup): after each row's last token
            self.set_drafts(slots, msg.start, to_device(msg.drafts, self.device, torch.int64), msg.draft_lens.tolist())
        plan, step, positions = self.plan(msg.plan)
        qo = plan.qo_lens
        width = int(qo.max())
        counts = [min(st.draft_len, int(w) - 1) for st, w in zip(rows, qo.tolist())]
        # a tree is scored by depth: position k = a node at depth k accepted
        draft_lens = [min(n, self.spec.max_accept) for n in counts] if self.spec.is_tree else counts
        b = len(rows)
        # each row's last token and its drafts, side by side in the token buffer; a row verifies
        # the drafts it was planned for (where it drafted fewer, other valid tokens: never
        # accepted, their KV overwritten)
        input_ids = self.tokens.ranges(msg.slots, msg.start, msg.start + qo)
        logits, hidden = self._verify_forward(plan, step, positions, input_ids, b, width)
        grid, logits = as_grid(plan.qo_indptr, input_ids, logits)
        last, draft_t = grid[:, 0], grid[:, 1:]
        raw = logits  # the log-probabilities' (before min_tokens, a logit bias or a penalty changes them)
        if self.scoring:  # column c emits the token at position start + 1 + its depth
            logits = process_logits(logits, rows, self.tokens, msg.slots, msg.start + 1, self.column_depths, grid,
                                    self.window_paths)
        t1 = time.monotonic_ns()
        if self.spec.is_tree:
            res = self.proposer.accept_tree(msg, rows, draft_t, last, logits, plan, hidden)
        else:
            res = accept_chain(self, msg, rows, draft_t, logits, draft_lens)
            if self.proposer.needs_hidden:
                self.last_hidden = {"step": msg.step, "op": "verify", "hidden": hidden,
                                    "qo_indptr": plan.qo_indptr, "slots": slots}
        self.last_verify = (msg.step, msg.slots, res.num_accepted)  # a window fill reads it (on the device)
        # the emitted tokens (accepted, then the recovered or bonus one) follow the last token;
        # columns past a row's count (-1 in the result) land beyond its end as token 0: a verify
        # of uniform width (padded steps) reads them as inputs whose outputs are never accepted
        emitted = res.output_tokens
        advance_guides(rows, emitted, res.num_accepted)
        self.tokens.write_after(msg.slots, msg.start, emitted.clamp(min=0))
        for st in rows:
            st.draft_len = 0
            st.draft_q = None
        logprobs = (verify_logprobs(rows, raw, emitted, res.accepted_nodes if self.spec.is_tree else None,
                                    self.to_host) if self.scoring else None)
        accepted, tokens = self.to_host(res.num_accepted), self.to_host(emitted)
        self.proposer.emitted(slots, tokens, accepted)
        t2 = time.monotonic_ns()
        return VerifyResult(accepted, tokens, np.asarray(draft_lens, dtype=np.int64), logprobs,
                            substages=(("verify", t0, t1), ("accept", t1, t2)))

    def _verify_forward(self, plan: AttentionPlan, step: Any, positions: torch.Tensor, input_ids: torch.Tensor,
                        b: int, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over a verify's rows: (logits [B*W, V], hidden or None), in one forward or
        in `verify_micro_batches` forwards over consecutive rows."""
        need_hidden = self.proposer.needs_hidden
        hid = dict(return_hidden=need_hidden, aux_layers=self.proposer.aux_layers)
        parts = min(self.verify_micro_batches, b)
        if parts <= 1:
            out = self.target(input_ids, step, self.kv, positions, **hid)
            return out.logits, out.hidden
        logits, hidden = [], []
        indptr = plan.qo_indptr
        for rows in np.array_split(np.arange(b), parts):
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            sub = plan.rows(lo, hi)
            a, z = int(indptr[lo]), int(indptr[hi])
            _, sub_step, sub_positions = self.plan(sub)
            out = self.target(input_ids[a:z], sub_step, self.kv, sub_positions, **hid)
            logits.append(out.logits)
            hidden.append(out.hidden)
        return torch.cat(logits), (torch.cat(hidden) if need_hidden else None)

    def op_fill(self, msg: FillMessage) -> FillResult:
        self.proposer.fill(msg)
        return FillResult()

    def op_agreement(self, msg: AgreementMessage) -> AgreementResult:
        """Per output position: does the proposer's greedy guess equal the emitted token?"""
        return AgreementResult(self.proposer.agreement(msg.prompt, msg.output))

