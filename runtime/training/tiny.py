"""A random tiny model family on disk -- target, optional draft cut from it, optional trained
MTP head, optional tokenizer -- for tests and examples that need real checkpoints in seconds.

Why a module of its own: it trains a head (runtime/training/mtp.py), which itself validates
heads through runtime/training/mtp_eval.py; keeping the builder apart keeps those two from
importing each other.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from specsched.runtime.checkpoint import save_llama

if TYPE_CHECKING:
    from tokenizers import Tokenizer


TINY_TOKENIZER_SOURCES = ("json/decoder.py", "json/encoder.py", "textwrap.py")  # stdlib files


class TinyFamily(NamedTuple):
    """Directories written by `write_tiny_family` (None: not written)."""

    target: str
    head: str | None
    draft: str | None = None


def write_tiny_tokenizer(out_dir, vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE (`<|bos|>`=0, `<|eos|>`=1) trained in a second on a few stdlib
    sources, saved as `out_dir`/tokenizer.json."""
    import sysconfig

    from specsched.runtime.training.tokenizer_train import train_tokenizer

    root = Path(sysconfig.get_paths()["stdlib"])
    tok = train_tokenizer([(root / p).read_text() for p in TINY_TOKENIZER_SOURCES], vocab_size)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    return tok


def write_tiny_family(out_dir, *, seed: int = 0, vocab_size: int = 32, train_steps: int = 150,
                      norms: bool = True, head: bool = True, draft_layers: int = 0,
                      tokenizer_vocab: int | None = None, std: float = 0.25, **config) -> TinyFamily:
    """A random tiny Llama target under `out_dir`/target, and with it
    - `head`: an MTP head in `out_dir`/head, briefly trained on the target's own greedy
      continuations (so drafts are often accepted);
    - `draft_layers` > 0: a draft in `out_dir`/draft, a separate checkpoint made of the target's
      first `draft_layers` layers with its embedding, norm and LM head (so it often agrees);
    - `tokenizer_vocab`: a byte-level BPE tokenizer (`write_tiny_tokenizer`) in the target and
      draft dirs; the vocabulary is then the tokenizer's, with its bos/eos ids.
    `config` overrides the target's ModelConfig fields (default: 2 layers of width 32, MLP width
    2x, 4 heads, 2 KV heads, tied embeddings); weights are N(0, `std`). For tests and demos; a
    few seconds on one CPU thread (the models are dispatch-bound, so more threads only contend)."""
    from specsched.runtime.config import ModelConfig

    out = Path(out_dir)
    special: dict = {"eos_token_id": None}
    tok = None
    if tokenizer_vocab is not None:
        from specsched.runtime.training.tokenizer_train import special_ids

        tok = write_tiny_tokenizer(out / "target", tokenizer_vocab)
        vocab_size = tok.get_vocab_size()
        special = dict(zip(("bos_token_id", "eos_token_id"), special_ids(tok)))
    fields = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512)
    fields |= special | config
    fields.setdefault("intermediate_size", 2 * fields["hidden_size"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    cfg = ModelConfig(**fields)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _tiny_family(out, cfg, seed, std, train_steps if head else None, norms, draft_layers, tok)
    finally:
        torch.set_num_threads(threads)


def _tiny_family(out: Path, cfg, seed: int, std: float, train_steps: int | None, norms: bool,
                 draft_layers: int, tok: Tokenizer | None) -> TinyFamily:
    from specsched.runtime.model import LlamaModel

    target = LlamaModel.random(cfg, seed=seed, std=std)
    save_llama(target, out / "target")
    fam = TinyFamily(str(out / "target"), None)
    if draft_layers:
        draft = LlamaModel(cfg.model_copy(update={"num_hidden_layers": draft_layers}))
        draft.load_hf(target.hf_state_dict())  # the first `draft_layers` layers
        save_llama(draft, out / "draft")
        if tok is not None:
            tok.save(str(out / "draft" / "tokenizer.json"))
        fam = fam._replace(draft=str(out / "draft"))
    if train_steps is not None:
        fam = fam._replace(head=_train_tiny_head(target, out / "head", seed, train_steps, norms))
    return fam


def _train_tiny_head(target, out: Path, seed: int, train_steps: int, norms: bool) -> str:
    from specsched.runtime.mtp_head import save_head
    from specsched.runtime.training.mtp import TrainConfig, precompute_hidden, train_head

    seqs = head_windows(target, seed)
    hidden = precompute_hidden(target, seqs)
    tcfg = TrainConfig(seq_len=seqs.shape[1] - 2, batch_size=16, lr=1e-2, steps=train_steps, seed=seed)
    head, _ = train_head(target, seqs, hidden, norms=norms, cfg=tcfg, log=lambda *_: None)
    save_head(head, out, target)
    return str(out)


def head_windows(target, seed: int) -> torch.Tensor:
    """64 windows of 48 tokens a tiny head trains on: 4 random tokens, then the target's greedy
    continuation."""
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, target.config.vocab_size, (64, 4), generator=gen)
    with torch.inference_mode():
        for _ in range(44):
            logits, _ = target.forward_full(seqs)
            seqs = torch.cat([seqs, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seqs
