"""A request's streamed text with its stop strings applied (the request consumer's output stage).

Why a module of its own: detokenization runs in each request's consumer (`AsyncEngine.generate`),
not in the pipeline's step loop, and its stop-string rules are a small state machine worth
testing alone.
"""
from __future__ import annotations

from specsched.runtime.tokenizer import Tokenizer


class Detokenizer:
    """A request's streamed text, with its stop strings applied.

    Why: re-decoding the whole output for every new token made streaming O(n^2) in the output
    length. `IncrementalDecoder` decodes a window of a few ids per token and never emits an
    incomplete UTF-8 character, so this class only adds the stop strings on top. A stop string
    may span tokens, so text that could be its start is held back (`_pending`) until it is
    resolved; the token that completes a stop string is the last one kept, and the text is cut
    before the stop string (never streamed), or after it with `include_stop`. Stop strings are also looked for in the text the
    decoder holds back (bar its incomplete last character), so a token that completes a stop
    string and starts a multi-byte character still ends the request at that token.
    """

    def __init__(self, tok: Tokenizer, include_stop: bool = False):
        # the text is that of the output ids alone, as `decode` gives it
        self._dec = tok.incremental_decoder()
        self._ids: list[int] = []
        self._pending = ""  # final text not streamed yet: it could be the start of a stop string
        self._stopped = False
        self._include_stop = include_stop

    def add(self, token_ids: list[int], stops: list[str]) -> tuple[int, str | None, str]:
        """Returns (tokens to keep, "stop" or None, text to stream now)."""
        out: list[str] = []
        for j, t in enumerate(token_ids):
            self._ids.append(t)
            self._pending += self._dec.push(self._ids)
            if not stops:
                out.append(self._pending)
                self._pending = ""
                continue
            text = self._pending + self._dec.held.rstrip("\ufffd")  # bar the incomplete char
            hits = [(k, k + len(s)) for k, s in ((text.find(s), s) for s in stops) if k >= 0]
            if hits:
                start, end = min(hits)
                out.append(text[: end if self._include_stop else start])
                self._pending = ""
                self._stopped = True
                return j + 1, "stop", "".join(out)
            cut = min(_stop_start(text, stops), len(self._pending))
            out.append(self._pending[:cut])
            self._pending = self._pending[cut:]
        return len(token_ids), None, "".join(out)

    def flush(self) -> str:
        """The held-back text at the end of the request (nothing after a stop string)."""
        if self._stopped:
            return ""
        tail, self._pending = self._pending + self._dec.flush(), ""
        return tail


def _stop_start(text: str, stops: list[str]) -> int:
    """Start of the longest suffix of `text` that some stop string begins with (len(text) if
    none); `text` holds no whole stop string."""
    longest = max(map(len, stops))
    for p in range(max(0, len(text) - longest + 1), len(text)):
        if any(s.startswith(text[p:]) for s in stops):
            return p
    return len(text)
