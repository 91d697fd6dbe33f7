"""Synthetic acceptance: how many drafts a verify accepts, forced to a given rate instead of decided by the target
(vLLM's `rejection_sample_method="synthetic"`), so a schedule or draft length can be judged at a production model's
acceptance, not the proposer at hand's. The engine's verify and the simulator's acceptance model share this one
definition; a request may carry its own (`SamplingParams`).

Names and semantics are vLLM's. `synthetic_acceptance_rates` are unconditional per-position rates r_1 >= r_2 >= ...
in [0, 1]: the share of rows whose draft k is accepted (a row drafting fewer than k reads past its drafts as
rejected). `synthetic_acceptance_length` (AL, counting the bonus token: AL = 1 + sum r_k) becomes the
minimum-variance rates: 1 up to floor(AL - 1), then the fraction, then 0 (AL 3.78 at D = 7: 1, 1, 0.78, 0, ...). A
row draws one uniform u and accepts the drafts k with u < r_k (a prefix: the rates do not increase), so
P(accepted >= k) = r_k with the least variance any draw gives; `independent` draws each position on its own,
accepting draft k with probability r_k / r_(k-1) once k - 1 were.

The uniforms come from no generator's stream: each is a hash of (seed, the request's key, the position of the row's
last token; with `independent`, each draft's position) in 31-bit integer arithmetic that numpy and torch compute
alike, compared with integer thresholds. So a request's acceptance at a position is one value whatever the batch,
schedule, draft length or tensor-parallel rank, and a replay of an engine's run draws exactly its acceptance.
"""
from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


M31 = (1 << 31) - 1
ONE = 1 << 31  # a rate r is the threshold round(r * ONE) on a uniform in [0, ONE)


def request_key(request_id: str) -> int:
    """A request's 31-bit key for its synthetic draws (the same in the engine and a replay)."""
    return zlib.crc32(request_id.encode()) & M31


def _mix31(x):
    """A 31-bit hash, elementwise on numpy and torch int64 alike: every product stays below 2^58, so none overflows."""
    x = x & M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & M31
    return x ^ (x >> 16)


def keyed_uniforms(seed: int, keys, positions):
    """Uniform integers in [0, ONE), one per (key, position) under `seed` (numpy or torch int64): the key (already a
    hash) salted with the seed's hash, positions apart by an odd stride, mixed once."""
    salt = int(_mix31(np.int64(seed * 0x9E37 + 0x3C6EF372)))
    return _mix31((keys ^ salt) + positions * 0x85EB)


def accepted_counts(thresholds, draft_lens, seed: int, keys, positions, independent: bool):
    """[B] drafts accepted: thresholds [W] or [B, W], rows drafting `draft_lens` (<= W; None: W each) whose last token
    is at `positions`; written with operations numpy and torch both have (the engine computes it on the device)."""
    if independent:  # draft k (at position p + 1 + k) on its own uniform
        k = (thresholds * 0 + 1).cumsum(-1) - 1  # 0, 1, ..., W - 1 along the last axis
        ok = keyed_uniforms(seed + 1, keys[:, None], positions[:, None] + 1 + k) < thresholds
        accepted = ok.cumprod(1).sum(1)
    else:
        accepted = (keyed_uniforms(seed, keys, positions)[:, None] < thresholds).sum(1)
    return accepted if draft_lens is None else accepted.clip(max=draft_lens)


