"""Batched token sampling with per-row parameters and per-request generators.

Every proposer and the verifier share this code: logits become probabilities through one
function (`logits_to_probs`: temperature, then top-k, then top-p), and tokens come out of one
function (`sample`). Sampling is an exponential race, argmax(p / E) with E ~ Exp(1) drawn per
row: it picks token i with probability p_i, needs no cumulative sums, and lets a seeded
request draw its noise from its own `torch.Generator`, so the same seed gives the same tokens
whatever else shares the batch. All-greedy batches never touch a softmax or a generator.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specsched.runtime.sync_guard import to_device

_TINY = torch.finfo(torch.float32).tiny


class RowParams(Protocol):
    """One row's sampling parameters, as `SamplingTensors.from_params` reads them
    (`specsched.scheduler.sampling_params.SamplingParams` and `specsched.runtime.token_state.SeqState` both fit)."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...

    @property
    def min_p(self) -> float: ...


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    generators: list[torch.Generator | None]  # [B] per-request generator, None = global RNG
    all_greedy: bool  # every row has temperature 0: argmax fast path
    any_greedy: bool | None = None  # host-side flags so the sampler never syncs to branch;
    any_top_k: bool | None = None  # None = derive from the tensors once, here
    any_top_p: bool | None = None
    max_top_k: int | None = None  # every row has 0 < top_k <= this (0: some row has no top-k)
    min_p: torch.Tensor | None = None  # [B] float32 (0 = off), None where no row has one

    def __post_init__(self) -> None:
        b = self.temperature.shape[0]
        if self.temperature.dim() != 1 or self.top_k.shape != (b,) or self.top_p.shape != (b,):
            raise ValueError(
                "SamplingTensors: temperature, top_k, top_p must all be [B], got "
                f"{tuple(self.temperature.shape)}, {tuple(self.top_k.shape)}, {tuple(self.top_p.shape)}"
            )
        if len(self.generators) != b:
            raise ValueError(f"SamplingTensors: {len(self.generators)} generators for {b} rows")
        if self.any_greedy is None:
            self.any_greedy = self.all_greedy or bool((self.temperature == 0).any())
        if self.any_top_k is None:
            self.any_top_k = bool((self.top_k > 0).any())
        if self.any_top_p is None:
            self.any_top_p = bool((self.top_p < 1.0).any())
        if self.max_top_k is None:
            self.max_top_k = int(self.top_k.max()) if b and bool((self.top_k > 0).all()) else 0

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def greedy(self) -> torch.Tensor:  # [B] bool
        return self.temperature == 0

    @classmethod
    def from_params(
        cls,
        params: Sequence[RowParams],
        generators: Sequence[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingTensors":
        """Pack per-row parameters (`SamplingParams`, or anything with their temperature, top_k
        and top_p, such as the worker's per-request state) into tensors on `device`.
        `generators` defaults to `make_generators` of the rows' `seed`s. The host-side flags are
        computed here from the float32 values the tensors hold, so building never syncs. An
        all-greedy batch (an argmax: its parameters are never read) shares cached tensors and,
        unless `generators` are given, has none."""
        temperature = [p.temperature for p in params]
        if all(t == 0 for t in temperature):
            zeros, zeros_k, ones = _greedy_tensors(len(temperature), str(device))
            return cls(temperature=zeros, top_k=zeros_k, top_p=ones,
                       generators=[None] * len(temperature) if generators is None else list(generators),
                       all_greedy=True, any_greedy=True, any_top_k=False, any_top_p=False, max_top_k=0)
        if generators is None:
            generators = make_generators([p.seed for p in params], device)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return cls(
            temperature=to_device(temperature, torch.device(device), torch.float32),
            top_k=to_device(top_k, torch.device(device), torch.int64),
            top_p=to_device(top_p, torch.device(device), torch.float32),
            generators=list(generators),
            all_greedy=False,  # the all-greedy batch returned above
            any_greedy=bool((np.asarray(temperature, dtype=np.float32) == 0).any()),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=bool((np.asarray(top_p, dtype=np.float32) < 1.0).any()),
            max_top_k=max(top_k, default=0) if all(k > 0 for k in top_k) else 0,
            min_p=to_device(min_p, torch.device(device), torch.float32) if any(m > 0 for m in min_p) else None,
        )

    @classmethod
    def greedy_batch(cls, batch_size: int, device: torch.device | str = "cpu") -> "SamplingTensors":
        return cls(
            temperature=torch.zeros(batch_size, device=device),
            top_k=torch.zeros(batch_size, dtype=torch.int64, device=device),
            top_p=torch.ones(batch_size, device=device),
            generators=[None] * batch_size,
            all_greedy=True,
            any_greedy=True,
            any_top_k=False,
            any_top_p=False,
            max_top_k=0,
        )


@functools.lru_cache(maxsize=64)
def _greedy_tensors(batch_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An all-greedy batch's temperature (0), top_k (0) and top_p (1) on `device`, built once
    per batch size: building them and their flags per op cost ~37 us for one row on the CPU
    (a draft launch builds them once per drafted token)."""
    return (torch.zeros(batch_size, device=device), torch.zeros(batch_size, dtype=torch.int64, device=device),
            torch.ones(batch_size, device=device))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with `seed`, or None (the global RNG) for unseeded requests."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def make_generators(
    seeds: Sequence[int | None], device: torch.device | str = "cpu"
) -> list[torch.Generator | None]:
    return [make_generator(s, device) for s in seeds]


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    any_top_k: bool = True,
    any_top_p: bool = True,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Mask logits [B, V] to -inf outside each row's top-k, then outside its top-p nucleus.

    top-k keeps every token whose logit ties the k-th largest (as HF and vLLM do). top-p keeps
    the smallest prefix of the descending order whose probability mass reaches top_p, so at
    least one token always survives. Rows with top_k == 0 / top_p >= 1 are left as they are;
    `any_top_k` / `any_top_p` = False skip a filter for the whole batch. `max_top_k` > 0
    promises every row has 0 < top_k <= max_top_k: then only the max_top_k largest logits are
    ordered (torch.topk) instead of sorting the vocabulary, and ties past them are dropped.
    """
    if not any_top_k and not any_top_p:
        return logits
    vocab = logits.shape[-1]
    if 0 < max_top_k < vocab:
        sorted_logits, sorted_idx = logits.topk(max_top_k, dim=-1)
        out = torch.full_like(logits, float("-inf"))
    else:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        out = torch.empty_like(logits)
    if any_top_k:
        use_k = (top_k > 0).unsqueeze(-1)
        kth = (top_k.clamp(1, sorted_logits.shape[-1]) - 1).unsqueeze(-1)
        drop_k = (sorted_logits < sorted_logits.gather(-1, kth)) & use_k
        sorted_logits = sorted_logits.masked_fill(drop_k, float("-inf"))
    if any_top_p:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_p = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
        drop_p[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop_p, float("-inf"))
    return out.scatter_(-1, sorted_idx, sorted_logits)


def logits_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Logits [B, V] -> float32 probabilities [B, V]: temperature, top-k, top-p, then min-p (tokens below min_p times
    the most likely one's probability dropped, vLLM's order); greedy rows become one-hot at the argmax."""
    if logits.dim() != 2 or logits.shape[0] != st.batch_size:
        raise ValueError(f"logits must be [B={st.batch_size}, V], got {tuple(logits.shape)}")
    if st.all_greedy:
        return _one_hot_argmax(logits)
    greedy = st.greedy
    temperature = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits.float() / temperature.unsqueeze(-1)
    masked = apply_top_k_top_p(scaled, st.top_k, st.top_p, st.any_top_k, st.any_top_p, st.max_top_k)
    probs = masked.softmax(dim=-1)
    if st.min_p is not None:
        probs = probs.masked_fill(probs < st.min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if st.any_greedy:
        probs = torch.where(greedy.unsqueeze(-1), _one_hot_argmax(logits), probs)
    return probs


def exponential_noise(
    shape: tuple[int, ...], generators: Sequence[torch.Generator | None], device: torch.device | str
) -> torch.Tensor:
    """Exp(1) noise [B, ...]: seeded rows from their own generator, the rest from the global RNG.
    Drawn as -log(1 - U) (inverse CDF): faster on CPU than `Tensor.exponential_`."""
    uniform = uniform_noise(shape, generators, device)
    return uniform.neg_().log1p_().neg_().clamp_min_(_TINY)


def uniform_noise(
    shape: tuple[int, ...], generators: Sequence[torch.Generator | None], device: torch.device | str,
    row_lens: Sequence[int] | None = None,
) -> torch.Tensor:
    """U[0, 1) noise [B, ...] drawn like `exponential_noise`. `row_lens`: a seeded row i draws only its first
    row_lens[i] entries (1 elsewhere), so what it draws does not depend on the longest row of its batch."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if row_lens is not None:
        noise.fill_(1.0)
    return _fill_rows(noise, generators, lambda t, g: t.uniform_(generator=g), row_lens)


def _fill_rows(noise: torch.Tensor, generators: Sequence[torch.Generator | None], fill,
               row_lens: Sequence[int] | None = None) -> torch.Tensor:
    if len(generators) != noise.shape[0]:
        raise ValueError(f"{len(generators)} generators for {noise.shape[0]} rows")
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < noise.shape[0]:
        fill(noise, None)
    for i in seeded:
        if row_lens is None:
            fill(noise[i], generators[i])
        elif row_lens[i] > 0:
            fill(noise[i, : row_lens[i]], generators[i])
    return noise


def sample(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row of `probs` [B, V] -> int64 [B].

    `greedy` [B] bool marks rows that must take the argmax (one-hot rows give their argmax
    anyway). Branch-free, so it never waits on the device; use `sample_logits` for the
    all-greedy fast path.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, V], got {tuple(probs.shape)}")
    noise = exponential_noise(tuple(probs.shape), generators, probs.device)
    tokens = (probs.float() / noise).argmax(dim=-1)
    if greedy is not None:
        tokens = torch.where(greedy, probs.argmax(dim=-1), tokens)
    return tokens


def sample_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Logits [B, V] -> tokens [B]; all-greedy batches are a single argmax."""
    if st.all_greedy:
        if logits.dim() != 2 or logits.shape[0] != st.batch_size:
            raise ValueError(f"logits must be [B={st.batch_size}, V], got {tuple(logits.shape)}")
        return logits.argmax(dim=-1)
    return sample(logits_to_probs(logits, st), st.generators, st.greedy if st.any_greedy else None)
