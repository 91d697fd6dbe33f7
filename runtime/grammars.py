"""Grammars for structured output: a regular expression compiled against a tokenizer's vocabulary into outlines-core's
token automaton (`Index`), cached per pattern, in the engine's process and the worker's alike. Needs no torch (the
engine's process loads none); the worker's walks and masks are `structured_output`'s.
"""
from __future__ import annotations

import json
import pickle
import re
import threading
from collections.abc import Sequence
from typing import Any

from specsched.runtime.tokenizer import Tokenizer
from specsched.scheduler.errors import InvalidRequestError


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
    process); an `Index` compiled elsewhere is taken as is (`for_worker` / `adopt`: the engine's, shipped to its worker
    with the first request of a pattern, so the worker's step does not stall while it compiles)."""

    CACHED = 64  # patterns kept, the most recently used

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer_path = tokenizer.path
        self.eos = next(iter(tokenizer.eos_token_ids), None)
        self._vocabulary = None
        self._indexes: dict[str, Any] = {}  # pattern -> Index, least recently used first
        self._lock = threading.Lock()  # the engine compiles in worker threads while its step loop reads
        self._shipped: dict[str, None] = {}  # patterns whose automaton a request has carried to the worker
        self._forced: dict[str, dict[int, int | None]] = {}  # pattern -> state -> the one token it allows, or None

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

    def adopt(self, pattern: str, compiled: bytes) -> None:
        """Take the automaton `compiled` made elsewhere for the pattern (unless it is here already)."""
        if pattern not in self._indexes:
            self._keep(pattern, pickle.loads(compiled))

    def _keep(self, pattern: str, index) -> None:
        with self._lock:
            self._indexes[pattern] = index
            if len(self._indexes) > self.CACHED:
                dropped = next(iter(self._indexes))
                del self._indexes[dropped]
                self._forced.pop(dropped, None)

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

    def walk(self, pattern: str, max_rollback: int, kind: type["Walk"] | None = None) -> "Walk":
        """A request's walk through the pattern's automaton, stepping back over up to `max_rollback` tokens; `kind`: a
        Walk that does more (the worker's `structured_output.Guide`, which masks)."""
        from outlines_core import Guide

        index = self.index(pattern)
        with self._lock:
            forced = self._forced.setdefault(pattern, {})
        return (kind or Walk)(Guide(index, max_rollback=max(max_rollback, 1)), forced)

    def for_worker(self, pattern: str) -> bytes | None:
        """The pattern's automaton, compiled here (InvalidRequestError for a grammar that cannot be), pickled for the
        worker unless a request has taken it there already: the worker then compiles nothing inside a step."""
        index = self.index(pattern)
        with self._lock:
            if pattern in self._shipped:
                return None
            self._shipped[pattern] = None
            if len(self._shipped) > self.CACHED:  # as many as the worker keeps (one it dropped compiles there again)
                del self._shipped[next(iter(self._shipped))]
        return pickle.dumps(index)


class Walk:
    """One request's walk through its grammar: advanced by the tokens it keeps, dead after one its grammar does not
    allow (a stop past its end); `draft` proposes the tokens the grammar allows next (the host's n-gram lookup)."""

    def __init__(self, guide, forced: dict[int, int | None]):
        self._g = guide  # outlines-core's Guide
        self._forced = forced  # the pattern's states -> their forced token (shared by its walks)
        self.dead = False

    def advance(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if self.dead:
                return
            if not self._g.accepts_tokens([int(t)]):
                self.dead = True
                return
            self._g.advance(int(t), return_tokens=False)

    def forced(self) -> int | None:
        """The one token the grammar allows now (a schema's key, its punctuation, EOS at the end), or None."""
        state = self._g.get_state()
        if state not in self._forced:
            allowed = self._g.get_tokens()
            self._forced[state] = allowed[0] if len(allowed) == 1 else None
        return self._forced[state]

    def draft(self, proposal: Sequence[int], d: int) -> list[int]:
        """Up to `d` drafts from the state now (which it leaves as it was): each forced token, else the proposal's
        next while the grammar allows it and no forced token displaced the proposal."""
        out, follow, walked = [], True, 0
        for k in range(d):  # d <= the walk's max_rollback
            t = self.forced()
            if t is None:
                if not follow or k >= len(proposal) or not self._g.accepts_tokens([int(proposal[k])]):
                    break
                t = int(proposal[k])
            elif k >= len(proposal) or proposal[k] != t:
                follow = False
            out.append(t)
            try:
                self._g.advance(t, return_tokens=False)
            except ValueError:  # the end of the text (EOS): nothing follows
                break
            walked += 1
        if walked:
            self._g.rollback_state(walked)
        return out
