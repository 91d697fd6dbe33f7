"""The pipeline's output stage: each request gets its new token ids, cut at max_tokens and
EOS, and finishes when it is done.

Why a module of its own: the step logic (scheduler/pipeline.py) reads as the schedule it
implements; what happens to a step's emitted tokens -- whole-array counts and length
finishes, the requests' consumers handed their tokens (they detokenize and apply stop
strings, finishing a request through `Pipeline.stop_request`), aborts and stops that arrived
meanwhile -- is this mixin's. It works on the pipeline's state: its slot table, sink, EOS
ids, pending aborts, `_finish` and `_finish_many`.
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler.request import Request
from specsched.scheduler.small_arrays import SMALL_BATCH
from specsched.scheduler.step_batch import StepBatch



class OutputStage:
    def _output(self, batch: StepBatch, rows: np.ndarray, tokens, lens: np.ndarray | None = None) -> list[int]:
        """The output stage: rows[j] of the batch gets tokens[j] (its first lens[j] when
        given), cut at max_tokens and EOS; returns [B] tokens kept per row. `tokens`: a list
        per row, or a [len(rows), W] array. Counts and finishes by length are whole-array; what
        is left per row is handing the request its tokens. Rows with an abort or a stop
        pending, or an EOS among their tokens, take `_emit` one by one."""
        out = [0] * len(batch)
        if not rows.size:
            return out
        small = rows.size <= SMALL_BATCH  # a handful of rows: the array calls would cost more
        if not small and not self.keep_ids and not self.eos and not self._aborts:
            return self._output_counts(batch, rows, lens if lens is not None else
                                       np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)))
        if isinstance(tokens, np.ndarray):
            tokens = tokens.tolist()
        t, reqs = self.table, batch.requests
        if lens is not None:
            tokens = [tk[:n] for tk, n in zip(tokens, lens.tolist())]
        if small:
            for i, tk in zip(rows.tolist(), tokens):
                out[i] = self._emit(reqs[i], tk)
            return out
        slots = batch.slots[rows]
        live = t.gen[slots] == batch.gen[rows]  # a finished row keeps nothing
        lens = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
        room = t.max_tokens[slots] - t.num_output[slots]
        keep = np.where(live, np.minimum(lens, room), 0)
        index = rows.tolist()
        one_by_one = np.zeros(len(index), dtype=bool)
        if self._aborts:
            one_by_one |= np.fromiter((reqs[i].request_id in self._aborts for i in index), dtype=bool,
                                      count=len(index))
        if self.eos:
            eos = self.eos
            one_by_one |= np.fromiter((not eos.isdisjoint(tk) and not reqs[i].params.ignore_eos
                                       for i, tk in zip(index, tokens)), dtype=bool, count=len(index))
        bulk = (keep > 0) & ~one_by_one
        now = self._now()
        sink = self.sink.on_tokens
        keep_l = keep.tolist()
        for j in bulk.nonzero()[0].tolist():
            r, tk, k = reqs[index[j]], tokens[j], keep_l[j]
            if k < len(tk):
                tk = tk[:k]
            r.output_token_ids.extend(tk)
            if r.first_token_ns is None:
                r.first_token_ns = now
            sink(r, tk)
            out[index[j]] = k
        t.num_output[slots[bulk]] += keep[bulk]
        self._finish_many([reqs[index[j]] for j in (bulk & (keep >= room)).nonzero()[0].tolist()], "length")
        for j in (one_by_one & live).nonzero()[0].tolist():
            out[index[j]] = self._emit(reqs[index[j]], tokens[j])
        return out

    def _output_counts(self, batch: StepBatch, rows: np.ndarray, lens: np.ndarray) -> list[int]:
        """`_output` for a sink that wants no token ids, with no EOS, abort or stop to
        apply: counts, first-token times and finishes by length, whole-array but for the rows
        that get their first token or finish."""
        t, reqs = self.table, batch.requests
        slots = batch.slots[rows]
        have = t.num_output[slots]
        room = t.max_tokens[slots] - have
        keep = np.where(t.gen[slots] == batch.gen[rows], np.minimum(lens, room), 0)  # a finished row keeps nothing
        got = keep > 0
        firsts = (got & (have == 0)).nonzero()[0]
        if firsts.size:
            now = self._now()
            for i in rows[firsts].tolist():
                reqs[i].first_token_ns = now
        t.num_output[slots] += keep  # distinct slots; rows that keep nothing add 0
        if rows.size == len(batch):  # every row (rows in order)
            out = keep
        else:
            out = np.zeros(len(batch), dtype=np.int64)
            out[rows] = keep
        self._finish_many([reqs[i] for i in rows[(got & (keep >= room)).nonzero()[0]].tolist()], "length")
        return out.tolist()

    def _emit(self, req: Request, tokens: list[int]) -> int:
        """Append new tokens, applying max_tokens and EOS; the sink gets the tokens kept
        (the request's consumer detokenizes them and applies stop strings)."""
        if req.is_finished:
            return 0
        if req.abort_requested:
            self._finish(req, "abort")
            return 0
        if req.stop_at is not None:
            self._finish_stopped(req)
            return 0
        params = req.params
        room = params.max_tokens - req.num_output_tokens
        if len(tokens) > room:
            tokens = tokens[:room]
        reason = None
        eos = self.eos
        if eos and not params.ignore_eos and not eos.isdisjoint(tokens):
            for j, tok in enumerate(tokens):
                if tok in eos:
                    tokens = tokens[: j + 1]
                    reason = "stop"
                    break
        if not tokens:
            return 0
        if req.first_token_ns is None:
            req.first_token_ns = self._now()
        if self.keep_ids:
            req.extend_output(tokens)
            self.sink.on_tokens(req, tokens)
        else:
            req.num_output = req.num_output + len(tokens)
        if reason is None and req.num_output_tokens >= params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(req, reason)
        return len(tokens)


    def _finish_stopped(self, req: Request) -> None:
        """A stop string the consumer found: the output ends after `stop_at` tokens."""
        if req.stop_at < req.num_output_tokens:
            del req.output_token_ids[req.stop_at:]
            req.extend_output([])
        self._finish(req, "stop")