@dataclass(frozen=True)
class SyntheticAcceptance:
    synthetic_acceptance_length: float | None = None
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    independent: bool = False  # each position drawn on its own (not one uniform per row)

    def __post_init__(self) -> None:
        length, rates = self.synthetic_acceptance_length, self.synthetic_acceptance_rates
        if (length is None) == (rates is None):
            raise ValueError("synthetic acceptance needs exactly one of synthetic_acceptance_length and "
                             "synthetic_acceptance_rates")
        if length is not None and not (math.isfinite(length) and length >= 1.0):
            raise ValueError(f"synthetic_acceptance_length must be a number >= 1 (it counts the bonus token), "
                             f"got {length!r}")
        if rates is not None:
            object.__setattr__(self, "synthetic_acceptance_rates", tuple(float(r) for r in rates))
            rates = self.synthetic_acceptance_rates
            if not rates or any(not (0.0 <= r <= 1.0) for r in rates):
                raise ValueError(f"synthetic_acceptance_rates must be one or more rates in [0, 1], got {list(rates)}")
            if any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError(f"synthetic_acceptance_rates must not increase (draft k is reached only "
                                 f"when k - 1 were accepted), got {list(rates)}")

    @classmethod
    def parse(cls, spec: str) -> "SyntheticAcceptance":
        """`--acceptance synthetic:...`'s value: 'AL' or 'r1,r2,...' (a rate per position), 'independent:' prefixed
        for draws per position."""
        independent = spec.startswith("independent:")
        body = spec.removeprefix("independent:")
        try:
            values = tuple(float(v) for v in body.split(","))
        except ValueError:
            raise ValueError(f"bad synthetic acceptance {spec!r}: use AL (e.g. 2.5) or rates r1,r2,... "
                             "(e.g. 0.9,0.7,0.5), optionally after 'independent:'") from None
        if "," in body:
            return cls(synthetic_acceptance_rates=values, independent=independent)
        return cls(synthetic_acceptance_length=values[0], independent=independent)

    def check(self, max_draft_len: int) -> None:
        """ValueError where the acceptance length exceeds what a step can emit (max_draft_len + 1, bonus counted)."""
        length = self.synthetic_acceptance_length
        if length is not None and length > max_draft_len + 1 + 1e-9:
            raise ValueError(f"synthetic_acceptance_length {length} cannot be reached at draft length "
                             f"{max_draft_len} (at most {max_draft_len + 1}, counting the bonus token)")

    def rates(self, draft_len: int) -> np.ndarray:
        """[draft_len] unconditional per-position rates (0 past the rates given)."""
        length = self.synthetic_acceptance_length
        if length is None:
            r = np.zeros(draft_len)
            given = self.synthetic_acceptance_rates[:draft_len]
            r[: len(given)] = given
            return r
        return np.clip(length - 1.0 - np.arange(draft_len), 0.0, 1.0)

    def thresholds(self, draft_len: int, independent: bool | None = None) -> np.ndarray:
        """[draft_len] int64 thresholds on a uniform in [0, ONE): the rates, or `independent` (default: this one's)
        r_k / r_(k-1). Read-only, made once per (draft length, independence)."""
        return _thresholds(self, draft_len, self.independent if independent is None else independent)

    def table(self, width: int, own: "Sequence[SyntheticAcceptance | None] | None" = None) -> np.ndarray:
        """A step's thresholds: [width], or [rows, width] where some row has its own synthetic acceptance (`own[i]`,
        None for this one's), drawn with this one's independence."""
        t = self.thresholds(width)
        if own is not None and any(a is not None for a in own):
            t = np.stack([t if a is None else a.thresholds(width, self.independent) for a in own])
        return t

    def draw(self, draft_lens: np.ndarray, keys: np.ndarray, positions: np.ndarray, seed: int = 0,
             own: "list[SyntheticAcceptance | None] | None" = None) -> np.ndarray:
        """[B] drafts accepted of rows drafting `draft_lens`: row i is request `keys[i]` (`request_key`) with its last
        token at `positions[i]`; `own[i]`: its own synthetic acceptance, None for this one."""
        draft_lens = np.maximum(np.asarray(draft_lens, dtype=np.int64), 0)
        width = int(draft_lens.max(initial=0))
        if width == 0:
            return np.zeros(draft_lens.shape[0], dtype=np.int64)
        return accepted_counts(self.table(width, own), draft_lens, seed, np.asarray(keys, dtype=np.int64),
                               np.asarray(positions, dtype=np.int64), self.independent)


@functools.cache
def _thresholds(synthetic: SyntheticAcceptance, draft_len: int, independent: bool) -> np.ndarray:
    """`SyntheticAcceptance.thresholds`, made once per (acceptance, draft length, independence)."""
    r = synthetic.rates(draft_len)
    if independent:
        before = np.concatenate([[1.0], r[:-1]])
        r = np.divide(r, before, out=np.zeros_like(r), where=before > 0)
    made = np.rint(r * ONE).astype(np.int64)
    made.flags.writeable = False
    return made
