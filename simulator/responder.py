"""The simulator's worker: what the virtual device (simulator/device.py) answers for each op.

Why a module of its own: the replay (simulator/replay.py) drives a workload through the real
pipeline; what a virtual launch returns -- the tokens each slot knows, the accepted length of
each verify row drawn from the acceptance model, the device time of each substage -- is the
state of a stand-in worker, kept in arrays indexed by slot.
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler.messages import DraftResult, FillResult, ForwardResult, VerifyResult
from specsched.scheduler.small_arrays import largest
from specsched.simulator.acceptance import AcceptanceModel
from specsched.simulator.costs import CostProfile

DUMMY_TOKEN = 7  # the token every stand-in result carries (the replay keeps counts, not tokens)


class TraceResponder:
    """The simulator's worker: tokens known per slot and acceptance per verify, in arrays
    indexed by slot (a verify of B rows is a few whole-array operations)."""

    def __init__(self, profile: CostProfile, acceptance: AcceptanceModel, prompt_lens: list[int]):
        self.profile = profile
        self.acceptance = acceptance
        # a proposer that drafts on the host (`ProposerRules.host_drafts`): what its rows draft
        # and accept is drawn when they draft (`draft`: the pipeline verifies only that), and
        # the verify reads the draw back
        self._drawn: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # slots, accepted, drafted
        self.prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
        self.index = np.zeros(64, dtype=np.int64)  # slot -> request index (its prompt's token)
        self.known = np.zeros(64, dtype=np.int64)  # slot -> tokens known
        self._models: dict = {}  # op -> the model that prices it
        self._dummy = np.zeros((0, 0), dtype=np.int64)  # `_tokens`' block

    def _device_ns(self, op: str, attrs: dict) -> float:
        return self.profile.device_ns(op, attrs, self._models)

    def _register(self, regs) -> None:
        for r in regs:
            if r.slot >= self.index.shape[0]:
                size = max(r.slot + 1, 2 * self.index.shape[0])
                self.index = np.resize(self.index, size)
                self.known = np.resize(self.known, size)
            self.index[r.slot] = r.token_ids[0]
            self.known[r.slot] = len(r.token_ids)

    def _tokens(self, rows: int, width: int) -> np.ndarray:
        """[rows, width] stand-in tokens: a read-only view of one block (nobody writes a
        result's tokens; a new array per verify would cost more than the lookups)."""
        block = self._dummy
        if rows > block.shape[0] or width > block.shape[1]:
            block = self._dummy = np.full((max(rows, 2 * block.shape[0]), max(width, block.shape[1])),
                                          DUMMY_TOKEN, dtype=np.int64)
            block.flags.writeable = False
        return block[:rows, :width]

    def _outcomes(self, slots: np.ndarray, draft_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([B] accepted, [B] drafted) of rows drafting up to `draft_lens` at their positions now."""
        idx = self.index[slots]
        return self.acceptance.outcomes(idx, self.known[slots] - self.prompt_lens[idx], draft_lens)

    def draft(self, batch) -> tuple[None, np.ndarray]:
        """The pipeline's `HostDrafter` for a proposer that drafts on the host: each row's
        drafted count (none where a lookup finds nothing, at the trace's rate) drawn with its
        accepted length, which the row's verify then returns; no tokens (counts are modelled)."""
        accepted, drafted = self._outcomes(batch.slots, batch.draft_lens)
        self._drawn = (batch.slots, accepted, drafted)
        return None, drafted

    def respond(self, op: str, msg, start_ns: int):
        if op == "forward":
            if msg.register:
                self._register(msg.register)
            self.known[msg.slots[msg.samples]] += 1
            return ForwardResult(np.where(msg.samples, DUMMY_TOKEN, -1)), []
        if op == "draft":
            return DraftResult(msg.draft_lens), []
        if op == "verify":
            slots = msg.slots
            drawn, self._drawn = self._drawn, None
            if drawn is not None and drawn[0].shape == slots.shape and (drawn[0] == slots).all():
                accepted, drafted = np.minimum(drawn[1], msg.draft_lens), np.minimum(drawn[2], msg.draft_lens)
            else:
                accepted, drafted = self._outcomes(slots, msg.draft_lens)
            self.known[slots] += accepted + 1
            attrs = msg.shape.view()
            subs = [("verify", int(self._device_ns("verify", attrs))),
                    ("accept", int(self._device_ns("accept", attrs)) if "accept" in self.profile.device else 0)]
            tokens = self._tokens(len(slots), (largest(accepted) if len(accepted) else 0) + 1)
            return VerifyResult(accepted, tokens, drafted), subs
        if op == "fill":
            return FillResult(), []
        raise ValueError(f"virtual device: unknown op {op!r}")
