"""A request's state on the device: its tokens by slot (`TokenBuffer`) and the rest (`SeqState`).

Why on the device: the tokens the device produces (samples, accepted drafts, bonus tokens) are
inputs of the next launch, which the host plans without waiting for them; so ops gather their
input ids and write what they emit by tensor indexing, at positions their messages give.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specsched.runtime.sync_guard import to_device
from specsched.scheduler.plan import concat_ranges


@dataclass
class SeqState:
    """A request's state on the device besides its tokens (in `TokenBuffer`, by slot)."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None
    synthetic: Any = None  # its own synthetic acceptance (a SyntheticAcceptance), None: the engine's
    key: int = 0  # its synthetic draws' key (scheduler/synthetic.py `request_key`)
    logprobs: int | None = None  # `SamplingParams.logprobs`: its tokens' log-probabilities and this many top ones
    min_p: float = 0.0
    prompt_logprobs: int | None = None  # `SamplingParams.prompt_logprobs`
    prompt_len: int = 0
    min_tokens: int = 0  # before this many output tokens, `suppress` (EOS, stop token ids) may not be generated
    suppress: tuple[int, ...] = ()
    adjust: Any = None  # its logit bias and penalties (a `LogitsAdjust`), None: none
    guide: Any = None  # its structured output's walk (`runtime.structured_output.Guide`), None: none
    prompt_seen: torch.Tensor | None = None  # [V] bool, its prompt's tokens (for repetition_penalty), made at first use
    carried: torch.Tensor | None = None  # [V] proposer logits for the next token
    draft_len: int = 0  # this step's drafts in the worker's draft buffer (known without a sync)
    draft_q: torch.Tensor | None = None  # [D, V] draft distributions (sampled requests)
    extra: dict = field(default_factory=dict)  # proposer-specific state

    @classmethod
    def registered(cls, r: Any, generator: torch.Generator | None) -> "SeqState":
        """A request's state from its registration (`scheduler.messages.Registration`)."""
        return cls(float(r.temperature), int(r.top_k), float(r.top_p), generator, r.synthetic, r.key, r.logprobs,
                   float(r.min_p), r.prompt_logprobs, r.prompt_len, r.min_tokens, tuple(r.suppress), r.adjust)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def scored(self) -> bool:
        """Whether a step reads this row's logits beyond sampling: log-probabilities, or min_tokens holding tokens back,
        or a logit bias, a penalty or a grammar changing them."""
        return (self.logprobs is not None or self.prompt_logprobs is not None or self.min_tokens > 0
                or self.adjust is not None or self.guide is not None)


class TokenBuffer:
    """Every request's tokens on the device, `[slots, max_len]` int64 by slot: ops gather their
    input ids and write sampled / accepted tokens with tensor indexing, so no op reads a
    token on the host. Positions come from the messages (the host knows every row's length)."""

    def __init__(self, max_len: int, device: torch.device):
        self.max_len = max_len
        self.device = device
        self.data = torch.zeros((8, max_len), dtype=torch.int64, device=device)

    def register(self, slot: int, token_ids: list[int]) -> None:
        if slot >= self.data.shape[0]:
            grown = torch.zeros((max(slot + 1, 2 * self.data.shape[0]), self.max_len), dtype=torch.int64,
                                device=self.device)
            grown[: self.data.shape[0]] = self.data
            self.data = grown
        if len(token_ids) > self.max_len:
            raise ValueError(f"slot {slot}: {len(token_ids)} tokens exceed the buffer's {self.max_len}")
        self.data[slot, : len(token_ids)] = to_device(token_ids, self.device, torch.int64)

    def ranges(self, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> torch.Tensor:
        """Tokens [starts[i], ends[i]) of each row, concatenated (host arrays in, device out)."""
        lens = ends - starts
        if lens.size and lens.min() == 1 and lens.max() == 1:  # decode rows: one token each
            return self.at(slots, starts)
        return self.at(np.repeat(slots, lens), concat_ranges(starts, lens))

    def at(self, slots: Any, positions: Any) -> torch.Tensor:
        """Tokens at (slots[i], positions[i]): index arrays (host or device) in, device out."""
        return self.data.view(-1)[self._flat(slots, positions)]

    def write(self, slots: Any, positions: Any, values: torch.Tensor) -> None:
        self.data.view(-1)[self._flat(slots, positions)] = values.to(torch.int64).reshape(-1)

    def after(self, slots: Any, starts: Any, width: int) -> torch.Tensor:
        """[B, width] the tokens right after each row's position starts[i] (a step's drafts)."""
        return self.at(*_after(slots, starts, width)).view(len(slots), width)

    def write_after(self, slots: Any, starts: Any, values: torch.Tensor) -> None:
        """values [B, w] right after each row's position starts[i] (a step's drafts, its emitted tokens)."""
        self.write(*_after(slots, starts, values.shape[1]), values)

    def _flat(self, slots: Any, positions: Any) -> torch.Tensor:
        """One index into the flattened buffer (one index costs less than two)."""
        if isinstance(slots, torch.Tensor) or isinstance(positions, torch.Tensor):
            s = to_device(np.asarray(slots), self.device) if not isinstance(slots, torch.Tensor) else slots
            p = to_device(np.asarray(positions), self.device) if not isinstance(positions, torch.Tensor) else positions
            return (s * self.max_len + p).reshape(-1)
        flat = np.asarray(slots, dtype=np.int64) * self.max_len + np.asarray(positions, dtype=np.int64)
        return to_device(np.ascontiguousarray(flat.reshape(-1)), self.device)


def _after(slots: Any, starts: Any, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots, positions) of `width` tokens after each row's position starts[i]."""
    return np.repeat(np.asarray(slots), width), (np.asarray(starts)[:, None] + 1 + np.arange(width)).reshape(-1)
