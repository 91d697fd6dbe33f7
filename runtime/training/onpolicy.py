"""On-policy distillation data: the target's own greedy continuations of corpus prompts.

Why: at serving time a proposer drafts the continuation the target is generating, not
corpus text, and a small target's greedy text is far more regular than the corpus it was
trained on. Distilling on windows whose second half is the target's greedy output
(DistillSpec's on-policy data, Zhou et al. 2023) trains the proposer where it is used; the
first half, corpus text, keeps it calibrated on prompts. The loss stays KL to the target's
logits at every position, so the windows only choose the contexts.
"""

from __future__ import annotations

import time

import torch


@torch.no_grad()
def greedy_windows(target, stream: torch.Tensor, num: int, window: int, prompt_len: int, seed: int,
                   batch: int = 64, eos_id: int | None = None, log=print) -> torch.Tensor:
    """`num` windows of `window` tokens: a random `prompt_len`-token span of `stream` followed
    by the target's greedy continuation (fp32, KV cache; end-of-sequence suppressed so every
    window is full). Deterministic for a fixed seed, model and thread count."""
    if not 0 < prompt_len < window:
        raise ValueError(f"prompt_len must be in 1..{window - 1}, got {prompt_len}")
    if stream.numel() <= prompt_len:
        raise ValueError("stream is shorter than one prompt")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - prompt_len, (num,), generator=gen)
    prompts = torch.stack([stream[s : s + prompt_len] for s in starts.tolist()])
    return greedy_continue(target, prompts, window, batch, eos_id, log)


@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, window: int, batch: int = 64, eos_id: int | None = None,
                    log=print) -> torch.Tensor:
    """Each row of `prompts` [N, P] continued by the target's greedy tokens to `window` tokens
    (fp32, KV cache, end-of-sequence suppressed)."""
    num, prompt_len = prompts.shape
    new = window - prompt_len
    if new <= 0:
        raise ValueError(f"window {window} leaves no room after {prompt_len}-token prompts")
    was_training = target.training
    target.eval()
    out = torch.empty(num, window, dtype=torch.long)
    t0 = time.perf_counter()
    for i in range(0, num, batch):
        p = prompts[i : i + batch]
        ids = target.generate(input_ids=p, attention_mask=torch.ones_like(p), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=eos_id,
                              eos_token_id=eos_id)
        out[i : i + len(p)] = ids[:, :window]
        if (i // batch) % 8 == 0:
            log(f"[onpolicy] {i + len(p)}/{num} windows, {time.perf_counter() - t0:.0f}s")
    target.train(was_training)
    return out


def mixed_sampler(stream: torch.Tensor, pool: torch.Tensor, pool_frac: float):
    """A batch sampler for `run_loop`: `pool_frac` of each batch drawn from the `pool` windows
    (rows of SEQ_LEN + 1 tokens), the rest random windows of the corpus `stream`."""
    from specsched.runtime.training.loop import SEQ_LEN, random_windows

    if pool.dim() != 2 or pool.shape[1] != SEQ_LEN + 1:
        raise ValueError(f"pool windows must be [N, {SEQ_LEN + 1}], got {list(pool.shape)}")
    if not 0.0 <= pool_frac <= 1.0:
        raise ValueError(f"pool_frac must be in [0, 1], got {pool_frac}")

    def sample(gen: torch.Generator, batch_size: int) -> torch.Tensor:
        k = round(batch_size * pool_frac)
        rows = pool[torch.randint(0, pool.shape[0], (k,), generator=gen)]
        if k == batch_size:
            return rows
        return torch.cat([rows, random_windows(stream, gen, batch_size - k)])

    return sample


def cached_windows(path, target, key, make):
    """`make()`'s windows, kept in `path` (a run's state dir) for the same target weights and
    `key`: generating thousands of continuations takes minutes that a resumed or repeated run
    need not pay again. A file for other weights or another key is replaced."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256(repr(key).encode())
    for name, tensor in sorted(target.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().contiguous().numpy().tobytes())
    fingerprint = h.hexdigest()
    path = Path(path)
    if path.exists():
        saved = torch.load(path, weights_only=True)
        if saved.get("fingerprint") == fingerprint:
            return saved["windows"]
    windows = make()
    torch.save({"fingerprint": fingerprint, "windows": windows}, path)
    return windows
