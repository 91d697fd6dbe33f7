"""Train an MTP head for a target: frozen embedding and lm_head, distillation on hidden states.

Why: the head is only useful if its guesses match the target's greedy tokens, so it learns
from the target itself. Target hidden states are precomputed once with the runtime's own
`LlamaModel.forward_full` (the costly part; the target's logits are recomputed from them on
the fly, lm_head being shared; with `aux_layers` the earlier layers' outputs are kept in front
of the last's, the features an EAGLE-3 head reads), then the head trains on them:

    loss = KL(p_target(. | x_<=i+1) || p_head(. | H_i, x_{i+1}))      next-token distillation
         + ce_weight * CE(p_head, x_{i+2})                             the corpus itself
         + hidden_weight * ||h_head_i - H_{i+1}||^2 / E[H^2]          hidden-state matching

The hidden term teaches the head's output to stand in for H_{i+1}, which multi-token
drafting feeds back; a second pass trains that feedback directly (the head's second draft
step, inputs (h_head_i, x_{i+2}), attending to first-pass keys exactly as the paged draft
step does), weighted by `rollout_weight`. Validation never uses this loss: it measures acceptance through the
inference implementation (paged target + paged head, then Pipeline + ModelWorker runs at
D = 1..3; see `mtp_eval`).

Budgets are wall-clock minutes (the cosine schedule follows elapsed time, so a busy machine
takes fewer steps); `steps=N` switches to a step schedule, deterministic for a fixed seed,
library versions and thread count. The CLI (`specsched train-mtp`) calls `train_mtp`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specsched.runtime.attention.torch_backend import CausalAttention
from specsched.runtime.checkpoint import load_model
from specsched.runtime.model import LlamaModel
from specsched.runtime.training.cards import loss_terms, write_head_card
from specsched.runtime.training.loop import lr_at
from specsched.runtime.mtp_head import MTPHead

WARMUP_STEPS = 20


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 256  # head positions per window (windows hold seq_len + 2 tokens)
    batch_size: int = 16  # windows per step
    lr: float = 2e-3  # AdamW peak, warmup then cosine to 10%
    weight_decay: float = 0.0
    ce_weight: float = 0.1
    hidden_weight: float = 0.1
    rollout_weight: float = 0.5  # weight of the second-draft-step terms (0: teacher forcing only)
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
def precompute_hidden(target: LlamaModel, windows: torch.Tensor, batch: int = 16,
                      aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """Target hidden states (before the final norm) for windows [N, S] -> [N, S, H] bf16,
    computed with the runtime's dense forward; with `aux_layers` those layers' outputs in
    front, [N, S, (A + 1) * H] (the features an EAGLE-3 head reads)."""
    width = (len(aux_layers) + 1) * target.config.hidden_size
    out = torch.empty(*windows.shape, width, dtype=torch.bfloat16)
    for i in range(0, windows.shape[0], batch):
        _, hidden = target.forward_full(windows[i : i + batch].to(target.device), aux_layers)
        out[i : i + batch] = hidden.to(torch.bfloat16).cpu()
    return out


class _RecordingCausal(CausalAttention):
    """Causal attention that keeps the layer's keys and values for the rollout pass."""

    def attend(self, layer_idx, q, k, v, kv_layer=None):
        self.k, self.v = k, v
        return super().attend(layer_idx, q, k, v, kv_layer)


class _SecondDraftAttention:
    """The head's second draft step, densely: the query at position i+1 (row i) sees the first
    pass's keys at positions 0..i (what the fill wrote, from target hidden states) plus its
    own key -- exactly the paged KV a draft step attends to."""

    plan = None

    def __init__(self, k1: torch.Tensor, v1: torch.Tensor):
        self.k1, self.v1 = k1, v1  # [B, T, Hkv, D]

    def attend(self, layer_idx, q, k, v, kv_layer=None):
        b, t, hq, d = q.shape
        rep = hq // k.shape[2]
        k1 = self.k1[:, :t].repeat_interleave(rep, 2)
        v1 = self.v1[:, :t].repeat_interleave(rep, 2)
        scale = d ** -0.5
        s1 = torch.einsum("bihd,bjhd->bhij", q, k1) * scale  # [B, Hq, T, T]
        s1 = s1.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        s2 = (q * k.repeat_interleave(rep, 2)).sum(-1).transpose(1, 2).unsqueeze(-1) * scale  # [B, Hq, T, 1]
        p = torch.cat([s1, s2], -1).softmax(-1)
        out = torch.einsum("bhij,bjhd->bihd", p[..., :t], v1)
        return out + p[..., t].transpose(1, 2).unsqueeze(-1) * v.repeat_interleave(rep, 2)


