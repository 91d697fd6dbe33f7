"""Acceptance in the simulator: replayed from the trace, never derived from a formula.

Modes:
  trace      at the captured proposer and draft length, every request (greedy or sampled,
             any proposer, trees included) replays the accepted length its step records
             show at that output position: exact, since drafts at a position depend only
             on the sequence so far, never on the schedule. At another draft length,
             greedy requests with per-position agreement data (`finish.agreement`): the
             accepted length of a step that starts at output position p with D drafts is
             the run of 1s in agreement[p : p + D] -- exact for a draft model at any D up to
             the captured maximum (teacher-forced agreement), exact for D = 1 with heads
             (first-token agreement). Requests without agreement data (sampled, or heads at
             D > 1) fall back to the trace's per-position acceptance rates -- or, in a trace
             captured with synthetic acceptance, to draws from its definition (each
             request's own where it had one).
  rates      per-position conditional acceptance rates measured from the trace's steps, and
             the share of rows the proposer drafted nothing for (n-gram misses).
  bernoulli  every draft position accepted independently with probability alpha.
  synthetic  vLLM's synthetic acceptance (scheduler/synthetic.py, the engine's definition):
             `synthetic:AL` (the minimum-variance rates for that acceptance length),
             `synthetic:r1,r2,...` (per-position unconditional rates), `synthetic:independent:...`
             (each position drawn on its own), or bare `synthetic`: what the trace's engine
             forced; a request recorded with its own (`RequestRecord.synthetic_acceptance_*`)
             keeps it, as in the engine. A step's rows drawn whole-array.

`A>B@N` (e.g. `trace>bernoulli:0.9@8`) is a change of workload: the first N requests in arrival
order take acceptance A, the rest B (`SwitchedAcceptance`) -- what an adaptive draft length
must notice and follow.
"""
from __future__ import annotations

import itertools

import numpy as np

from specsched.scheduler.small_arrays import SMALL_BATCH  # `outcomes` looks up to this many rows one by one
from specsched.scheduler.synthetic import SyntheticAcceptance, request_key


