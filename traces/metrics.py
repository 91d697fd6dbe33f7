"""Run metrics from a trace: the one definition bench, stats and the simulator all use.

Why: a number like "bubble fraction" is only comparable between a real run and a simulated
one if both come from the same code on the same records. Pure Python/numpy; interval
arithmetic is vectorized, so 100k spans take well under a second.
"""
from __future__ import annotations

import itertools
import math
import os
from array import array
from typing import Any

import numpy as np

from specsched.traces.schema import DEVICE_TRACK_PREFIX, HOST_TRACK, RANK_TRACK_PREFIX, Trace, stage_order

PERCENTILES = (50, 90, 99)


def compute_metrics(trace: Trace) -> dict[str, Any]:
    """The run's metrics as a JSON-ready dict with exactly these keys.

    - `requests`: number of finished requests (finish records, any finish reason).
    - `requests_failed`: finish records with reason `error` (a failed device op, a crashed
      device); `requests_aborted`: those with reason `abort` (cancelled, aborted, shut down).
    - `output_tokens`: sum of `output_len` over finish records.
    - `duration_s`: first request arrival -> last finish (0.0 without both).
    - `output_tokens_per_s`: output_tokens / duration_s (None when duration_s is 0).
    - `ttft_ms`: {p50, p90, p99} of time to first token over finished requests that got one
      (`ttft_ns`, else `first_token_ns - arrival_ns`); percentiles interpolate linearly
      (numpy's default); None values when there are no samples.
    - `tpot_ms`: {p50, p90, p99} of time per output token after the first,
      `(finish_ns - first_token_ns) / (output_len - 1)`, over requests with output_len > 1.
    - `steps`: number of step records.
    - `mean_accept_len`: tokens emitted per speculative step, 1 + accepted / drafts, where a
      draft is one (request, step) with num_drafted > 0 and `accepted` sums num_accepted
      over drafts (accepted draft tokens; the 1 is the bonus/recovered token). None when
      there are no drafts.
    - `accept_rate_per_pos`: list over draft positions k = 1..max num_drafted: among drafts
      with num_drafted >= k, the fraction with num_accepted >= k. Empty without drafts.
    - `device_busy_fraction`: length of the union of all `device:*` span intervals, clipped
      to [first arrival, last finish], divided by that duration (None when it is 0).
    - `bubble_fraction`: time during which at least one request has arrived and not
      finished (a request never finished counts until the trace's last timestamp) while no
      device span is running, divided by the time at least one such request exists (None
      when that time is 0). Intervals are half-open [start, end).
    - `host_ms_per_step`: {stage: total duration of `host` spans with that name / number of
      step records, in ms}, stages in pipeline order, plus "total": the host's work, the sum
      over every stage but `sync` (its wait on the device) (only "total" = 0.0 without step
      records).
    - `draft_len_counts`: {D: number of steps} over the steps whose D the adaptive draft length
      chose (`draft_len="auto"`; D = 0 is a plain decode step), keys as strings in increasing D;
      empty for a fixed draft length.
    """
    return _accumulated(trace).metrics()


def compute_metrics_file(path: str | os.PathLike) -> dict[str, Any]:
    """`compute_metrics` of a trace file, read as a stream: memory grows with the device
    spans and requests (a few numbers each), not with the file. A cut-off last line (a
    killed run) is dropped, as `read_trace(allow_truncated_tail=True)` does."""
    from specsched.traces.reader import iter_records

    acc = MetricsAccumulator()
    for rec in itertools.islice(iter_records(path, allow_truncated_tail=True), 1, None):
        acc.add(rec)
    return acc.metrics()


