"""Adaptive draft length: the D of each decode step, chosen from live acceptance and costs.

Why: a fixed D is right for one load only. Speculation pays at batch 1 and stops paying as
the batch grows (the verify costs B·(1+D) target tokens), and acceptance differs between
requests and along a request. Before each decode-only step this policy picks D in
{0, 1, ..., max_draft_len} maximizing the expected output tokens per second of the batch,

    rate(D) = sum_i E_i[emitted | D] / (h + T_draft(B, D) + T_verify(B + sum_i d_i) + T_fill(B, D)),

the criterion of the NVIDIA write-up (speedup = T(B)·AL / (T(B·(1+D)) + T_draft(B, D))) with
a learned step overhead h and d_i = min(D, row i's room) row i's drafts (each row verifies
its own). D = 0 is a plain decode step (no draft, no verify width): speculation off. It is
pure numpy, so the same object runs in the engine and in the simulator (it is inside the
pipeline), and its inputs are what the pipeline already has:

- **Acceptance**, per request and draft position: p[i, k] = P(draft k accepted | k-1 were),
  from each verify's (drafted, accepted) -- positions up to the accepted count accepted, the
  next one rejected, later ones unobserved. Per request, acceptances and observations are
  counted with older ones fading (weight 1 - `smoothing` per later observation) and the
  engine-wide estimate counts as `request_weight` more observations, so a request seen little
  follows the engine-wide rate as that is learned and one seen often its own. The engine-wide
  estimate starts at `prior`, counted as `prior_weight` observations, is the running mean of
  all rows until that weighs a step less than `global_smoothing`, then an EWMA; a deeper
  position, seen only when the ones before it were accepted, takes the estimate of the
  position before it in place of `prior` (`AcceptanceEstimate.engine_wide`). Then
  E_i[emitted | D] = 1 + sum_{j<=D} prod_{k<=j} p[i, k], capped by the tokens the request has
  left; where a lookup may find nothing to draft (n-gram), the chance a row asked for drafts
  drafts any is learned the same way and weighs its expected drafts and verify positions. A
  request whose drafts keep failing drafts less, or none (scheduler/step_price.py).
- **Step time**, from the device events' start/end stamps of the launches the pipeline makes:
  a small non-negative linear model per op (a target forward over (tokens, requests, KV
  tokens, verify) -- decode and verify forwards share their slopes, and a verify's fixed extra
  cost (its logits at every position) is a term of its own, so it does not inflate the price
  of a plain step; the draft over (draft steps, rows past one a step -- a step reads the
  proposer's weights once whatever its rows, so a warm-up at batch 1 teaches a step's cost --,
  KV tokens x draft steps: the
  first token comes from logits already there, each further one reads the KV); the fill),
  refitted as samples arrive (running weighted sums, folded in when a step's residual or a
  decision that weighs the lengths next reads them; a held D = 0 reads them as last fitted),
  ridge-regularized
  toward its seed -- a fitted cost profile (`seed_costs`, the simulator's JSON format) or
  none -- so a few samples cannot swing it (the draft's KV term 100 times harder, its
  constant 3 times: `online_cost.PULL`). A real device's first launch of each op pays
  one-off costs and teaches nothing (`cold_first_launch`). While an unseeded op has fewer than two samples
  (one sample's cost is all constant: a first fill that caught up a prompt) the policy drafts
  `first_draft_len` tokens, which teaches every model.
  h per D (`scheduler/step_overhead.py`) is the median of recent steps' measured wall time
  over predicted device time (the models as the step's own launches left them): host work a
  schedule does not hide (a plain step launches one op, a speculative one three) and, signed,
  the device models' bias at that D; a D seen little borrows the residual over every D (every
  speculative D where plain steps run one step ahead, hiding their host work).
- **A catch-up**: while speculation is off a proposer with lazy fills (a draft model, an MTP
  head) reads nothing and catches up in one fill when a row drafts again. A drafting step is
  charged, per row, the fill of what it is behind (`lag`) spread over the steps the row is
  expected to draft for the rest of its output: resuming pays for a long output only.
- **Exploration** (`scheduler/probe_schedule.py`): every `explore_every`-th decision tries a
  neighbour of the best length, so a stale estimate cannot keep speculation off, or short,
  forever -- from D = 0 the length whose rate is highest with every acceptance read
  `probe_optimism` standard errors above its estimate (an upper confidence bound: deep
  positions, seen only when a probe reaches them, decide whether a long draft pays); settled
  choices are probed less and less often, a neighbour predicted more than `probe_margin`
  behind is skipped but at the longest interval, and what probes lose against the best (from
  D = 0, the probing rows' whole catch-up) is paid from a budget of `explore_cost` of each
  decided step's predicted time. From D = 0 with the proposer behind,
  the first `PROBE_ROWS` rows probe (the others wait a step); a resume predicted within
  `probe_margin` of plain decoding is such a probe too (a step that then finds D = 0 best
  wastes its catch-up), and so is one over more than twice the rows a verify has had, with
  that many rows (its verify cost is an extrapolation); while no plain step has run, the
  probe is D = 0.
- **State**: `state()` is what the policy has learned (engine-wide acceptance, cost models,
  overheads, probe schedule) as JSON values; a trace's header carries it and a replay of the
  trace `restore`s it, so that the replay starts where the captured run's policy stood.
- **Host cost**: the policy runs on the host between device steps, where a plain decode step
  leaves least room, so a choice of D = 0 stands for up to `HOLD_STEPS` decisions over an
  unchanged batch (see `choose`).
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler.acceptance_estimate import AcceptanceEstimate, accepted_drafts, expected_drafts
from specsched.scheduler.draft_policy import Decision, StepOutcome, StepView
from specsched.scheduler.online_cost import LAUNCH_OPS, cost_models, launch_model, op_features
from specsched.scheduler.policy_state import policy_state, restore_policy_state
from specsched.scheduler.probe_schedule import ProbeSchedule
from specsched.scheduler.step_price import StepPrice
from specsched.scheduler.step_overhead import StepOverhead

HOLD_STEPS = 32  # decode steps a choice of D = 0 stands for over an unchanged batch (see `choose`)
PROBE_ROWS = 4  # rows a probe from D = 0 drafts with while its proposer is behind (see `choose`)


class DraftLenPolicy:
    """See the module docstring. `kv_ahead`: the proposer's fill after a plain decode covers
    1 + kv_ahead tokens per row; `lazy_fill`: its fills wait while speculation is off
    (`ProposerRules.lazy_fill`); `fill_same_batch`: its fill after a verify covers the verify
    window (an MTP head; a draft model under `eager_fill`), else the accepted tokens; `has_fill`: it has one;
    `draft_op`: it drafts in a launch of its own (not a lookup on the host, whose time the
    step overhead h takes);
    `cold_first_launch`: the device's first launch of an op pays one-off costs, so its
    interval teaches nothing (a real device; the simulator's prices have none); `plain_ahead`:
    plain steps run one step ahead (`overlap`, `eager_fill`), hiding their host work.
    A `DraftPolicy` (scheduler/draft_policy.py); a decision's `cost_args` are `step_ns`'s
    arguments (rows, D, forwards, KV tokens, catch-up, drafts)."""

    adaptive = True
    pauses = True

    def __init__(self, max_draft_len: int, *, has_fill: bool, kv_ahead: int = 0, fill_same_batch: bool = False,
                 draft_op: bool = True,
                 lazy_fill: bool = False, cold_first_launch: bool = True,
                 prior: float = 0.7, smoothing: float = 0.15, global_smoothing: float = 0.02, prior_weight: float = 8.0,
                 request_weight: float = 4.0, probe_margin: float = 0.1, first_draft_len: int = 2,
                 explore_every: int = 16, explore_cost: float = 0.02, seed_costs: dict | None = None,
                 slots: int = 64, plain_ahead: bool = False, probe_optimism: float = 0.5):
        if max_draft_len < 1:
            raise ValueError(f"an adaptive draft length needs max_draft_len >= 1, got {max_draft_len}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior acceptance must be in [0, 1], got {prior}")
        if probe_optimism < 0.0:
            raise ValueError(f"probe_optimism (standard errors) must be >= 0, got {probe_optimism}")
        self.max_draft_len = max_draft_len
        self._ds = np.arange(max_draft_len + 1)
        self.has_fill, self.kv_ahead, self.fill_same_batch = has_fill, kv_ahead, fill_same_batch
        self.catches_up = has_fill and lazy_fill  # skips fills at D = 0, catches up (`lag` in `choose`)
        self.probes = ProbeSchedule(explore_every, explore_cost)
        # a probe's length predicted this far behind the best is skipped; a resume predicted
        # this close to plain decoding is a probe
        self.probe_margin = probe_margin
        self.probe_optimism = probe_optimism
        self.first_draft_len = min(first_draft_len, max_draft_len)  # D while a cost is unknown
        self.estimate = AcceptanceEstimate(max_draft_len, prior=prior, smoothing=smoothing,
                                           global_smoothing=global_smoothing, prior_weight=prior_weight,
                                           request_weight=request_weight, slots=slots)
        self.costs = cost_models(seed_costs)  # target, draft, fill (scheduler/online_cost.py)
        self.price = StepPrice(self.costs, has_fill=has_fill, kv_ahead=kv_ahead, fill_same_batch=fill_same_batch,
                               catches_up=self.catches_up, draft_op=draft_op)  # scheduler/step_price.py
        self.step_ns = self.price.step_ns
        self.overhead = StepOverhead(max_draft_len, plain_hidden=plain_ahead)  # h per D
        self.decisions = 0
        self.verify_rows = 0  # the most rows a verify has had (a larger one's cost is extrapolated)
        # launch ops whose first (cold) interval has been seen; all of them on a device without one
        self.warm_ops: list[str] = [] if cold_first_launch else list(LAUNCH_OPS)
        self.last: Decision | None = None
        self._held_slots: np.ndarray | None = None  # the batch a standing D = 0 was chosen for
        self._held_budget, self._held = 0, 0
        self._plain_decided = False

    def observe(self, outcome: StepOutcome) -> None:
        """One step's outcome (scheduler/draft_policy.py): its verify's acceptance, its wall
        time against the decision's prediction, then the device intervals of the launches
        completed since the last one (the step's residual is read against the cost models as
        its own launches left them)."""
        v = outcome.verify
        if v is not None:
            self.observe_verify(v.slots, v.drafted, v.accepted, v.asked, live=v.live)
        if outcome.decision is not None and outcome.wall_ns is not None:
            self.observe_step(outcome.wall_ns, outcome.decision)
        for op, attrs, duration_ns in outcome.launches:
            self.observe_launch(op, attrs, duration_ns)

    def warmed_up(self) -> None:
        """The engine's warm-up is done: what it taught stays, its last choice goes (`skips_fill`)."""
        self.last, self._held_slots = None, None

    # -- what it has learned (scheduler/policy_state.py) ------------------------------------
    def state(self) -> dict:
        """What the policy has learned, as JSON values: a trace's header carries it, so that a
        replay starts where the captured run's policy stood (scheduler/policy_state.py)."""
        return policy_state(self)

    def restore(self, state: dict) -> None:
        """Continue from `state` (see `state`); ValueError if it is another policy's."""
        d = restore_policy_state(self, state)  # the last step's D (lazy fills wait after a plain step)
        self.last = None if d is None else Decision(d, np.zeros(0, dtype=np.int64), 0, None)
        self._held_slots = None

    # -- acceptance (scheduler/acceptance_estimate.py) ------------------------------------
    def start(self, slot: int) -> None:
        """A request took `slot`: its estimates start from the engine-wide ones; a standing D = 0 ends."""
        self.estimate.start(slot)
        self._held_slots = None

    def acceptance(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots), Dmax] p[i, k] (`AcceptanceEstimate.of`)."""
        return self.estimate.of(slots)

    @property
    def accept(self) -> np.ndarray:  # p[i, k] of every slot
        return self.estimate.of(np.arange(self.estimate.num_slots))

    @property
    def global_accept(self) -> np.ndarray:  # the engine-wide p[k] as learned (its state; see `engine_wide`)
        return self.estimate.global_accept

    def observe_verify(self, slots: np.ndarray, num_draft: np.ndarray, accepted: np.ndarray,
                       asked: np.ndarray | None = None, live: np.ndarray | None = None) -> None:
        """Each row drafted num_draft (of `asked`) and had `accepted` accepted: positions
        1..accepted were accepted, position accepted + 1 (if drafted) rejected, later ones
        unobserved. Rows not `live` (their request gone since) teach the engine-wide estimates only."""
        if asked is not None:
            self.estimate.observe_asked(slots, asked, num_draft, live)
        if self.estimate.observe(slots, num_draft, accepted, live):
            self._held_slots = None  # new acceptance evidence: the next step decides afresh

    # -- costs ----------------------------------------------------------------------------
    def observe_launch(self, op: str, attrs: dict, duration_ns: int) -> None:
        """A completed launch's device interval: `op` is the launch op (forward, draft,
        verify, fill), `attrs` its shape. Plain decode and verify forwards train the target's
        model (prefill chunks cost otherwise and are not what this policy chooses between)."""
        model = launch_model(op, attrs)
        if model is None:
            return
        if op not in self.warm_ops:
            # an op's first launch pays one-off costs (allocations, kernel selection): a head's
            # first fill measured 21-24 ms for 97 tokens against 4.7 ms for 57 the next time
            self.warm_ops.append(op)
            return
        self.costs[model].add(op_features(model, attrs, op), float(duration_ns))
        if op == "verify":
            self.verify_rows = max(self.verify_rows, int(attrs.get("requests", 0)))

    def observe_step(self, wall_ns: int, last: Decision | None = None) -> None:
        """The decided step `last` (default: the latest) took `wall_ns` (schedule to output): h
        follows the part of it the predicted device time does not explain."""
        last = self.last if last is None else last
        if last is None or last.rows == 0 or last.device_ns is None:
            return
        if last.cost_args is not None and last.cost_args[4] > 0:
            return  # a catch-up step: a transition priced by `lag`, not what a step at its D costs
        # against the models as the step's launches left them, refitted if due (against the
        # decision's prediction a model's correction would count twice: in the model and in h);
        # negative where the device models overprice this D
        predicted = self.step_ns(*last.cost_args) if last.cost_args is not None else None
        self.overhead.observe(last.draft_len, float(wall_ns - (last.device_ns if predicted is None else predicted)))

    # -- the decision ---------------------------------------------------------------------
    def choose(self, view: StepView) -> Decision:
        """D for a decode-only step over the rows `view.slots` (in order; `remaining`: output
        tokens each has left, `computed`: its KV tokens, `lag`: tokens its draft model has not
        read), within a token budget that holds B·(1 + D) verify tokens; and how many tokens
        each served row drafts.

        A choice of D = 0 (not a probe) stands for up to `HOLD_STEPS` decisions while the batch
        is the same rows and no verify brings new acceptance: nothing it depends on then moves
        but by a token per row, and a plain decode step is the one whose host time counts most
        (such a decision prices its step with the cost models as last fitted: a due refit waits
        for the step's residual, `observe_step`, or a decision that weighs the lengths)."""
        slots, remaining, computed, budget, lag = view.slots, view.remaining, view.computed, view.budget, view.lag
        self.decisions += 1
        held = self._held_slots
        if (held is not None and self._held < HOLD_STEPS and not self.probes.due(self.decisions)
                and budget == self._held_budget and held.shape == slots.shape and (held == slots).all()):
            self._held += 1
            last = self.last
            args = (last.rows, 0, 0, int(computed[:last.rows].sum()), 0.0)
            dec = Decision(0, last.num_draft, last.rows, last.gain, False, self.step_ns(*args, refit=False), args)
            self._accrue(dec)
            return dec
        n = len(slots)
        dmax = self.max_draft_len
        # [n] P(the row drafts anything: a lookup may find nothing); None while every row asked did
        drawn = self.estimate.drafts(slots)
        cap = np.minimum(np.maximum(remaining - 1, 0), dmax)  # drafts a row may still use
        ds = self._ds
        use = np.minimum(cap[None, :], ds[:, None])  # [1 + Dmax, n] drafts per row at each D
        reach, accepted = accepted_drafts(self.acceptance(slots), drawn, use)
        rows_d = np.minimum(n, budget // (1 + ds))  # rows the budget holds at each D
        # [1 + Dmax, n] per row -> [1 + Dmax] over the rows served at each D (the usual case:
        # the budget holds every row at every D, and no mask is needed)
        served = None if rows_d[-1] == n else np.arange(n)[None, :] < rows_d[:, None]

        def over_served(per_row: np.ndarray) -> np.ndarray:
            return (per_row if served is None else per_row * served).sum(axis=1)

        expected = rows_d + over_served(accepted)
        forwards, drafts = over_served(np.maximum(use - 1, 0)), over_served(expected_drafts(use, drawn))
        kv = (np.full(dmax + 1, int(computed.sum())) if served is None  # KV tokens of the first r rows
              else np.concatenate([[0], np.cumsum(computed)])[rows_d])
        catch_up = None
        if lag is not None and self.catches_up and lag.any():
            # the row's catch-up spread over its drafting steps left: E[tokens/step] / remaining
            per_step = np.minimum((1.0 + accepted) / np.maximum(remaining, 1)[None, :], 1.0) * (use > 0)
            catch_up = over_served(per_step * lag[None, :])
        best = None
        rates: dict[int, float] = {}
        spent: dict[int, float] = {}  # each length's predicted step time, with h
        rows_l, forwards_l, kv_l, drafts_l = rows_d.tolist(), forwards.tolist(), kv.tolist(), drafts.tolist()
        expected_l = expected.tolist()
        catch_l = catch_up.tolist() if catch_up is not None else [0.0] * (dmax + 1)
        for d in range(dmax + 1):
            if rows_l[d] == 0:
                continue
            t = self.step_ns(rows_l[d], d, forwards_l[d], kv_l[d], catch_l[d], drafts_l[d])
            if t is None:
                continue
            # h may be negative (it corrects a device model that overprices this D), not below -3/4 of it
            spent[d] = max(self.overhead.at(d) + t, 0.25 * t, 1.0)
            rates[d] = expected_l[d] / spent[d]
            if best is None or rates[d] > rates[best]:
                best = d
        explored, probe_rows = False, None
        warming = best is None or len(rates) < sum(r > 0 for r in rows_l)
        if warming:
            # a cost not known yet (too few samples of an op): speculate, which teaches them all
            best = self.first_draft_len
        elif self.probes.due(self.decisions, self.plain_seen):
            # a neighbour, so that the costs and acceptance of the lengths around the best stay
            # known whichever way it moves (from D = 0: the length rated highest with its
            # acceptance read optimistically, `_optimistic_rates`) -- unless it has run and is
            # predicted far behind (`probe_margin`), which the longest interval probes all the
            # same (no estimate stays stale for ever), or it costs more than the exploration
            # budget holds
            probe = self.probes.candidate(best, dmax, self.plain_seen)
            judged = rates
            if not best and self.plain_seen:
                judged = self._optimistic_rates(slots, spent, rows_d, use, drawn, served)
                probe = max((d for d in judged if d), key=judged.get, default=probe)
            far = (not self.probes.at_longest and probe in judged and self.overhead.samples[probe] > 0
                   and judged[probe] < (1.0 - self.probe_margin) * rates[best])
            k = rows_l[probe]
            if not best and self._behind(lag, probe, k):
                # from D = 0 behind: the first PROBE_ROWS rows probe, the rest wait a step -- what
                # it teaches (acceptance, a verify's cost) is had without every row's catch-up
                k = min(k, PROBE_ROWS)
            loss = 0.0
            if not far and probe in rates:
                loss = self._probe_loss(probe, rates[best], k, use, drawn, computed, accepted, lag)
            if self.probes.decide(self.decisions, best, far, loss):
                best, explored, probe_rows = probe, True, k
        if not warming and not explored and best and rates.get(0) and self._behind(lag, best, rows_l[best]):
            # resuming pays every row's catch-up now, and a later step that finds D = 0 best
            # after all has wasted it. So a resume predicted within `probe_margin` of plain
            # decoding is a probe, paid from the budget; and so is one over more rows than a
            # verify has had (twice those, at least PROBE_ROWS): its verify cost is an
            # extrapolation (a warm-up at batch 1 priced a resume at 47 rows +15%; it lost a
            # 486 ms catch-up, 7% of the run) -- the rows it may take double per resume (after
            # a declined due probe too)
            k = min(rows_l[best], max(PROBE_ROWS, 2 * self.verify_rows))
            if k < rows_l[best] or rates[best] < (1.0 + self.probe_margin) * rates[0]:
                loss = self._probe_loss(best, rates[0], k, use, drawn, computed, accepted, lag)
                if self.probes.pay(loss):
                    explored = True
                    probe_rows = k if k < rows_l[best] else None
                else:
                    best = 0
        rows = int(rows_d[best]) if probe_rows is None else probe_rows
        num_draft = use[best, :rows]
        if best >= 1 and rates.get(best) is not None:
            num_draft = self.price.per_row(num_draft, reach[:rows], rates[best], computed[:rows], explored)
        if best >= 1 and not num_draft.any():
            best = 0  # nobody drafts: a plain decode step
            rows = min(n, budget)
            num_draft = np.zeros(rows, dtype=np.int64)
        gain_over_plain = rates[best] / rates[0] if best in rates and rates.get(0) else None
        behind = self._behind(lag, best, rows)
        kv_rows = kv_l[best] if rows == rows_l[best] else int(computed[:rows].sum())
        args = (rows, best, int(np.maximum(num_draft - 1, 0).sum()), kv_rows, behind,
                float(expected_drafts(num_draft, drawn, rows).sum()))
        dec = Decision(best, num_draft.astype(np.int64), rows, gain_over_plain, explored, self.step_ns(*args), args)
        self._accrue(dec)
        # a D = 0 the estimates chose stands, not one forced by every row's last token
        if best == 0 and not explored and cap[:rows].any():
            self._held_slots, self._held_budget, self._held = slots.copy(), budget, 0
        else:
            self._held_slots = None
        return dec

    @property
    def plain_seen(self) -> bool:
        """Whether a plain step has been decided (or, restored, measured)."""
        return self._plain_decided or bool(self.overhead.samples[0])

    def _accrue(self, dec: Decision) -> None:
        self.last = dec
        self._plain_decided = self._plain_decided or dec.draft_len == 0
        self.probes.accrue(dec.device_ns or 0.0)

    def _optimistic_rates(self, slots: np.ndarray, spent: dict[int, float], rows_d: np.ndarray, use: np.ndarray,
                          drawn: np.ndarray | None, served: np.ndarray | None) -> dict[int, float]:
        """`choose`'s rates (tokens/ns) over the same predicted step times `spent`, with every
        acceptance `probe_optimism` standard errors above its estimate
        (`AcceptanceEstimate.optimistic_of`): the upper confidence bound a probe from D = 0 is
        chosen and judged by (module docstring, Exploration)."""
        accepted = accepted_drafts(self.estimate.optimistic_of(slots, self.probe_optimism), drawn, use)[1]
        expected = (rows_d + (accepted if served is None else accepted * served).sum(axis=1)).tolist()
        return {d: expected[d] / t for d, t in spent.items()}

    def _behind(self, lag: np.ndarray | None, d: int, rows: int) -> float:
        """Tokens a step of the first `rows` rows at D = d catches its proposer up on."""
        return float(lag[:rows].sum()) if d and lag is not None and self.catches_up else 0.0

    def _probe_loss(self, probe: int, best_rate: float, rows: int, use: np.ndarray, drawn: np.ndarray | None,
                    computed: np.ndarray, accepted: np.ndarray, lag: np.ndarray | None) -> float:
        """What a step of the first `rows` rows at D = `probe` (`choose`'s drafts per row `use`,
        each row's chance `drawn` of drafting at all, KV tokens `computed`, expected accepted
        drafts `accepted`, proposer lag `lag`) costs against the best length's rate: its
        predicted time over the time the best takes for as many tokens. Its catch-up counts
        whole (not spread over the output, as in the rates): a probe that finds D = 0 still best
        has wasted it."""
        u = use[probe, :rows]
        t = self.step_ns(rows, probe, int(np.maximum(u - 1, 0).sum()), int(computed[:rows].sum()),
                         self._behind(lag, probe, rows), float(expected_drafts(u, drawn, rows).sum()))
        if t is None:
            return 0.0
        t = max(self.overhead.at(probe) + t, 0.25 * t, 1.0)
        return max(t - (rows + float(accepted[probe, :rows].sum())) / best_rate, 0.0)
