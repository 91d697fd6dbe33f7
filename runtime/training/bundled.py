"""Train the bundled tiny model family: tokenizer, 6-layer target, 1-layer distilled draft.

Why: the engine, tracer and benchmarks need a real target/draft pair that runs anywhere with no
download. The corpus is the interpreter's own standard library (see corpus.py), the models are
plain Llama (transformers' LlamaForCausalLM, saved in Hugging Face layout), and the draft is
distilled from the target with pure KL so that its greedy agreement, not its perplexity, is
what improves.

Budgets are wall-clock minutes (the cosine schedule follows elapsed time), so a plain rerun is
approximately, not bit-, reproducible: a busy machine takes fewer steps. `--target-steps` and
`--draft-steps` switch to step budgets (schedule by step), which are deterministic for fixed
seeds, library versions and thread count.
Needs the `dev` extra: `python -m specsched.runtime.training.bundled --out runtime/bundled`.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specsched.runtime.training.corpus import Corpus, SourceFile, function_prompts, load_corpus
from specsched.runtime.training.tokenizer_train import special_ids, train_tokenizer

SEQ_LEN = 256
BATCH_SIZE = 8
NUM_WORKLOAD_PROMPTS = 64
WORKLOAD_MAX_TOKENS = 64
WARMUP_STEPS = 20
EVAL_EVERY = 50
NUM_EVAL_WINDOWS = 64  # held-out windows for the final numbers
# bf16 autocast is several times slower than fp32 for the backward pass on a CPU without native bf16
# matmul, so training runs in fp32; flip this on CPUs with AVX512-BF16/AMX.
USE_BF16_AUTOCAST = False


@dataclass
class RunStats:
    steps: int  # optimizer steps taken
    tokens_seen: int  # training tokens (steps * batch * seq_len)
    wall_s: float  # wall time of the training loop, evals included
    train_loss: float  # mean loss over the last 20 steps (CE for target, KL for draft)
    heldout_ce: float  # next-token cross-entropy on held-out windows, nats/token
    agreement: float | None = None  # draft only: teacher-forced greedy agreement with target


def llama_config(vocab_size: int, bos_id: int, eos_id: int, num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=num_layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=688,
        max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-6, bos_token_id=bos_id, eos_token_id=eos_id,
    )


def token_stream(tok, files: tuple[SourceFile, ...]) -> torch.Tensor:
    """All files as one id stream: `<|bos|> file <|eos|>` per file."""
    bos, eos = special_ids(tok)
    ids: list[int] = []
    for enc in tok.encode_batch([f.text for f in files]):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - SEQ_LEN - 1, (BATCH_SIZE,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])  # [B, T+1]


def eval_windows(stream: torch.Tensor, num: int) -> torch.Tensor:
    num = min(num, (stream.numel() - 1) // (SEQ_LEN + 1))
    return stream[: num * (SEQ_LEN + 1)].view(num, SEQ_LEN + 1)  # [N, T+1]


def lr_at(step: int, progress: float, peak: float) -> float:
    """Linear warmup by step, then cosine to 10% of peak over `progress` in [0, 1]."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=USE_BF16_AUTOCAST):
        return model(input_ids=ids).logits.float()  # [B, T, V]


