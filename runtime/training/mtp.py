"""Train an MTP head for a target: frozen embedding and lm_head, distillation on hidden states.

Why: the head is only useful if its guesses match the target's greedy tokens, so it learns
from the target itself. Target hidden states are precomputed once with the runtime's own
`LlamaModel.forward_full` (the costly part; the target's logits are recomputed from them on
the fly, lm_head being shared), then the head trains on them:

    loss = KL(p_target(. | x_<=i+1) || p_head(. | H_i, x_{i+1}))      next-token distillation
         + ce_weight * CE(p_head, x_{i+2})                             the corpus itself
         + hidden_weight * ||h_head_i - H_{i+1}||^2 / E[H^2]          hidden-state matching

The hidden term teaches the head's output to stand in for H_{i+1}, which multi-token
drafting feeds back. Validation never uses this loss: it measures acceptance through the
inference implementation (paged target + paged head, then Pipeline + ModelWorker runs at
D = 1..3; see `mtp_eval`).

Budgets are wall-clock seconds: after a few timed steps the step count is fixed, and the
cosine schedule is a function of (step, total) only, so `steps=N` reproduces a run exactly
(same seed, same data order). The CLI (`specsched train-mtp`) calls `train_mtp`.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.checkpoint import load_model
from runtime.model import LlamaModel
from runtime.mtp_head import MTPHead

TIMED_STEPS = 10  # steps used to fix the step count of a time budget
WARMUP_STEPS = 20


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 256  # head positions per window (windows hold seq_len + 2 tokens)
    batch_size: int = 16  # windows per step
    lr: float = 2e-3  # AdamW peak, warmup then cosine to 10%
    weight_decay: float = 0.0
    ce_weight: float = 0.1
    hidden_weight: float = 0.1
    budget_s: float = 360.0  # wall-clock training budget when `steps` is None
    steps: int | None = None  # fixed step count (overrides budget_s)
    seed: int = 0
    bf16: bool = False  # bf16 autocast (only pays on CPUs with native bf16 matmul)


@dataclass
class TrainStats:
    norms: bool
    steps: int
    windows: int  # precomputed training windows
    tokens_seen: int  # head positions trained on (steps * batch * seq_len)
    precompute_s: float  # target hidden-state pass
    train_s: float  # training loop
    first_loss: dict = field(default_factory=dict)  # mean of the first 10 steps, per term
    final_loss: dict = field(default_factory=dict)  # mean of the last 20 steps, per term


@torch.inference_mode()
def precompute_hidden(target: LlamaModel, windows: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """Target hidden states (before the final norm) for windows [N, S] -> [N, S, H] bf16,
    computed with the runtime's dense forward."""
    out = torch.empty(*windows.shape, target.config.hidden_size, dtype=torch.bfloat16)
    for i in range(0, windows.shape[0], batch):
        _, hidden = target.forward_full(windows[i : i + batch].to(target.device))
        out[i : i + batch] = hidden.to(torch.bfloat16).cpu()
    return out