class MetricsAccumulator:
    """What `compute_metrics` needs of a trace, gathered one record at a time, in any order:
    per request its arrival and finish, the device intervals, host time per stage, and the
    drafted/accepted counts of drafting rows."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int]] = []  # (request_id, arrival_ns), in record order
        self.finishes: list[tuple] = []  # (request_id, finish_ns, output_len, first_token_ns, ttft_ns, reason)
        self.device_starts, self.device_ends = array("q"), array("q")
        self.host_ns: dict[str, int] = {}
        self.num_steps = 0
        # per step record its rows' (num_drafted, num_accepted), joined when the metrics are asked
        self._drafted: list[list[int]] = []
        self._accepted: list[list[int]] = []
        self.draft_lens: dict[int, int] = {}  # adaptive D -> steps
        self.start_ns: int | None = None  # `Trace.start_ns` / `end_ns` of what was added
        self.end_ns: int | None = None

    def _seen(self, start_ns: int | None, end_ns: int) -> None:
        if start_ns is not None and (self.start_ns is None or start_ns < self.start_ns):
            self.start_ns = start_ns
        if self.end_ns is None or end_ns > self.end_ns:
            self.end_ns = end_ns

    def add(self, rec: Any) -> None:
        kind = rec.type
        if kind == "span":
            if rec.track == HOST_TRACK:
                self.host_ns[rec.name] = self.host_ns.get(rec.name, 0) + (rec.end_ns - rec.start_ns)
            elif rec.track.startswith(DEVICE_TRACK_PREFIX) and not rec.track.startswith(RANK_TRACK_PREFIX):
                self.device_starts.append(rec.start_ns)
                self.device_ends.append(rec.end_ns)
            self._seen(rec.start_ns, rec.end_ns)
        elif kind == "step":
            self.num_steps += 1
            if rec.draft_len is not None:
                self.draft_lens[rec.draft_len] = self.draft_lens.get(rec.draft_len, 0) + 1
            d, a = rec.num_drafted, rec.num_accepted
            if d:
                if len(a) != len(d):  # as zip pairs them
                    d, a = d[: len(a)], a[: len(d)]
                self._drafted.append(d)
                self._accepted.append(a)
            self._seen(rec.start_ns, rec.end_ns)
        elif kind == "request":
            self.requests.append((rec.request_id, rec.arrival_ns))
            self._seen(rec.arrival_ns, rec.arrival_ns)
        elif kind == "finish":
            self.finishes.append((rec.request_id, rec.finish_ns, rec.output_len, rec.first_token_ns,
                                  rec.ttft_ns, rec.finish_reason))
            self._seen(None, rec.finish_ns)

    def add_spans(self, spans) -> None:
        """`add` for many span records (most of a trace's records), in one loop."""
        host, starts, ends = self.host_ns, self.device_starts, self.device_ends
        lo, hi = self.start_ns, self.end_ns
        for rec in spans:
            track, s, e = rec.track, rec.start_ns, rec.end_ns
            if track == HOST_TRACK:
                host[rec.name] = host.get(rec.name, 0) + (e - s)
            elif track.startswith(DEVICE_TRACK_PREFIX) and not track.startswith(RANK_TRACK_PREFIX):
                starts.append(s)
                ends.append(e)
            if lo is None or s < lo:
                lo = s
            if hi is None or e > hi:
                hi = e
        self.start_ns, self.end_ns = lo, hi

    def device_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """Merged device-busy intervals."""
        return merge_intervals(np.frombuffer(self.device_starts, dtype=np.int64),
                               np.frombuffer(self.device_ends, dtype=np.int64))

    def pending_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """Merged intervals during which at least one request has arrived and not finished;
        a request never finished counts until the last timestamp."""
        finish_ns = {f[0]: f[1] for f in self.finishes}
        open_end_ns = self.end_ns or 0
        starts = [a for _, a in self.requests]
        ends = [finish_ns.get(rid, open_end_ns) for rid, _ in self.requests]
        return merge_intervals(np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64))

    def bubble_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """Merged intervals with requests pending and no device span running."""
        return subtract_intervals(*self.pending_intervals(), *self.device_intervals())

    def metrics(self) -> dict[str, Any]:
        arrival_ns = dict(self.requests)
        finishes = self.finishes
        output_tokens = sum(f[2] for f in finishes)
        start_ns = min(arrival_ns.values()) if arrival_ns else None
        end_ns = max((f[1] for f in finishes), default=None)
        duration_ns = end_ns - start_ns if start_ns is not None and end_ns is not None else 0
        duration_ns = max(duration_ns, 0)
        duration_s = duration_ns / 1e9

        ttft_ns = [ttft if ttft is not None else first - arrival_ns[rid]
                   for rid, _, _, first, ttft, _ in finishes
                   if ttft is not None or (first is not None and rid in arrival_ns)]
        tpot_ns = [(fin - first) / (n - 1) for _, fin, n, first, _, _ in finishes
                   if n > 1 and first is not None]

        device_s, device_e = self.device_intervals()
        busy_ns = 0
        if duration_ns > 0:
            busy_ns = int(np.clip(device_e, start_ns, end_ns).sum()
                          - np.clip(device_s, start_ns, end_ns).sum())
        pending_s, pending_e = self.pending_intervals()
        pending_ns = int((pending_e - pending_s).sum())
        bubble_s, bubble_e = subtract_intervals(pending_s, pending_e, device_s, device_e)
        bubble_ns = int((bubble_e - bubble_s).sum())

        mean_accept_len, accept_rate_per_pos = self._acceptance()
        return {
            "requests": len(finishes),
            "requests_failed": sum(1 for f in finishes if f[5] == "error"),
            "requests_aborted": sum(1 for f in finishes if f[5] == "abort"),
            "output_tokens": output_tokens,
            "duration_s": duration_s,
            "output_tokens_per_s": output_tokens / duration_s if duration_ns > 0 else None,
            "ttft_ms": _percentiles_ms(ttft_ns),
            "tpot_ms": _percentiles_ms(tpot_ns),
            "steps": self.num_steps,
            "mean_accept_len": mean_accept_len,
            "accept_rate_per_pos": accept_rate_per_pos,
            "device_busy_fraction": busy_ns / duration_ns if duration_ns > 0 else None,
            "bubble_fraction": bubble_ns / pending_ns if pending_ns > 0 else None,
            "host_ms_per_step": _host_ms_per_step(self.host_ns, self.num_steps),
            "draft_len_counts": {str(d): n for d, n in sorted(self.draft_lens.items())},
        }

    def drafts(self) -> tuple[np.ndarray, np.ndarray]:
        """(num_drafted, num_accepted) of every row that drafted (num_drafted > 0), in record order."""
        if not self._drafted:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        drafted = np.fromiter(itertools.chain.from_iterable(self._drafted), dtype=np.int64)
        accepted = np.fromiter(itertools.chain.from_iterable(self._accepted), dtype=np.int64)
        keep = drafted > 0
        return drafted[keep], accepted[keep]

    def _acceptance(self) -> tuple[float | None, list[float]]:
        drafted, accepted = self.drafts()
        if drafted.size == 0:
            return None, []
        mean_accept_len = 1.0 + int(accepted.sum()) / int(drafted.size)
        rates = []
        for k in range(1, int(drafted.max()) + 1):
            reached = drafted >= k
            rates.append(int((accepted[reached] >= k).sum()) / int(reached.sum()))
        return mean_accept_len, rates


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals [start, end) as sorted, disjoint, non-touching int64 arrays."""
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    new_group = np.empty(starts.size, dtype=bool)
    new_group[0] = True
    new_group[1:] = starts[1:] > ends[:-1]
    last_of_group = np.append(np.flatnonzero(new_group)[1:] - 1, starts.size - 1)
    return starts[new_group], ends[last_of_group]


def subtract_intervals(a_s: np.ndarray, a_e: np.ndarray, b_s: np.ndarray,
                       b_e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merged intervals A minus merged intervals B (both from `merge_intervals`)."""
    if a_s.size == 0 or b_s.size == 0:
        return a_s, a_e
    points = np.unique(np.concatenate([a_s, a_e, b_s, b_e]))
    seg_s, seg_e = points[:-1], points[1:]
    keep = _member(a_s, a_e, seg_s) & ~_member(b_s, b_e, seg_s)
    return merge_intervals(seg_s[keep], seg_e[keep])