def head_rollout(head: MTPHead, ids: torch.Tensor, hidden: torch.Tensor, second: bool = True):
    """Teacher-forced pass over windows ids [B, S] / hidden [B, S, H] (positions 0..S-3, inputs
    (H_i, x_{i+1})), and optionally the second draft step at positions 1..S-3 (inputs (the
    first pass's hidden at i, x_{i+2})). Returns (first HeadOutput, second HeadOutput or None)."""
    rec = _RecordingCausal()
    t = ids.shape[1] - 2
    pos = torch.arange(t, device=ids.device)
    out1 = head.forward_dense(ids[:, 1:-1], hidden[:, :-2], pos, rec)
    if not second:
        return out1, None
    out2 = head.forward_dense(ids[:, 2:-1], out1.hidden[:, :-1], pos[1:], _SecondDraftAttention(rec.k, rec.v))
    return out1, out2


def _terms(out, t_logp: torch.Tensor, labels: torch.Tensor, want_hidden: torch.Tensor):
    h_logp = F.log_softmax(out.logits.float(), -1)
    kl = F.kl_div(h_logp.flatten(0, 1), t_logp.flatten(0, 1), log_target=True, reduction="batchmean")
    ce = F.nll_loss(h_logp.flatten(0, 1), labels.flatten())
    mse = (out.hidden.float() - want_hidden).pow(2).mean() / want_hidden.pow(2).mean().clamp_min(1e-6)
    return kl, ce, mse