class AcceptanceModel:
    def __init__(self, mode: str, *, agreement: dict[int, list[int]] | None = None,
                 rates: list[float] | None = None, alpha: float | None = None,
                 exact_max_d: int | None = None, seed: int = 0,
                 recorded: dict[int, dict[int, tuple[int, int]]] | None = None,
                 draft_rate: float = 1.0, synthetic: SyntheticAcceptance | None = None,
                 own: dict[int, SyntheticAcceptance] | None = None,
                 requests: tuple[np.ndarray, np.ndarray] | None = None):
        if mode not in ("trace", "rates", "bernoulli", "synthetic"):
            raise ValueError(f"unknown acceptance mode {mode!r}")
        if mode == "bernoulli" and not (alpha is not None and 0.0 <= alpha <= 1.0):
            raise ValueError("bernoulli acceptance needs 0 <= alpha <= 1")
        if mode == "synthetic" and synthetic is None:
            raise ValueError("synthetic acceptance needs its definition (SyntheticAcceptance)")
        # in `trace` mode: the definition a synthetic trace was captured with, for the rows its
        # records do not decide
        self.mode = mode
        self.synthetic = synthetic
        self.own = own or {}  # request index -> its own synthetic acceptance
        # request index -> (its synthetic draws' key, its prompt length): the engine's draw of a
        # row is keyed by its request and its last token's position (scheduler/synthetic.py)
        self.requests = requests
        self.agreement = agreement or {}
        self.rates = list(rates or [])
        self.alpha = alpha
        self.exact_max_d = exact_max_d
        self.recorded = recorded or {}  # request index -> {output position: (accepted, drafted)}
        self.draft_rate = draft_rate  # share of speculative rows that drafted anything
        self._seed = seed
        self._rng: np.random.Generator | None = None  # made on first draw: most replays draw nothing
        self._tables: tuple[np.ndarray, ...] | None = None  # `outcomes`' lookups, built on first use

    @classmethod
    def parse(cls, spec: str, trace, seed: int = 0, captured_config: bool = False,
              any_length: bool = False, max_accept: int | None = None) -> "AcceptanceModel":
        """'trace' | 'rates' | 'bernoulli:ALPHA' | 'synthetic:...' against a trace's data; a
        synthetic acceptance length is checked against `max_accept` (the most drafts a row may
        have accepted). `captured_config`:
        the replay drafts with the trace's own proposer and draft length. `any_length`: the
        draft length varies by step (an adaptive one, in the capture or the replay), so a
        recorded outcome replays a step that drafts another count only where it still
        decides it (see `_recorded_holds`)."""
        if ">" in spec:
            first, _, rest = spec.partition(">")
            second, _, at = rest.rpartition("@")
            try:
                n = int(at)
            except ValueError:
                n = -1
            if not first or not second or n < 0:
                raise ValueError(f"bad acceptance {spec!r}: a change of workload is A>B@N (N >= 0 requests "
                                 "with A, then B), e.g. trace>bernoulli:0.9@8")
            return SwitchedAcceptance(cls.parse(first, trace, seed, captured_config, any_length, max_accept),
                                      cls.parse(second, trace, seed + 1, captured_config, any_length, max_accept), n)
        if spec == "synthetic" or spec.startswith("synthetic:"):
            synthetic = recorded_synthetic(trace) if spec == "synthetic" else \
                SyntheticAcceptance.parse(spec.split(":", 1)[1])
            own = _own_synthetic(trace, synthetic.independent)
            if max_accept is not None:  # an acceptance length the draft length cannot reach is refused
                for a in (synthetic, *own.values()):
                    a.check(max_accept)
            return cls("synthetic", synthetic=synthetic, seed=_engine_seed(trace) + seed, own=own,
                       requests=_request_table(trace))
        if spec.startswith("bernoulli:"):
            try:
                alpha = float(spec.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"bad acceptance {spec!r}: use bernoulli:ALPHA") from None
            return cls("bernoulli", alpha=alpha, seed=seed)
        if spec not in ("trace", "rates"):
            raise ValueError(f"bad acceptance {spec!r}: use trace, rates, bernoulli:ALPHA, synthetic (the "
                             "trace's) or synthetic:AL (or synthetic:r1,r2,...)")
        agreement = {}
        exact = None
        if spec == "trace":
            idx = {r.request_id: i for i, r in enumerate(sorted(trace.requests, key=lambda r: r.arrival_ns))}
            for f in trace.finishes:
                if f.agreement is not None and f.request_id in idx:
                    agreement[idx[f.request_id]] = list(f.agreement)
                    if f.agreement_kind == "first_token":
                        exact = 1
        recorded = recorded_acceptance(trace) if (spec == "trace" and captured_config) else None
        forced, own = synthetic_of(trace) if spec == "trace" else (None, None)
        model = cls(spec, agreement=agreement, rates=step_rates(trace), exact_max_d=exact,
                    seed=seed + (_engine_seed(trace) if forced is not None else 0), recorded=recorded,
                    draft_rate=draft_rate(trace), synthetic=forced, own=own,
                    requests=_request_table(trace) if forced is not None else None)
        model.any_length = any_length
        return model

    any_length = False

    @property
    def rng(self) -> np.random.Generator:
        """The model's random draws (rates, Bernoulli, n-gram misses), seeded by `seed`."""
        if self._rng is None:
            self._rng = np.random.default_rng(self._seed)
        return self._rng

    def _recorded_holds(self, rec_acc, rec_drafted, draft_len):
        """Whether a recorded (accepted, drafted) decides a row drafting `draft_len` now: at
        a fixed draft length always (as captured); with varying lengths when the row drafts no
        more than was recorded, or the recorded drafts met a rejection (acceptance stops at
        the first one, whatever follows)."""
        if not self.any_length:
            return True
        return (draft_len <= rec_drafted) | (rec_acc < rec_drafted)

    def outcome(self, request_index: int, out_pos: int, draft_len: int) -> tuple[int, int]:
        """(accepted, drafted) for a row that may draft `draft_len` tokens at this output
        position. Drafted is less where the proposer drafts nothing (an n-gram miss): as
        recorded at the captured configuration, else at the trace's rate of such rows."""
        accepted, drafted = self.outcomes(np.array([request_index]), np.array([out_pos]), np.array([draft_len]))
        return int(accepted[0]), int(drafted[0])

    def _known(self, request_index: int, out_pos: int, draft_len: int) -> tuple[int, int] | None:
        """A row's outcome from the trace's data (its recorded step, else its agreement run),
        None where the trace does not decide it."""
        rec = self.recorded.get(request_index, {}).get(out_pos)
        if rec is not None and self._recorded_holds(rec[0], rec[1], draft_len):
            return min(rec[0], draft_len), min(rec[1], draft_len)
        agree = self.agreement.get(request_index)
        if agree is not None and (self.exact_max_d is None or draft_len <= self.exact_max_d):
            a = 0
            while a < draft_len and out_pos + a < len(agree) and agree[out_pos + a]:
                a += 1
            return a, draft_len
        return None

    def _synthetic(self, index: np.ndarray, out_pos: np.ndarray, draft_len: np.ndarray) -> np.ndarray:
        """Accepted drafts of rows under the synthetic acceptance, keyed as the engine's: by the
        request (the trace's id) and its last token's position (without a trace: the index and
        the output position)."""
        index = np.asarray(index, dtype=np.int64)
        out_pos = np.asarray(out_pos, dtype=np.int64)
        own = [self.own.get(i) for i in index.tolist()] if self.own else None
        if self.requests is not None and index.size and int(index.max()) < self.requests[0].shape[0]:
            keys, prompts = self.requests
            return self.synthetic.draw(draft_len, keys[index], prompts[index] + out_pos - 1, self._seed, own)
        return self.synthetic.draw(draft_len, index, out_pos, self._seed, own)

    def _drawn(self, index: np.ndarray, out_pos: np.ndarray, draft_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(accepted, drafted) of rows the trace does not decide, drawn whole-array: first
        whether each drafts at all (the trace's share of rows that drafted something), then
        each position accepted with its conditional rate (Bernoulli: alpha) until one fails.
        A trace captured with synthetic acceptance draws from its definition instead."""
        if self.synthetic is not None:
            return self._synthetic(index, out_pos, draft_len), draft_len
        n, width = draft_len.shape[0], int(draft_len.max(initial=0))
        drafted = draft_len.copy()
        if self.draft_rate < 1.0:
            drafted[self.rng.random(n) >= self.draft_rate] = 0  # drafts nothing, as that share of the trace's rows
        if self.mode == "bernoulli":
            p = np.full(width, self.alpha)
        else:
            p = np.array([self.rates[k] if k < len(self.rates) else (self.rates[-1] if self.rates else 0.0)
                          for k in range(width)])
        ok = self.rng.random((n, width)) < p[None, :]
        return np.minimum(np.cumprod(ok, axis=1).sum(axis=1), drafted), drafted

    def outcomes(self, index: np.ndarray, out_pos: np.ndarray, draft_len: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(accepted, drafted) of a verify's rows at once ([B] each). Rows the trace decides
        (`trace` mode: recorded steps, agreement runs) are looked up, whole-array past a few
        rows; the others are drawn for all of them at once (`_drawn`)."""
        draft_len = np.asarray(draft_len, dtype=np.int64)
        if self.mode == "synthetic":  # every row drafts what it was asked to; one draw for them all
            return self._synthetic(index, out_pos, draft_len), np.maximum(draft_len, 0)
        accepted = np.zeros(draft_len.shape[0], dtype=np.int64)
        drafted = np.zeros(draft_len.shape[0], dtype=np.int64)
        todo = draft_len > 0
        if self.mode == "trace" and draft_len.shape[0] <= SMALL_BATCH:  # a handful of rows: one by one
            for r in todo.nonzero()[0].tolist():
                known = self._known(int(index[r]), int(out_pos[r]), int(draft_len[r]))
                if known is not None:
                    (accepted[r], drafted[r]), todo[r] = known, False
        elif self.mode == "trace" and todo.any():
            if self._tables is None:
                self._tables = _lookup_tables(self.recorded, self.agreement)
            rec_acc, rec_drafted, runs, has_agree = self._tables
            inside = (index < rec_acc.shape[0]) & (out_pos >= 0) & (out_pos < rec_acc.shape[1])
            if inside.any():
                i, p = np.where(inside, index, 0), np.where(inside, out_pos, 0)
                ra, rd = rec_acc[i, p], rec_drafted[i, p]
                hit = todo & inside & (ra >= 0) & self._recorded_holds(ra, rd, draft_len)
                accepted[hit] = np.minimum(ra, draft_len)[hit]
                drafted[hit] = np.minimum(rd, draft_len)[hit]
                todo &= ~hit
            if has_agree.size:
                known = index < has_agree.shape[0]
                i = np.where(known, index, 0)
                agree = todo & known & has_agree[i]
                if self.exact_max_d is not None:
                    agree &= draft_len <= self.exact_max_d
                inside = (out_pos >= 0) & (out_pos < runs.shape[1])  # past its agreement: none agrees
                run = np.where(inside, runs[i, np.where(inside, out_pos, 0)], 0) if runs.shape[1] else 0
                accepted[agree] = np.minimum(run, draft_len)[agree]
                drafted[agree] = draft_len[agree]
                todo &= ~agree
        if todo.any():
            accepted[todo], drafted[todo] = self._drawn(np.asarray(index)[todo], np.asarray(out_pos)[todo],
                                                        draft_len[todo])
        return accepted, drafted

    def accept(self, request_index: int, out_pos: int, draft_len: int) -> int:
        return self.outcome(request_index, out_pos, draft_len)[0]


def _own_synthetic(trace, independent: bool) -> dict[int, SyntheticAcceptance]:
    """Request index (arrival order) -> the request's own synthetic acceptance, where it has one."""
    reqs = sorted(trace.requests, key=lambda r: r.arrival_ns) if trace is not None else []
    return {i: SyntheticAcceptance(r.synthetic_acceptance_length, None if r.synthetic_acceptance_rates is None
                                   else tuple(r.synthetic_acceptance_rates), independent)
            for i, r in enumerate(reqs)
            if r.synthetic_acceptance_length is not None or r.synthetic_acceptance_rates is not None}


def _request_table(trace) -> tuple[np.ndarray, np.ndarray] | None:
    """(keys, prompt lengths) of the trace's requests by index (arrival order)."""
    if trace is None:
        return None
    reqs = sorted(trace.requests, key=lambda r: r.arrival_ns)
    return (np.array([request_key(r.request_id) for r in reqs], dtype=np.int64),
            np.array([r.prompt_len for r in reqs], dtype=np.int64))


def _engine_seed(trace) -> int:
    """The seed of the engine's own draws in the trace's configuration (0 without a trace)."""
    return int((trace.header.engine_config.get("seed") or 0) if trace is not None else 0)


def synthetic_of(trace) -> tuple[SyntheticAcceptance | None, dict[int, SyntheticAcceptance] | None]:
    """A synthetic trace's definition and its requests' own (None, None for any other trace)."""
    try:
        forced = recorded_synthetic(trace)
    except ValueError:
        return None, None
    return forced, _own_synthetic(trace, forced.independent)


def recorded_synthetic(trace) -> SyntheticAcceptance:
    """The synthetic acceptance the trace's engine forced, or its replay simulated (bare
    `--acceptance synthetic`)."""
    c = trace.header.engine_config
    simulated = (trace.header.extra or {}).get("acceptance")
    if c.get("acceptance") != "synthetic" and isinstance(simulated, str) and simulated.startswith("synthetic:"):
        return SyntheticAcceptance.parse(simulated.split(":", 1)[1])
    if c.get("acceptance") != "synthetic":
        raise ValueError(f"{trace.path or 'the trace'} was not captured with synthetic acceptance (acceptance "
                         f"{c.get('acceptance', 'lossless')!r}): name one, e.g. --acceptance synthetic:2.5")
    rates = c.get("synthetic_acceptance_rates")
    return SyntheticAcceptance(c.get("synthetic_acceptance_length"), None if rates is None else tuple(rates),
                               bool(c.get("synthetic_acceptance_independent", False)))


def step_rates(trace) -> list[float]:
    """Conditional per-position acceptance P(accept k | accepted k-1) from step records."""
    reached: dict[int, int] = {}
    passed: dict[int, int] = {}
    for st in trace.steps:
        if not st.num_drafted:
            continue
        for d, a in zip(st.num_drafted, st.num_accepted or []):
            for k in range(min(d, a + 1)):
                reached[k] = reached.get(k, 0) + 1
                if k < a:
                    passed[k] = passed.get(k, 0) + 1
    return [passed.get(k, 0) / reached[k] for k in sorted(reached)]


def draft_rate(trace) -> float:
    """Share of the rows of speculative steps that drafted at least one token (n-gram lookups
    miss; model proposers always draft)."""
    # rows the scheduler asked to draft (num_new_tokens = 1 + planned drafts; rows capped
    # by max_tokens plan none) and whether the proposer drafted anything for them
    rows = [d > 0 for st in trace.steps if st.kind == "spec"
            for n, d in zip(st.num_new_tokens, st.num_drafted or []) if n > 1]
    return sum(rows) / len(rows) if rows else 1.0


class SwitchedAcceptance:
    """A change of workload: requests before the `at`-th (arrival order) draw their outcomes
    from `first`, the others from `second`."""

    def __init__(self, first: AcceptanceModel, second: AcceptanceModel, at: int):
        self.first, self.second, self.at = first, second, at

    def outcome(self, request_index: int, out_pos: int, draft_len: int) -> tuple[int, int]:
        return (self.first if request_index < self.at else self.second).outcome(request_index, out_pos, draft_len)

    def outcomes(self, index: np.ndarray, out_pos: np.ndarray, draft_len: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
        index = np.asarray(index)
        later = index >= self.at
        if not later.any():
            return self.first.outcomes(index, out_pos, draft_len)
        if later.all():
            return self.second.outcomes(index, out_pos, draft_len)
        out_pos, draft_len = np.asarray(out_pos), np.asarray(draft_len)
        accepted = np.zeros(index.shape[0], dtype=np.int64)
        drafted = np.zeros(index.shape[0], dtype=np.int64)
        for model, rows in ((self.first, ~later), (self.second, later)):
            accepted[rows], drafted[rows] = model.outcomes(index[rows], out_pos[rows], draft_len[rows])
        return accepted, drafted


def recorded_acceptance(trace) -> dict[int, dict[int, tuple[int, int]]]:
    """(accepted, drafted) per request index and output position at the step's start, from
    the step records. Request indices follow arrival order, as the replayed workload does."""
    idx = {r.request_id: i for i, r in enumerate(sorted(trace.requests, key=lambda r: r.arrival_ns))}
    pos: dict[str, int] = {}
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for st in sorted(trace.steps, key=lambda s: s.step):
        for rid, drafted, accepted, emitted in zip(st.request_ids, st.num_drafted or [], st.num_accepted or [],
                                                   st.num_output or []):
            p = pos.get(rid, 0)
            if st.kind == "spec" and rid in idx:  # a row that drafted nothing (n-gram miss) too
                out.setdefault(idx[rid], {})[p] = (int(accepted), int(drafted))
            pos[rid] = p + int(emitted)
    return out


def _lookup_tables(recorded: dict[int, dict[int, tuple[int, int]]], agreement: dict[int, list[int]]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Padded arrays for `AcceptanceModel.outcomes`: recorded (accepted, drafted) by [request
    index, output position] (-1 where none), and per request with agreement data the run of
    agreeing positions starting at each output position."""
    n = max(recorded, default=-1) + 1
    width = max((max(d) + 1 for d in recorded.values() if d), default=0)
    rec_acc = np.full((n, width), -1, dtype=np.int64)
    rec_drafted = np.full((n, width), -1, dtype=np.int64)
    # every (request, position) entry in four flat lists, then one assignment per table: a
    # large workload has hundreds of requests, too many for array calls per request
    rows = [i for i, by_pos in recorded.items() for _ in range(len(by_pos))]
    pos = [p for by_pos in recorded.values() for p in by_pos]
    vals = [v for by_pos in recorded.values() for v in by_pos.values()]
    if rows:
        rv = np.array(vals, dtype=np.int64).reshape(-1, 2)
        rec_acc[rows, pos], rec_drafted[rows, pos] = rv[:, 0], rv[:, 1]
    m = max(agreement, default=-1) + 1
    length = max((len(a) for a in agreement.values()), default=0)
    agree = np.zeros((m, length), dtype=bool)  # padded with disagreement
    has = np.zeros(m, dtype=bool)
    if agreement:
        idx = list(agreement)
        has[idx] = True
        lists = list(agreement.values())
        if all(len(a) == length for a in lists):  # one length (the usual): one conversion of 0/1s
            flat = np.frombuffer(bytes(itertools.chain.from_iterable(lists)), dtype=np.uint8)
            agree[idx] = (flat != 0).reshape(len(idx), length)
        else:
            for i, a in agreement.items():
                agree[i, : len(a)] = a
    # ones in a row from p on: the distance from p to the first disagreement at or after it
    pos = np.arange(length)
    stops = np.where(agree, length, pos[None, :])
    runs = np.minimum.accumulate(stops[:, ::-1], axis=1)[:, ::-1] - pos[None, :]
    return rec_acc, rec_drafted, runs.astype(np.int64), has
