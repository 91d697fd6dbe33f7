"""When the draft-length policy tries a length other than its best (a probe), which one, and
what probes may cost (see `ProbeSchedule`; `scheduler/adaptive.py` keeps one)."""
from __future__ import annotations

from dataclasses import dataclass

MAX_EXPLORE_BACKOFF = 8  # a settled choice is probed at most this many times less often
EXPLORE_BANK = 256  # decisions' worth of exploration budget that may be saved up (see `accrue`)
PLAIN_PROBE_AT = 4  # the decision from which D = 0 is probed while no plain step has run


@dataclass
class ProbeSchedule:
    """Every `explore_every`-th decision a neighbour of the best length is probed, one above
    and one below on alternate probes. A probe starting from the same best as the one before
    it doubles the interval to the next (up to MAX_EXPLORE_BACKOFF x `explore_every`); a change
    of the best resets it. A neighbour far behind (the policy's judgement) counts as settled
    and is not probed, except at the longest interval. What probes lose against the best is
    paid from a budget that grows by `explore_cost` of each step's predicted time: a probe that
    costs more waits (a draft model's catch-up from D = 0 can cost dozens of steps)."""

    explore_every: int = 16
    explore_cost: float = 0.02
    gap: int = 0  # decisions between probes (0: explore_every)
    next: int = 0  # the decision the next probe is due at (0: explore_every)
    probed_best: int | None = None  # the best length the last probe started from
    probes: int = 0  # up on odd probes, down on even ones
    budget: float = 0.0  # what the next probes may lose, ns

    def __post_init__(self) -> None:
        if self.explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {self.explore_every}")
        self.gap = self.gap or self.explore_every
        self.next = self.next or self.explore_every

    def due(self, decision: int, plain_seen: bool = True) -> bool:
        """Whether a probe is due; while no plain step has run, from the `PLAIN_PROBE_AT`-th
        decision on (see `candidate`)."""
        return decision >= (self.next if plain_seen else min(self.next, PLAIN_PROBE_AT))

    def candidate(self, best: int, max_len: int, plain_seen: bool) -> int:
        """The neighbour to probe: D = 0 while no plain step has run (its cost is then only an
        extrapolation from verifies -- whose fixed extra cost is inseparable from a forward's
        constant without one -- and its host overhead borrowed from the other lengths; a
        warm-up that only speculates would leave it so), else one up on odd probes (always
        from 0) and one down on even ones."""
        if not plain_seen and best > 0:
            return 0
        up = best < max_len and (best == 0 or (self.probes + 1) % 2 == 1)
        if up:
            return best + 1
        return max(best - 1, 0)

    @property
    def at_longest(self) -> bool:
        return self.gap >= MAX_EXPLORE_BACKOFF * self.explore_every

    def decide(self, decision: int, best: int, far: bool, loss: float) -> bool:
        """Whether the due probe runs, given whether its length is `far` behind the best and
        the time it loses against it (`loss`, ns); the schedule moves on either way."""
        if not far and loss > self.budget:
            self.next = decision + self.explore_every  # until the budget pays for it
            return False
        settled = best == self.probed_best
        self.gap = min(2 * self.gap, MAX_EXPLORE_BACKOFF * self.explore_every) if settled or far else self.explore_every
        self.next = decision + self.gap
        self.probed_best = best
        if far:
            return False
        self.pay(loss)
        self.probes += 1
        return True

    def pay(self, loss: float) -> bool:
        """Spend `loss` (ns) from the budget if it holds that much; whether it did."""
        if loss > self.budget:
            return False
        self.budget -= loss
        return True

    def accrue(self, step_ns: float) -> None:
        """A step predicted to take `step_ns` was decided: the budget grows by `explore_cost`
        of it, up to EXPLORE_BANK decisions' worth (a long quiet spell does not buy a burst of
        costly probes)."""
        self.budget = min(self.budget + self.explore_cost * step_ns, EXPLORE_BANK * self.explore_cost * step_ns)