def head_loss(head: MTPHead, target: LlamaModel, ids: torch.Tensor, hidden: torch.Tensor,
              cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss over windows ids [B, S], hidden [B, S, H] (H_0..H_{S-1}; with aux layers the
    features, the last layer's state last): head positions 0..S-3, plus `rollout_weight` x the
    same terms for the second draft step."""
    features = hidden.float()
    hidden = features[..., -target.config.hidden_size:]  # the last layer's: logits and the hidden term
    with torch.no_grad():
        t_logp = F.log_softmax(target.compute_logits(target.final_norm(hidden[:, 1:-1])), -1)
    out1, out2 = head_rollout(head, ids, features, second=cfg.rollout_weight > 0)
    kl, ce, mse = _terms(out1, t_logp, ids[:, 2:], hidden[:, 1:-1])
    loss = kl + cfg.ce_weight * ce + cfg.hidden_weight * mse
    parts = {"kl": kl.item(), "ce": ce.item(), "hidden_mse": mse.item()}
    if out2 is not None:
        kl2, ce2, mse2 = _terms(out2, t_logp[:, 1:], ids[:, 3:], hidden[:, 2:-1])
        loss = loss + cfg.rollout_weight * (kl2 + cfg.ce_weight * ce2 + cfg.hidden_weight * mse2)
        parts["kl_step2"] = kl2.item()
    return loss, {"loss": loss.item(), **parts}


def train_head(target: LlamaModel, ids: torch.Tensor, hidden: torch.Tensor, *, norms: bool = True,
               cfg: TrainConfig = TrainConfig(), aux_layers: tuple[int, ...] = (), init: MTPHead | None = None,
               eagle3: bool = False, log=print) -> tuple[MTPHead, TrainStats]:
    """Train a head on precomputed windows ids [N, S] / hidden [N, S, (A + 1) * H] (A =
    len(aux_layers)): a fresh one, or one starting from `init`'s weights (its norms; `fc`, where
    `init` has none, starts as the identity on the last layer's state; where it has one, it
    reads as many layers, which may sit elsewhere: a grown target's layers that hold the
    features `init`'s target had at its own, see grow.deepen).

    With cfg.steps the schedule is by step (deterministic); otherwise by elapsed time over
    cfg.budget_s (a busy machine takes fewer steps). `eagle3`: an EAGLE-3 head in its published
    network (runtime/eagle3.py) reading exactly three `aux_layers`, trained on the same losses
    (no hidden-state term: EAGLE-3 predicts tokens, not features)."""
    torch.manual_seed(cfg.seed)
    target = target.float().requires_grad_(False).eval()
    if eagle3:
        from specsched.runtime.eagle3 import Eagle3Head

        if len(aux_layers) != 3 or init is not None:
            raise ValueError(f"an EAGLE-3 head reads three target layers (--aux-layers, got {list(aux_layers)}) "
                             "and starts fresh (no --init-from)")
        head = Eagle3Head.for_target(target, aux_layers, seed=cfg.seed)
        cfg = replace(cfg, hidden_weight=0.0)
    else:
        head = MTPHead.for_target(target, norms=norms, seed=cfg.seed, aux_layers=aux_layers)
    if init is not None:
        start = init.state_for_save()
        if init.norms != norms or (init.fc is not None and len(init.aux_layers) != len(head.aux_layers)):
            raise ValueError(f"cannot start a head (norms={norms}, aux_layers={list(aux_layers)}) from one with "
                             f"norms={init.norms}, aux_layers={list(init.aux_layers)}")
        if head.fc is not None and init.fc is None:
            start["fc.weight"] = head.fc.weight.detach()
        head.load_tensors(start)
    head = head.float().train().requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    step = 0
    progress = 0.0
    while progress < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, cfg.lr, WARMUP_STEPS)
        pick = torch.randint(0, ids.shape[0], (cfg.batch_size,), generator=gen)
        # grad mode is global and a ModelWorker switches it off: enable it here explicitly
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, parts = head_loss(head, target, ids[pick], hidden[pick], cfg)
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        history.append(parts)
        step += 1
        elapsed = time.perf_counter() - start
        progress = step / cfg.steps if cfg.steps is not None else elapsed / cfg.budget_s
        if step % 50 == 0 or progress >= 1.0:
            log(f"[mtp norms={norms}] step {step} {elapsed:.0f}s " + loss_terms(_mean(history[-20:])))
    stats = TrainStats(norms, step, int(ids.shape[0]), step * cfg.batch_size * (ids.shape[1] - 2), 0.0,
                       time.perf_counter() - start, _mean(history[:10]), _mean(history[-20:]))
    return head.requires_grad_(False).eval(), stats


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def corpus_windows(tokenizer_file: Path, seq_len: int, num_train: int, num_heldout: int, seed: int):
    """Random train windows [num_train, seq_len + 2] and leading held-out windows
    [num_heldout, seq_len + 2] from the offline corpus (`<|bos|> file <|eos|>` per file, as
    the bundled models were trained); returns (train, heldout, corpus)."""
    from tokenizers import Tokenizer as HFTokenizer

    from specsched.runtime.training.bundled import token_stream
    from specsched.runtime.training.corpus import load_corpus

    tok = HFTokenizer.from_file(str(tokenizer_file))
    corpus = load_corpus()
    train, heldout = token_stream(tok, corpus.train), token_stream(tok, corpus.heldout)
    s = seq_len + 2
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train.numel() - s, (num_train,), generator=gen)
    train_w = torch.stack([train[a : a + s] for a in starts.tolist()])
    num_heldout = min(num_heldout, heldout.numel() // s)
    return train_w, heldout[: num_heldout * s].view(num_heldout, s), corpus


def train_mtp(target_dir: str | Path, out_dir: str | Path, steps: int | None = None, *,
              minutes: float = 6.0, norms: bool = True, ablation: bool = False, seed: int = 0,
              num_windows: int = 2400, seq_len: int = 128, batch_size: int = 8, lr: float = 2e-3,
              num_threads: int = 2, validate: bool = True, num_prompts: int = 24, bf16: bool | None = None,
              onpolicy_frac: float = 0.0, onpolicy_prompt: int = 64, aux_layers: tuple[int, ...] = (),
              init_from: str | Path | None = None, layout: str = "specsched", log=print) -> dict:
    """Train an MTP head for the target in `target_dir` (HF layout with tokenizer.json) and
    save it, with a model card, to `out_dir`.

    steps: fixed optimizer steps (None: train for `minutes`). norms=False trains the
    EAGLE-style head without enorm/hnorm. ablation=True also trains the other variant on the
    same precomputed data for the same number of steps (not saved) and records both in the card. validate:
    measure acceptance through the inference implementation (`num_prompts` held-out function
    prompts x 64 greedy tokens, 48 held-out windows for agreement). Returns the report (also in
    the card): training stats per variant and their validation numbers. bf16: autocast in the
    training loop (default: where the CPU multiplies bf16 natively). onpolicy_frac: share of the
    training windows whose tokens after the first `onpolicy_prompt` are the target's greedy
    continuation instead of corpus text (on-policy data, onpolicy.py). aux_layers: earlier
    target layers whose outputs the head also reads (EAGLE-3's features, `fc` maps them to H).
    init_from: a head directory to continue training from (same norms; its `fc`, if any, must
    read as many layers; it may have been trained for another target of the same shape, e.g.
    the one this target was grown from). layout: "specsched" (this head's own network and
    layout) or "eagle3" (an EAGLE-3 head, `LlamaForCausalLMEagle3`, as vLLM and SGLang load it:
    three `aux_layers`, no ablation or init_from).
    """
    import tempfile

    from specsched.runtime.mtp_head import check_aux_layers, load_head, save_head, target_fingerprint
    from specsched.runtime.tokenizer import Tokenizer
    from specsched.runtime.training.corpus import function_prompts
    from specsched.runtime.training.mtp_eval import validate_head

    from specsched.runtime.training.loop import bf16_supported

    if layout not in ("specsched", "eagle3"):
        raise ValueError(f"layout {layout!r}: expected 'specsched' or 'eagle3'")
    eagle3 = layout == "eagle3"
    if eagle3 and (ablation or init_from is not None or len(aux_layers) != 3):
        raise ValueError("--layout eagle3 trains a fresh EAGLE-3 head on exactly three --aux-layers "
                         "(no --ablation, no --init-from)")
    torch.set_num_threads(num_threads)
    bf16 = bf16_supported() if bf16 is None else bf16
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = load_model(target_dir)
    aux_layers = tuple(aux_layers)
    check_aux_layers(aux_layers, target.config.num_hidden_layers)
    init = None
    if init_from is not None:
        if ablation:
            raise ValueError("--ablation trains the other variant from scratch; it does not combine with --init-from")
        init = load_head(init_from, target, check_target=False)
    tok = Tokenizer(target_dir)
    cfg = TrainConfig(seq_len=seq_len, batch_size=batch_size, lr=lr, budget_s=minutes * 60, steps=steps, seed=seed,
                      bf16=bf16)
    train_w, heldout_w, corpus = corpus_windows(target_dir / "tokenizer.json", seq_len, num_windows, 48, seed)
    num_onpolicy = round(num_windows * onpolicy_frac)
    if num_onpolicy:  # on-policy data: the target's own continuations (onpolicy.py)
        from transformers import LlamaForCausalLM

        from specsched.runtime.training.onpolicy import greedy_continue

        t0 = time.perf_counter()
        hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        train_w[:num_onpolicy] = greedy_continue(hf, train_w[:num_onpolicy, :onpolicy_prompt], train_w.shape[1],
                                                 eos_id=tok.eos_token_id, log=log)
        del hf
        log(f"[mtp] {num_onpolicy} greedy continuations in {time.perf_counter() - t0:.0f}s")
    t0 = time.perf_counter()
    hidden = precompute_hidden(target, train_w, aux_layers=aux_layers)
    pre_s = time.perf_counter() - t0
    log(f"[mtp] target hidden states for {train_w.numel():,} tokens in {pre_s:.0f}s")
    prompts = [tok.encode(p) for p in
               function_prompts(corpus.heldout, lambda x: len(tok.encode(x)), num_prompts, seed + 1)]
    report: dict = {"target": str(target_dir), "target_fingerprint": target_fingerprint(target), "corpus": {
        "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
        "train_windows": int(train_w.shape[0]), "window_tokens": int(train_w.shape[1]),
        "onpolicy_windows": num_onpolicy, "onpolicy_prompt": onpolicy_prompt},
        "config": asdict(cfg), "num_threads": num_threads, "precompute_s": round(pre_s, 1), "variants": {},
        "aux_layers": list(aux_layers), "init_from": None if init_from is None else str(init_from),
        "layout": layout}
    variants = [norms, not norms] if ablation else [norms]
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            head, stats = train_head(target, train_w, hidden, norms=v, cfg=cfg, aux_layers=aux_layers,
                                     init=init, eagle3=eagle3, log=log)
            cfg = replace(cfg, steps=stats.steps)  # the ablation gets the same number of steps
            stats.precompute_s = pre_s
            where = out_dir if v == norms else Path(tmp) / "ablation"
            if eagle3:
                from specsched.runtime.eagle3 import save_eagle3_head

                save_eagle3_head(head, where)
            else:
                save_head(head, where, target)
            entry = {"train": asdict(stats)}
            if validate:
                entry["validation"] = validate_head(str(target_dir), str(where), heldout_w, prompts, log=log)
            report["variants"]["norms" if v else "no_norms"] = entry
    write_head_card(out_dir / "README.md", report, shipped="norms" if norms else "no_norms")
    return report
