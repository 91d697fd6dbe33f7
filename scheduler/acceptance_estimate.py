"""The draft-length policy's acceptance estimates: per request and draft position, shrunk
toward an engine-wide estimate (see `AcceptanceEstimate`; `scheduler/adaptive.py` keeps one)."""
from __future__ import annotations

import numpy as np


class AcceptanceEstimate:
    """p[i, k] = P(draft k of request i accepted | drafts 1..k-1 were), from each verify's
    (drafted, accepted): positions up to the accepted count accepted, the next one rejected,
    later ones unobserved. Per request (by slot), acceptances and observations are counted with
    older ones fading (weight 1 - `smoothing` per later observation) and the engine-wide
    estimate counts as `request_weight` more observations. The engine-wide estimate starts at
    `prior`, counted as `prior_weight` observations, is the running mean of all rows until
    that weighs a step less than `global_smoothing`, then an EWMA over steps. Where it is read
    (`engine_wide`), position k's prior is position k - 1's estimate, not `prior`: a deep
    position is seen only when every one before it was accepted, so it is seen rarely (in
    probes, while speculation is off), and a proposer's acceptance given the drafts before it
    held is about as high deeper down (the bundled MTP head's: 0.79, 0.83, 0.83) -- a fixed
    prior kept the second and later positions near it for hundreds of steps and the policy
    undervalued long drafts.

    Whether a row asked for drafts drafts any (`draft_rate`: an n-gram lookup may find nothing
    to copy; a model always drafts) is estimated the same way, per request and engine-wide,
    from 1.0: p[i, 1] is conditional on it."""

    def __init__(self, max_draft_len: int, *, prior: float, smoothing: float, global_smoothing: float,
                 prior_weight: float, request_weight: float, slots: int):
        self.max_draft_len = max_draft_len
        self.prior = prior
        self.smoothing, self.global_smoothing = smoothing, global_smoothing
        self.prior_weight, self.request_weight = prior_weight, request_weight
        self.global_accept = np.full(max_draft_len, prior)  # engine-wide p[k]
        self.global_seen = np.zeros(max_draft_len)  # observations of each position so far
        # per slot and position: acceptances and observations seen, decayed by 1 - smoothing
        self._hits = np.zeros((slots, max_draft_len))
        self._seen = np.zeros((slots, max_draft_len))
        self._k = np.arange(1, max_draft_len + 1)
        self.draft_rate, self.draft_seen = 1.0, 0.0  # engine-wide P(a row asked for drafts drafts)
        self._drew = np.zeros((slots, 2))  # per slot: (rows that drafted, rows asked), decayed

    def start(self, slot: int) -> None:
        """A request took `slot`: its estimates start from the engine-wide ones."""
        if slot >= self._hits.shape[0]:
            grow = np.zeros((slot + 1 - self._hits.shape[0], self.max_draft_len))
            self._hits, self._seen = np.concatenate([self._hits, grow]), np.concatenate([self._seen, grow])
            self._drew = np.concatenate([self._drew, np.zeros((grow.shape[0], 2))])
        self._hits[slot] = 0.0
        self._seen[slot] = 0.0
        self._drew[slot] = 0.0

    def of(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots), Dmax] p[i, k]: the request's own (decayed) acceptance count at position k
        over its observations there, with the engine-wide estimate counted as `request_weight`
        more -- a request seen little follows the engine-wide rate as that is learned, one seen
        often its own."""
        return self._shrunk(slots, self.engine_wide())

    def optimistic_of(self, slots: np.ndarray, z: float) -> np.ndarray:
        """`of` with every position `z` standard errors of its engine-wide estimate higher (the
        prior counting as `prior_weight` observations), at most 1: what each may be worth given
        how little of it has been seen."""
        p = self.engine_wide()
        bonus = z * np.sqrt(p * (1.0 - p) / (self.global_seen + self.prior_weight))
        return np.minimum(self._shrunk(slots, p) + bonus[None, :], 1.0)

    def _shrunk(self, slots: np.ndarray, engine_wide: np.ndarray) -> np.ndarray:
        m = self.request_weight
        return (m * engine_wide + self._hits[slots]) / (m + self._seen[slots])

    def engine_wide(self) -> np.ndarray:
        """[Dmax] the engine-wide p[k] with position k's prior taken from position k - 1: its
        share of `global_accept[k]` -- prior_weight / (prior_weight + observations), exact while
        the estimate is a running mean, an upper bound once it is an EWMA -- moved from `prior`
        to the estimate before it."""
        g = self.global_accept
        share = self.prior_weight / (self.prior_weight + self.global_seen)
        out = g.copy()
        for k in range(1, len(g)):
            out[k] = g[k] + share[k] * (out[k - 1] - self.prior)
        return np.clip(out, 0.0, 1.0)

    def drafts(self, slots: np.ndarray) -> np.ndarray | None:
        """[len(slots)] P(the row drafts anything when asked), shrunk toward `draft_rate` as `of`;
        None while no row asked for drafts has drafted none (a model always drafts)."""
        if self.draft_rate == 1.0:
            return None
        m, drew = self.request_weight, self._drew[slots]
        return (m * self.draft_rate + drew[:, 0]) / (m + drew[:, 1])

    def observe_asked(self, slots: np.ndarray, asked: np.ndarray, drafted: np.ndarray,
                      live: np.ndarray | None = None) -> None:
        """Rows asked for `asked` drafts drafted `drafted` (fewer, none where a lookup missed);
        rows not `live` count engine-wide only (their slot is no longer their request's)."""
        ask = np.asarray(asked) > 0
        n = int(ask.sum())
        if not n:
            return
        got = ask & (np.asarray(drafted) > 0)
        own = ask if live is None else ask & live
        rows = slots[own]
        self._drew[rows] = self._drew[rows] * (1.0 - self.smoothing) + np.stack(
            [got[own], np.ones(len(rows))], axis=1)
        self.draft_seen += n
        w = max(n / (self.draft_seen + self.prior_weight), self.global_smoothing)
        self.draft_rate += w * (int(got.sum()) / n - self.draft_rate)

    @property
    def num_slots(self) -> int:
        return self._hits.shape[0]

    def observe(self, slots: np.ndarray, num_draft: np.ndarray, accepted: np.ndarray,
                live: np.ndarray | None = None) -> bool:
        """Each row drafted num_draft and had `accepted` accepted; False if no row drafted. Rows
        not `live` (their slot no longer their request's) count engine-wide only."""
        d = np.minimum(np.asarray(num_draft, dtype=np.int64), self.max_draft_len)
        a = np.minimum(np.asarray(accepted, dtype=np.int64), d)
        if not d.size or not d.any():
            return False
        k = self._k
        seen = k[None, :] <= np.minimum(a + 1, d)[:, None]  # [B, Dmax]
        hit = k[None, :] <= a[:, None]  # accepted positions (seen, since a <= d)
        keep = np.where(seen, 1.0 - self.smoothing, 1.0)  # older observations fade, per position
        if live is None or live.all():
            self._hits[slots] = self._hits[slots] * keep + hit
            self._seen[slots] = self._seen[slots] * keep + seen
        else:
            rows = slots[live]
            self._hits[rows] = self._hits[rows] * keep[live] + hit[live]
            self._seen[rows] = self._seen[rows] * keep[live] + seen[live]
        n = seen.sum(axis=0)
        mean = np.where(n > 0, hit.sum(axis=0) / np.maximum(n, 1), self.global_accept)
        # the running mean of every observation (and the prior as `prior_weight` of them) until
        # that weighs a step less than `global_smoothing`, then an EWMA over steps: a position
        # seen rarely (a deep draft) is learned from its first samples, not from the prior
        self.global_seen += n
        w = np.maximum(n / (self.global_seen + self.prior_weight), self.global_smoothing)
        self.global_accept = np.where(n > 0, self.global_accept + w * (mean - self.global_accept),
                                      self.global_accept)
        return True


def accepted_drafts(p: np.ndarray, drawn: np.ndarray | None, use: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """From acceptance p [n, Dmax] (`AcceptanceEstimate.of`) and each row's chance `drawn` of
    drafting at all: reach [n, Dmax], P(draft j made and accepted), and the expected accepted
    drafts [1 + Dmax, n] of each row at each D, drafting `use` [1 + Dmax, n] there."""
    reach = np.cumprod(p, axis=1)
    if drawn is not None:
        reach *= drawn[:, None]
    n = p.shape[0]
    gain = np.zeros((n, p.shape[1] + 1))
    np.cumsum(reach, axis=1, out=gain[:, 1:])  # [n, 1 + Dmax]: expected accepted drafts at D
    return reach, gain[np.arange(n)[None, :], use]


def expected_drafts(drafts: np.ndarray, drawn: np.ndarray | None, rows: int | None = None) -> np.ndarray:
    """Drafts per row (the last axis: rows) weighed by each row's chance of drafting at all
    (`drawn`, for the first `rows` rows; None: every row drafts)."""
    return drafts if drawn is None else drafts * drawn[:rows]
