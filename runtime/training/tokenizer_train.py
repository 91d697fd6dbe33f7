"""Byte-level BPE tokenizer for the bundled models, trained on the corpus in seconds.

Why byte-level: every byte sequence round-trips, so any Python source (or any prompt) encodes
without unknown tokens. `<|bos|>` and `<|eos|>` are the only special tokens; training data
appends `<|eos|>` after each file.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
DEFAULT_VOCAB_SIZE = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE on `texts`; special tokens get ids 0 (bos) and 1 (eos)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} must cover the 256 byte tokens plus specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"trained vocab has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def special_ids(tok: Tokenizer) -> tuple[int, int]:
    """(bos_id, eos_id) of a tokenizer trained here."""
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if None in ids:
        raise ValueError(f"tokenizer lacks special tokens {SPECIAL_TOKENS}")
    return ids[0], ids[1]
