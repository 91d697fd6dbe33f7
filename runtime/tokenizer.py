"""Tokenizer wrapper over Hugging Face `tokenizers` (tokenizer.json), with streaming decode.

Why: the engine needs ids in and text out, streamed token by token. Byte-level BPE tokens can
end in the middle of a UTF-8 character, so the text of a growing id list is not the
concatenation of per-token texts; `IncrementalDecoder` emits only text that is final (the
prefix/read offset scheme of vLLM and TGI). `fingerprint()` hashes the vocabulary so a
draft whose tokenizer differs from the target's is caught before any token is compared.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
_BOS_NAMES = ("<|bos|>", "<s>", "<|begin_of_text|>", "<bos>")
_EOS_NAMES = ("<|eos|>", "</s>", "<|end_of_text|>", "<|eot_id|>", "<eos>", "<|endoftext|>")
_REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read or lacks what the runtime needs."""


class Tokenizer:
    """`path` is a tokenizer.json or a directory holding one (and optionally config.json /
    generation_config.json / tokenizer_config.json, from which bos/eos ids are read)."""

    def __init__(self, path: str | Path, *, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] | int | None = None) -> None:
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"tokenizer file not found: {file}")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"cannot read tokenizer {file}: {exc}") from None
        self.path = file
        meta = _read_special_ids(file.parent)
        self.bos_token_id = bos_token_id if bos_token_id is not None else meta.get("bos")
        if self.bos_token_id is None:
            self.bos_token_id = self._first_known(_BOS_NAMES)
        eos = eos_token_ids if eos_token_ids is not None else meta.get("eos")
        if eos is None:
            found = self._first_known(_EOS_NAMES)
            eos = [] if found is None else [found]
        self.eos_token_ids: tuple[int, ...] = (eos,) if isinstance(eos, int) else tuple(eos)

    def _first_known(self, names: Sequence[str]) -> int | None:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def token(self, token_id: int | None) -> str:
        """A token's text as the vocabulary spells it (a special token's name); "" for None."""
        return "" if token_id is None else self._tok.id_to_token(token_id) or ""

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False, special_tokens: bool = False) -> list[int]:
        """`text`'s token ids; `special_tokens`: with those the tokenizer's post-processor adds (Llama's BOS; none for
        Qwen), as transformers and vLLM encode a prompt."""
        ids = self._tok.encode(text, add_special_tokens=special_tokens).ids
        if add_bos:
            if self.bos_token_id is None:
                raise TokenizerError(f"add_bos=True but {self.path} has no BOS token")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the vocabulary (token -> id, added tokens included): equal
        fingerprints mean ids mean the same strings in both tokenizers."""
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        blob = json.dumps(vocab, ensure_ascii=False, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def incremental_decoder(self, prompt_ids: Sequence[int] = ()) -> "IncrementalDecoder":
        return IncrementalDecoder(self, prompt_ids)


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas, holding back incomplete characters.

    `push(all_ids)` takes every id generated so far (prompt ids excluded or given at
    construction as context; the list only grows) and returns the text that became final
    since the last call; `held` is the text decoded past it but held back (it ends with an
    incomplete character), for callers that must look at it early (stop strings);
    `flush()` returns whatever is held back (at end of stream). Each push decodes a window
    of a few ids, never the whole output.
    """

    _CONTEXT = 5  # ids re-decoded before the unread ones, so merges at the seam are right

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self._prompt = list(prompt_ids)
        start = max(0, len(self._prompt) - self._CONTEXT)
        self._prefix_offset = start  # index into prompt+output of the context window
        self._read_offset = len(self._prompt)  # everything before this has been emitted
        self._ids: list[int] = list(self._prompt)
        self.held = ""

    def push(self, all_ids: Sequence[int]) -> str:
        self._ids.extend(all_ids[len(self._ids) - len(self._prompt) :])  # only the new ids
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self.tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            self.held = full_text[len(prefix_text) :]
            return ""  # nothing new, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.held = ""
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self.tokenizer.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        self.held = ""
        return full_text[len(prefix_text) :]


def _read_special_ids(directory: Path) -> dict:
    """bos/eos ids from generation_config.json, then config.json, when present."""
    out: dict = {}
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(raw, dict):  # not settings: the checkpoint loader names the file
            continue
        if "bos" not in out and isinstance(raw.get("bos_token_id"), int):
            out["bos"] = raw["bos_token_id"]
        eos = raw.get("eos_token_id")
        if "eos" not in out and (isinstance(eos, int) or
                                 (isinstance(eos, list) and all(isinstance(e, int) for e in eos))):
            out["eos"] = eos
    return out