def pending_intervals(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Merged intervals during which at least one request has arrived and not finished."""
    return _accumulated(trace).pending_intervals()


def bubble_intervals(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Merged intervals with requests pending and no device span running."""
    return _accumulated(trace).bubble_intervals()


def _accumulated(trace: Trace) -> MetricsAccumulator:
    acc = MetricsAccumulator()
    for rec in trace.requests:
        acc.add(rec)
    acc.add_spans(trace.spans)
    for records in (trace.steps, trace.finishes):
        for rec in records:
            acc.add(rec)
    return acc


def _member(s: np.ndarray, e: np.ndarray, points: np.ndarray) -> np.ndarray:
    idx = np.searchsorted(s, points, side="right") - 1
    inside = idx >= 0
    inside[inside] = points[inside] < e[idx[inside]]
    return inside


def _percentiles_ms(values_ns: list[float]) -> dict[str, float | None]:
    if not values_ns:
        return {f"p{p}": None for p in PERCENTILES}
    qs = percentiles(values_ns, PERCENTILES)
    return {f"p{p}": q / 1e6 for p, q in zip(PERCENTILES, qs)}


def percentiles(values: list[float], qs: tuple[float, ...]) -> list[float]:
    """`np.percentile(values, qs)` (linear interpolation), bit for bit, in plain Python:
    the numpy call costs ~25 us, a tenth of a small replay's metrics. Finite values only."""
    v = sorted(map(float, values))
    last = len(v) - 1
    out = []
    for q in qs:
        at = last * (q / 100)  # numpy's virtual index for "linear"
        if at >= last:
            out.append(v[last])
            continue
        i = max(math.floor(at), 0)
        gamma, a, b = at - i, v[i], v[i + 1]
        diff = b - a
        # numpy's `_lerp`: from the nearer end, so that gamma = 1 gives b exactly
        out.append(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma)
    return out


def _host_ms_per_step(total_ns: dict[str, int], num_steps: int) -> dict[str, float]:
    if num_steps == 0:
        return {"total": 0.0}
    per_step = {name: total_ns[name] / num_steps / 1e6 for name in stage_order(set(total_ns))}
    per_step["total"] = sum(ms for name, ms in per_step.items() if name != "sync")  # waiting is not work
    return per_step
