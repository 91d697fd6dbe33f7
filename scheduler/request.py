"""A request's life: waiting -> running -> (preempted -> waiting ->) finished | aborted.

Token accounting follows vLLM: `num_computed_tokens` counts tokens whose KV is in the target cache. Between steps the
last emitted token is not yet computed (it is the next step's input), so a running decode request has
num_computed_tokens == num_tokens - 1. Draft tokens are extra scheduled tokens of a step; the rejected ones roll back.
"""
from __future__ import annotations

import enum

from specsched.scheduler.sampling_params import SamplingParams
from specsched.scheduler.slot_state import SlotTable, own_counters, per_pos, spec_totals


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


FINISHED_STATES = (RequestState.FINISHED, RequestState.ABORTED)


def _counter(name: str, doc: str) -> property:
    """A Request attribute stored in its row of a SlotTable."""

    def get(self) -> int:
        t = self._table
        return self._own[name] if t is None else int(getattr(t, name)[self._row])

    def set(self, value: int) -> None:
        t = self._table
        if t is None:
            self._own[name] = int(value)
        else:
            getattr(t, name)[self._row] = value

    return property(get, set, doc=doc)


class Request:
    """A request's public handle: id, prompt, params, output ids, timings and outcome. Its scheduler counters live in
    arrays indexed by its slot (`SlotTable`), updated for every running request in whole-array operations."""

    __slots__ = ("request_id", "prompt_token_ids", "params", "arrival_ns", "slot", "state",
                 "output_token_ids", "abort_requested", "stop_at", "num_preemptions",
                 "first_token_ns", "finish_ns", "finish_reason", "error", "grammar_index", "_table", "_row", "_own")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_ns: int):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_ns = arrival_ns
        self.slot = -1  # dense index: page-table row, device state, scheduler arrays
        self.state = RequestState.WAITING
        self.output_token_ids: list[int] = []
        self.abort_requested = False
        self.stop_at: int | None = None  # a stop string ends the output after this many tokens
        self.num_preemptions = 0
        self.first_token_ns: int | None = None
        self.finish_ns: int | None = None
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.error: str | None = None
        self.grammar_index: bytes | None = None  # its grammar compiled by the engine, for the worker (pickled)
        # without a slot (not queued, or finished) the counters are the handle's own
        self._table: SlotTable | None = None
        self._row = -1
        self._own = own_counters(len(prompt_token_ids), params.max_tokens)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, state={self.state.value}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")

    num_computed_tokens = _counter("computed", "tokens with KV in the target cache")
    num_pending_tokens = _counter("pending", "sampled on the device, not yet seen by the host")
    num_proposer_computed = _counter("proposer_computed", "tokens with KV in the proposer's cache")

    def _hists(self) -> tuple:
        """The request's histograms of draft lengths and accepted counts (None, None before any draft)."""
        t = self._table
        if t is None:
            return self._own["drafted_hist"], self._own["accepted_hist"]
        return t.drafted_hist[self._row], t.accepted_hist[self._row]

    def spec_totals(self) -> tuple[int, int, int]:
        """(drafts, drafted tokens, accepted tokens), summed from the request's histograms."""
        return spec_totals(*self._hists())

    @property
    def num_drafts(self) -> int:
        """Steps in which this request was drafted for."""
        return self.spec_totals()[0]

    @property
    def num_drafted_tokens(self) -> int:
        return self.spec_totals()[1]

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens accepted."""
        return self.spec_totals()[2]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    num_output_tokens = _counter("num_output", "output tokens the host has seen: len(output_token_ids), or only "
                                 "their count where the sink wants no token ids")

    def extend_output(self, token_ids: list[int]) -> None:
        """Append tokens the host has seen (the output list and its count in the arrays)."""
        self.output_token_ids.extend(token_ids)
        self.num_output_tokens = len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, including ones sampled on the device but not yet seen."""
        return len(self.prompt_token_ids) + self.num_output_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def in_prefill(self) -> bool:
        """True while the prompt, or a token before the last, still lacks KV (prompt or recompute). A token sampled on
        the device but not yet seen counts as emitted."""
        c = self.num_computed_tokens
        n = len(self.prompt_token_ids)
        return c < n or c < n + self.num_output_tokens + self.num_pending_tokens - 1

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - self.num_output_tokens - self.num_pending_tokens

    def per_pos(self) -> tuple[list[int], list[int]]:
        """([D] drafts with >= k+1 tokens, [D] of those accepted at >= k+1)."""
        return per_pos(*self._hists())

    @property
    def drafted_per_pos(self) -> list[int]:
        return self.per_pos()[0]

    @property
    def accepted_per_pos(self) -> list[int]:
        return self.per_pos()[1]

    def spec_stats(self) -> dict:
        drafts, drafted, accepted = self.spec_totals()
        drafted_pos, accepted_pos = self.per_pos()
        return {
            "drafts": drafts,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "mean_accept_len": (1.0 + accepted / drafts) if drafts else None,
            "accepted_per_pos": [int(a) for a in accepted_pos],
            "accept_rate_per_pos": [
                a / d if d else 0.0 for a, d in zip(accepted_pos, drafted_pos)
            ],
        }