@torch.no_grad()
def heldout_ce(model, windows: torch.Tensor, batch: int = 16) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logits = logits_of(model, w[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return total / (windows.shape[0] * SEQ_LEN)


@torch.no_grad()
def greedy_agreement(draft, target, windows: torch.Tensor, batch: int = 16) -> float:
    """Fraction of positions where draft argmax == target argmax (teacher-forced)."""
    draft.eval()
    same = 0
    for i in range(0, len(windows), batch):
        ids = windows[i : i + batch, :-1]
        same += (logits_of(draft, ids).argmax(-1) == logits_of(target, ids).argmax(-1)).sum().item()
    draft.train()
    return same / (windows.shape[0] * SEQ_LEN)


def run_loop(name, model, loss_fn, stream, heldout, budget_s, fixed_steps, seed, peak_lr) -> RunStats:
    """AdamW + warmup/cosine over `fixed_steps` steps, or over `budget_s` of wall time."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    probe = eval_windows(heldout, 8)
    losses: list[float] = []
    start = time.perf_counter()
    step, progress = 0, 0.0
    while progress < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, peak_lr)
        loss = loss_fn(random_windows(stream, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        elapsed = time.perf_counter() - start
        progress = step / fixed_steps if fixed_steps is not None else elapsed / budget_s
        if step % EVAL_EVERY == 0 or progress >= 1.0:
            print(f"[{name}] step {step} {elapsed:.0f}s ({elapsed / step:.2f} s/step) "
                  f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f} heldout_ce {heldout_ce(model, probe):.3f}",
                  flush=True)
    wall_s = time.perf_counter() - start
    tail = losses[-20:]
    return RunStats(step, step * BATCH_SIZE * SEQ_LEN, wall_s, sum(tail) / len(tail),
                    heldout_ce(model, eval_windows(heldout, NUM_EVAL_WINDOWS)))


def train_target(config, stream, heldout, budget_s, fixed_steps, seed):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)

    def ce(w):
        return F.cross_entropy(logits_of(model, w[:, :-1]).flatten(0, 1), w[:, 1:].flatten())

    return model, run_loop("target", model, ce, stream, heldout, budget_s, fixed_steps, seed, 3e-3)


def distill_draft(config, target, stream, heldout, budget_s, fixed_steps, seed):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed + 1)
    draft = LlamaForCausalLM(config)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
    if draft.lm_head.weight.data_ptr() != draft.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("draft lm_head is not tied to its embeddings")
    target.eval().requires_grad_(False)

    def kl(w):
        ids = w[:, :-1]
        with torch.no_grad():
            t_logp = F.log_softmax(logits_of(target, ids), -1).flatten(0, 1)
        d_logp = F.log_softmax(logits_of(draft, ids), -1).flatten(0, 1)
        return F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")

    stats = run_loop("draft", draft, kl, stream, heldout, budget_s, fixed_steps, seed + 1, 2e-3)
    stats.agreement = greedy_agreement(draft, target, eval_windows(heldout, NUM_EVAL_WINDOWS))
    return draft, stats


def save_model(model, tokenizer_path: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").unlink(missing_ok=True)
    shutil.copyfile(tokenizer_path, out / "tokenizer.json")
    for f in out.iterdir():
        f.chmod(0o644)


def write_card(path: Path, role: str, corpus: Corpus, stats: RunStats, steps_flags: str, extra: str) -> None:
    lines = [
        f"# specsched bundled {role}", "",
        f"Llama-family decoder ({extra}), trained offline by `runtime/training/bundled.py`.", "",
        f"- corpus: CPython {platform.python_version()} standard-library `.py` sources, test folders"
        f" excluded; {len(corpus.train)} train files ({corpus.num_bytes('train') / 1e6:.1f} MB),"
        f" {len(corpus.heldout)} held-out files ({corpus.num_bytes('heldout') / 1e6:.2f} MB), split by path hash",
        "- tokenizer: byte-level BPE, 4096 tokens, `<|bos|>`=0, `<|eos|>`=1 (`<|bos|> file <|eos|>` per file)",
        f"- steps: {stats.steps} x {BATCH_SIZE} x {SEQ_LEN} tokens = {stats.tokens_seen:,} tokens seen",
        f"- wall time: {stats.wall_s / 60:.1f} min on {torch.get_num_threads()} CPU thread(s), fp32",
        f"- train loss (last 20 steps): {stats.train_loss:.3f}"
        + (" (KL to target, nats/token)" if role == "draft" else " (CE, nats/token)"),
        f"- held-out CE: {stats.heldout_ce:.3f} nats/token on {NUM_EVAL_WINDOWS} x {SEQ_LEN} held-out tokens",
    ]
    if stats.agreement is not None:
        lines.append(f"- greedy agreement with the target (teacher-forced, held-out): {stats.agreement:.1%}")
    lines += [
        "", "Reproduce (needs the `dev` extra for transformers):", "",
        f"    python -m specsched.runtime.training.bundled --out runtime/bundled {steps_flags}", "",
        "Budgets are wall-clock minutes by default (lr schedule by elapsed time), so a plain rerun is",
        "approximately, not bit-, reproducible. The step flags above fix this run's step counts and",
        "data order with a step-based schedule: deterministic, close to but not identical to this run.",
        "A different Python version changes the corpus.", "",
    ]
    path.write_text("\n".join(lines))


def write_workload(corpus: Corpus, tok, path: Path, seed: int) -> None:
    prompts = function_prompts(corpus.heldout, lambda s: len(tok.encode(s).ids), NUM_WORKLOAD_PROMPTS, seed)
    lines = [json.dumps({"prompt": p, "max_tokens": WORKLOAD_MAX_TOKENS}) for p in prompts]
    path.write_text("\n".join(lines) + "\n")


def main(out_dir: str | Path, target_minutes: float = 14.0, draft_minutes: float = 6.0, seed: int = 0,
         target_steps: int | None = None, draft_steps: int | None = None,
         num_threads: int = 1) -> tuple[RunStats, RunStats]:
    """Train tokenizer, target and draft into `out_dir`; returns (target_stats, draft_stats).

    `num_threads` defaults to 1: on a shared 2-core machine two OpenMP threads spin at every
    barrier while the other core is busy; measured here 7-11 s/step with 2 threads vs 1.7-1.8
    s/step with 1.
    """
    if min(target_minutes, draft_minutes) <= 0 or num_threads < 1:
        raise ValueError("target_minutes, draft_minutes and num_threads must be positive")
    torch.set_num_threads(num_threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus()
    tok = train_tokenizer(f.text for f in corpus.train)
    bos, eos = special_ids(tok)
    tok_path = out / "tokenizer.json"
    tok.save(str(tok_path))
    write_workload(corpus, tok, out / "workload.jsonl", seed)
    train, heldout = token_stream(tok, corpus.train), token_stream(tok, corpus.heldout)
    print(f"corpus: {len(corpus.train)} train files ({train.numel()} tokens), "
          f"{len(corpus.heldout)} held-out files ({heldout.numel()} tokens)", flush=True)
    vocab = tok.get_vocab_size()
    target, t_stats = train_target(llama_config(vocab, bos, eos, 6), train, heldout,
                                   target_minutes * 60, target_steps, seed)
    save_model(target, tok_path, out / "target")
    print(f"target: {t_stats}", flush=True)
    draft, d_stats = distill_draft(llama_config(vocab, bos, eos, 1), target, train, heldout,
                                   draft_minutes * 60, draft_steps, seed)
    save_model(draft, tok_path, out / "draft")
    flags = f"--seed {seed} --threads {num_threads} --target-steps {t_stats.steps} --draft-steps {d_stats.steps}"
    write_card(out / "target" / "README.md", "target", corpus, t_stats, flags,
               "6 layers, hidden 256, 8 query / 4 key-value heads, SwiGLU 688, tied embeddings")
    write_card(out / "draft" / "README.md", "draft", corpus, d_stats, flags,
               "1 layer, same width, heads and tokenizer as the target; embeddings initialised from"
               " the target, then distilled with pure KL to the target's logits")
    print(f"draft: {d_stats}", flush=True)
    tok_path.unlink()
    return t_stats, d_stats


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runtime/bundled", help="output directory")
    p.add_argument("--target-minutes", type=float, default=14.0)
    p.add_argument("--draft-minutes", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-steps", type=int, default=None, help="fixed step count (overrides minutes)")
    p.add_argument("--draft-steps", type=int, default=None, help="fixed step count (overrides minutes)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    a = p.parse_args()
    main(a.out, a.target_minutes, a.draft_minutes, a.seed, a.target_steps, a.draft_steps, a.threads)
