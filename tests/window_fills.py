"""What each fill over the verify window (the `mtp` schedule) left carried, row by row: the
tests of the draft model's and the tree head's window fills record it the same way."""
from __future__ import annotations

from typing import Callable


def record_window_fills(monkeypatch, proposer_cls, ahead: int,
                        distance: Callable[[object, int, int], float]) -> list[tuple[int, int, float]]:
    """Patch `proposer_cls.fill` so that after every fill over the verify window each row adds
    (window positions, accepted drafts, `distance(proposer, slot, end)`) to the returned list:
    the carried state's distance to a teacher-forced reference, `end` the position of the row's
    new last token. `ahead`: how far the proposer's fill runs ahead of the verified positions."""
    fill = proposer_cls.fill
    seen: list[tuple[int, int, float]] = []

    def checked(self, msg):
        fill(self, msg)
        if not msg.window:
            return
        accepted = self.worker.last_verify[2].tolist()
        for i, slot in enumerate(msg.slots.tolist()):
            end = int(msg.start[i]) - ahead + 1 + accepted[i]
            seen.append((int(msg.end[i] - msg.start[i]), accepted[i], distance(self, slot, end)))

    monkeypatch.setattr(proposer_cls, "fill", checked)
    return seen