def head_loss(head: MTPHead, target: LlamaModel, ids: torch.Tensor, hidden: torch.Tensor,
              cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss over windows ids [B, S], hidden [B, S, H] (H_0..H_{S-1}): head positions 0..S-3."""
    hidden = hidden.float()
    with torch.no_grad():
        t_logp = F.log_softmax(target.compute_logits(target.final_norm(hidden[:, 1:-1])), -1)
    out = head.forward_full(ids[:, 1:-1], hidden[:, :-2])
    h_logp = F.log_softmax(out.logits.float(), -1)
    kl = F.kl_div(h_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
    ce = F.nll_loss(h_logp.flatten(0, 1), ids[:, 2:].flatten())
    want = hidden[:, 1:-1]
    mse = (out.hidden.float() - want).pow(2).mean() / want.pow(2).mean().clamp_min(1e-6)
    loss = kl + cfg.ce_weight * ce + cfg.hidden_weight * mse
    return loss, {"loss": loss.item(), "kl": kl.item(), "ce": ce.item(), "hidden_mse": mse.item()}


def lr_at(step: int, total: int, peak: float) -> float:
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    frac = min(1.0, (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def train_head(target: LlamaModel, ids: torch.Tensor, hidden: torch.Tensor, *, norms: bool = True,
               cfg: TrainConfig = TrainConfig(), log=print) -> tuple[MTPHead, TrainStats]:
    """Train a fresh head on precomputed windows ids [N, S] / hidden [N, S, H]."""
    torch.manual_seed(cfg.seed)
    target = target.float().requires_grad_(False).eval()
    head = MTPHead.for_target(target, norms=norms, seed=cfg.seed).float().train().requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    total = cfg.steps if cfg.steps is not None else 10**9
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    step = 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg.lr)
        pick = torch.randint(0, ids.shape[0], (cfg.batch_size,), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, parts = head_loss(head, target, ids[pick], hidden[pick], cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        history.append(parts)
        step += 1
        elapsed = time.perf_counter() - start
        if cfg.steps is None and step == TIMED_STEPS:
            total = max(WARMUP_STEPS + 1, int(cfg.budget_s / (elapsed / step)))
            log(f"[mtp norms={norms}] {elapsed / step:.2f} s/step -> {total} steps for {cfg.budget_s:.0f} s")
        if cfg.steps is None and step > TIMED_STEPS and elapsed > 1.3 * cfg.budget_s + 30:
            log(f"[mtp norms={norms}] over budget at step {step}; stopping early")
            break
        if step % 50 == 0 or step == total:
            log(f"[mtp norms={norms}] step {step}/{total} {elapsed:.0f}s " + _fmt(_mean(history[-20:])))
    stats = TrainStats(norms, step, int(ids.shape[0]), step * cfg.batch_size * (ids.shape[1] - 2), 0.0,
                       time.perf_counter() - start, _mean(history[:10]), _mean(history[-20:]))
    return head.requires_grad_(False).eval(), stats


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def _fmt(parts: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.3f}" for k, v in parts.items())


def corpus_windows(target_dir: str | Path, seq_len: int, num_train: int, num_heldout: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Random train windows [num_train, seq_len + 2] and leading held-out windows from the
    offline corpus, tokenized with the target's tokenizer.json; returns (train, heldout, corpus)."""
    from tokenizers import Tokenizer

    from runtime.training.bundled import token_stream
    from runtime.training.corpus import load_corpus

    tok_path = Path(target_dir) / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in target directory {target_dir}")
    tok = Tokenizer.from_file(str(tok_path))
    corpus = load_corpus()
    train, heldout = token_stream(tok, corpus.train), token_stream(tok, corpus.heldout)
    s = seq_len + 2
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train.numel() - s, (num_train,), generator=gen)
    train_w = torch.stack([train[a : a + s] for a in starts.tolist()])
    num_heldout = min(num_heldout, heldout.numel() // s)
    return train_w, heldout[: num_heldout * s].view(num_heldout, s), (corpus, tok)


def train_mtp(target_dir: str | Path, out_dir: str | Path, steps: int | None = None, *,
              minutes: float = 6.0, norms: bool = True, seed: int = 0, num_windows: int = 2048,
              seq_len: int = 256, batch_size: int = 16, lr: float = 2e-3, validate: bool = True,
              log=print) -> dict:
    """Train a head for the target in `target_dir` and save it to `out_dir`.

    steps: fixed optimizer steps (None: as many as `minutes` of training allow). norms=False
    trains the EAGLE-style head without enorm/hnorm (for the ablation). Returns a report:
    training stats, and with `validate` acceptance measured through the inference path.
    """
    from runtime.mtp_head import save_head

    torch.set_num_threads(2)
    target = load_model(target_dir)
    cfg = TrainConfig(seq_len=seq_len, batch_size=batch_size, lr=lr, budget_s=minutes * 60,
                      steps=steps, seed=seed)
    train_w, heldout_w, (corpus, tok) = corpus_windows(target_dir, seq_len, num_windows, 32, seed)
    t0 = time.perf_counter()
    hidden = precompute_hidden(target, train_w)
    pre_s = time.perf_counter() - t0
    log(f"[mtp] precomputed target hidden states for {train_w.numel():,} tokens in {pre_s:.0f}s")
    head, stats = train_head(target, train_w, hidden, norms=norms, cfg=cfg, log=log)
    stats.precompute_s = pre_s
    del hidden
    report = {"train": asdict(stats), "config": asdict(cfg), "target_dir": str(target_dir)}
    save_head(head, out_dir, target)
    if validate:
        from runtime.training.mtp_validate import validate_head

        report["validation"] = validate_head(target_dir, out_dir, heldout_w, corpus, tok, log=log)
    return report
