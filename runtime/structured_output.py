"""Structured output (vLLM's `structured_outputs`: a JSON schema, a regex or a choice of strings): at every step the
target's logits keep only the tokens the request's grammar allows next, before sampling and acceptance.

The grammar is a regular expression compiled against the tokenizer's vocabulary (outlines-core's `Index`, a token-level
automaton); each request walks it with a `Guide`. In a verify, column c is masked by the state after the drafts on its
path (a chain's columns before it, a tree's ancestors), so a draft the grammar forbids is rejected and every column
scores its draft with the distribution plain decoding would have sampled from: speculation stays lossless. After the
step the guide advances by the tokens the request kept. The proposers mask their own logits the same way while they
draft (`apply_masks` on a draft's or a tree node's logits), so drafts are text the grammar allows: forced tokens are
drafted, and accepted.

The masks need the drafts and the kept tokens on the host: a step with a structured row reads them there (a sync on a
GPU, for that step only); steps without one are untouched.
"""
from __future__ import annotations

import json
import pickle
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specsched.runtime.sync_guard import host_side, read_now, to_device
from specsched.runtime.tokenizer import Tokenizer
from specsched.scheduler.errors import InvalidRequestError

_BITS = torch.arange(32, dtype=torch.int32)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (the inverse of `bytes_to_unicode`)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer_json: dict) -> dict[bytes, list[int]]:
    """The bytes each regular token of a tokenizer.json stands for (byte-level BPE as GPT-2 and Llama 3 write them,
    or SentencePiece's '▁' and <0xNN> pieces), special tokens left out: the vocabulary a grammar is compiled for."""
    model = tokenizer_json.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    if not isinstance(vocab, dict):
        raise InvalidRequestError("structured output needs a tokenizer with a vocabulary (tokenizer.json model.vocab)")
    special = {t["id"] for t in tokenizer_json.get("added_tokens") or [] if t.get("special", True)}
    byte_level = "ByteLevel" in json.dumps(tokenizer_json.get("decoder") or {})
    decode = _byte_decoder()
    out: dict[bytes, list[int]] = {}
    for piece, i in vocab.items():
        if i in special:
            continue
        if byte_level:
            if any(c not in decode for c in piece):
                continue
            b = bytes(decode[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            b = bytes([int(piece[3:5], 16)])
        else:
            b = piece.replace("\u2581", " ").encode()
        out.setdefault(b, []).append(int(i))
    return out


class Grammars:
    """A tokenizer's grammar compiler: regex -> outlines-core `Index`, cached (a request's pattern compiles once per
    process); an `Index` compiled elsewhere is taken as is (`compiled` / `adopt`: the engine's, shipped to its worker
    with the first request of a pattern, so the worker's step does not stall while it compiles)."""

    CACHED = 64  # patterns kept, the most recently used

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer_path = tokenizer.path
        self.eos = next(iter(tokenizer.eos_token_ids), None)
        self._vocabulary = None
        self._indexes: dict[str, Any] = {}  # pattern -> Index, least recently used first
        self._lock = threading.Lock()  # the engine compiles in worker threads while its step loop reads

    @property
    def vocabulary(self):
        if self._vocabulary is None:
            from outlines_core import Vocabulary

            if self.eos is None:
                raise InvalidRequestError("structured output needs an end-of-sequence token; this tokenizer has none")
            with open(self.tokenizer_path, encoding="utf-8") as f:
                table = token_bytes(json.load(f))
            table.pop(b"", None)
            for ids in table.values():
                if self.eos in ids:
                    ids.remove(self.eos)
            self._vocabulary = Vocabulary(self.eos, {b: ids for b, ids in table.items() if ids})
        return self._vocabulary

    def index(self, pattern: str):
        """The pattern's automaton (compiled at its first use here, unless adopted)."""
        with self._lock:
            index = self._indexes.pop(pattern, None)
        if index is None:
            index = self._compile(pattern)
        self._keep(pattern, index)
        return index

    def compiled(self, pattern: str) -> bytes:
        """The pattern's automaton, pickled for another process's `adopt`."""
        return pickle.dumps(self.index(pattern))

    def adopt(self, pattern: str, compiled: bytes) -> None:
        """Take the automaton `compiled` made elsewhere for the pattern (unless it is here already)."""
        if pattern not in self._indexes:
            self._keep(pattern, pickle.loads(compiled))

    def _keep(self, pattern: str, index) -> None:
        with self._lock:
            self._indexes[pattern] = index
            if len(self._indexes) > self.CACHED:
                del self._indexes[next(iter(self._indexes))]

    def _compile(self, pattern: str):
        from outlines_core import Index

        vocabulary = self.vocabulary
        try:
            return Index(pattern, vocabulary)
        except ValueError as e:
            why = str(e)
        try:  # a syntax error: Python's message says where
            re.compile(pattern)
        except re.error as syntax:
            why = str(syntax)
        raise InvalidRequestError(f"structured output: the grammar cannot be compiled ({why})")

    def guide(self, pattern: str, max_rollback: int) -> "Guide":
        from outlines_core import Guide as _Guide

        return Guide(_Guide(self.index(pattern), max_rollback=max(max_rollback, 1)))


class Guide:
    """One request's walk through its grammar: the allowed tokens now, after a path of drafts, and the advance by the
    tokens it keeps."""

    def __init__(self, guide):
        self._g = guide
        self.dead = False  # a kept token the grammar did not allow (a stop past its end): no mask from here on

    def advance(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if self.dead:
                return
            if not self._g.accepts_tokens([int(t)]):
                self.dead = True
                return
            self._g.advance(int(t), return_tokens=False)

    def masks(self, paths: Sequence[Sequence[int]], vocab: int) -> torch.Tensor | None:
        """[len(paths), vocab] bool: the tokens allowed after each path of drafts (from the state now; a path through
        a forbidden draft masks nothing: that column is never read). None once dead."""
        if self.dead:
            return None
        words = (vocab + 31) // 32
        bits = torch.zeros((len(paths), words), dtype=torch.int32)
        for c, path in enumerate(paths):
            walked = 0
            for t in path:
                if not self._g.accepts_tokens([int(t)]):
                    break
                self._g.advance(int(t), return_tokens=False)
                walked += 1
            if walked == len(path):
                self._g.write_mask_into(bits[c].data_ptr(), words, 4)
            else:
                bits[c] = -1
            if walked:
                self._g.rollback_state(walked)
        return ((bits.unsqueeze(-1) >> _BITS) & 1).bool().view(len(paths), -1)[:, :vocab]


def column_drafts(window: np.ndarray, path: torch.Tensor, width: int) -> list[list[list[int]]]:
    """Per row of a verify, per column: the drafts on the column's path (`window` [B, W] the columns' tokens on the
    host, `path` [W, W] which come before each)."""
    on_path = host_side(path[:width, :width]).tolist()
    return [[[int(row[j]) for j in range(width) if on_path[c][j]] for c in range(width)] for row in window]


def apply_masks(logits: torch.Tensor, rows: Sequence, drafts: Sequence | None = None) -> torch.Tensor:
    """logits [B, W, V] with -inf where a structured row's grammar forbids the token at that column, after the drafts
    on the column's path (`drafts[i][c]`, `column_drafts`; None: none); the logits themselves without such a row."""
    out = None
    for i, st in enumerate(rows):
        if st.guide is None:
            continue
        allowed = st.guide.masks([[]] * logits.shape[1] if drafts is None else drafts[i], logits.shape[-1])
        if allowed is None:
            continue
        out = logits.clone() if out is None else out
        out[i].masked_fill_(~to_device(allowed, out.device), float("-inf"))
    return logits if out is None else out


def mask_next(logits: torch.Tensor, rows: Sequence, drafted: torch.Tensor) -> torch.Tensor:
    """A proposer's logits [B, V] for each row's next draft, masked by its grammar after its drafts so far (`drafted`
    [B, k] on the device, read here)."""
    return apply_masks(logits.unsqueeze(1), rows, [[d] for d in read_now(drafted).tolist()]).squeeze(1)


def advance_guides(rows: Sequence, emitted: torch.Tensor, num_accepted: torch.Tensor | None) -> None:
    """Each structured row's guide advanced by the tokens it kept: emitted [B, K] up to num_accepted + 1 (a verify's
    accepted drafts and the token after them), or all K."""
    if not any(st.guide is not None for st in rows):
        return
    tokens = read_now(emitted).tolist()
    kept = [len(t) for t in tokens] if num_accepted is None else [n + 1 for n in read_now(num_accepted).tolist()]
    for st, toks, n in zip(rows, tokens, kept):
        if st.guide is not None:
            st.guide.advance(toks[:n])
