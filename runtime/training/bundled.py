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
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specsched.runtime.training.corpus import Corpus, SourceFile, function_prompts, load_corpus
from specsched.runtime.training.tokenizer_train import special_ids, train_tokenizer

SEQ_LEN = 256
BATCH_SIZE = 16
NUM_WORKLOAD_PROMPTS = 64
WORKLOAD_MAX_TOKENS = 64
WARMUP_STEPS = 100
EVAL_EVERY = 200  # steps between held-out probes (the best probe's weights are what is saved)
NUM_PROBE_WINDOWS = 32
NUM_EVAL_WINDOWS = 64  # held-out windows for the final numbers
CHECKPOINT_EVERY_S = 180.0
ONPOLICY_WINDOWS = 4096  # the target's greedy continuations the draft is distilled on (onpolicy.py)
ONPOLICY_PROMPT = 128  # corpus tokens before each continuation
ONPOLICY_FRAC = 0.75  # share of each draft batch drawn from them


def bf16_supported() -> bool:
    """bf16 autocast pays only where the CPU multiplies bf16 natively (AVX512-BF16 / AMX):
    measured by benchmarks/train_throughput.py at 1.46x fp32 on one such core; elsewhere the
    emulated kernels are several times slower than fp32. oneDNN reports bf16 support wherever it
    can emulate it, so the CPU's own flags decide."""
    cpu = torch.cpu
    native = [getattr(cpu, f, None) for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(f is not None for f in native):
        return any(bool(f()) for f in native if f is not None)
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class RunStats:
    steps: int  # optimizer steps taken
    tokens_seen: int  # training tokens (steps * batch * seq_len)
    wall_s: float  # wall time of the training loop, evals included (summed over resumed runs)
    train_loss: float  # mean loss over the last 20 steps (CE for target, KL for draft)
    heldout_ce: float  # next-token cross-entropy on held-out windows, nats/token
    agreement: float | None = None  # draft only: teacher-forced greedy agreement with target
    onpolicy_agreement: float | None = None  # draft only: the same on held-out greedy continuations
    best_step: int = 0  # step of the saved weights: the best held-out probe
    batch_size: int = BATCH_SIZE
    threads: int = 1
    precision: str = "fp32"


@dataclass
class LoopConfig:
    """One training loop's knobs. `steps` fixes the step count (lr schedule by step, data order
    fixed by `seed`: deterministic and resumable exactly); otherwise the run lasts `budget_s` of
    wall time. `state` is a checkpoint file: saved every CHECKPOINT_EVERY_S and at the end, and
    a run started with an existing one continues from it (same step, optimizer, data order)."""

    peak_lr: float
    seed: int
    steps: int | None = None
    budget_s: float | None = None
    batch_size: int = BATCH_SIZE
    bf16: bool = False
    state: Path | None = None


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


def random_windows(stream: torch.Tensor, gen: torch.Generator, batch_size: int = BATCH_SIZE) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - SEQ_LEN - 1, (batch_size,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])  # [B, T+1]


def eval_windows(stream: torch.Tensor, num: int) -> torch.Tensor:
    num = min(num, (stream.numel() - 1) // (SEQ_LEN + 1))
    return stream[: num * (SEQ_LEN + 1)].view(num, SEQ_LEN + 1)  # [N, T+1]


def lr_at(step: int, progress: float, peak: float, warmup: int = WARMUP_STEPS) -> float:
    """Linear warmup over `warmup` steps, then cosine to 10% of peak over `progress` in [0, 1]
    (the schedule of every bundled model: target, draft and MTP head)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def logits_of(model, ids: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(input_ids=ids).logits.float()  # [B, T, V]


@torch.no_grad()
def heldout_ce(model, windows: torch.Tensor, batch: int = 16) -> float:
    """fp32, whatever the training precision: the number a card reports is the shipped model's."""
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
    """Fraction of positions where draft argmax == target argmax (teacher-forced, fp32)."""
    draft.eval()
    same = 0
    for i in range(0, len(windows), batch):
        ids = windows[i : i + batch, :-1]
        same += (logits_of(draft, ids).argmax(-1) == logits_of(target, ids).argmax(-1)).sum().item()
    draft.train()
    return same / (windows.shape[0] * SEQ_LEN)


def _save_state(path: Path, state: dict) -> None:
    """Write-then-rename, so a run killed while saving keeps the previous checkpoint."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def run_loop(name, model, loss_fn, stream, heldout, cfg: LoopConfig, probe_fn=None, sampler=None) -> RunStats:
    """AdamW + warmup/cosine over `cfg.steps` steps or `cfg.budget_s` of wall time; the saved
    weights are those of the best held-out probe (every EVAL_EVERY steps and at the end):
    `probe_fn(windows)`, lower is better, held-out cross-entropy by default. `sampler(gen,
    batch_size)` draws the training batches (random windows of `stream` by default)."""
    if (cfg.steps is None) == (cfg.budget_s is None):
        raise ValueError("give exactly one of steps and budget_s")
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    probe = eval_windows(heldout, NUM_PROBE_WINDOWS)
    probe_fn = probe_fn or (lambda w: heldout_ce(model, w))
    losses: list[float] = []
    step, prev_s, best = 0, 0.0, (math.inf, 0, None)
    if cfg.state is not None and cfg.state.exists():
        st = torch.load(cfg.state, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, prev_s, losses, best = st["step"], st["wall_s"], st["losses"], st["best"]
        print(f"[{name}] resumed at step {step} ({prev_s:.0f}s trained)", flush=True)
        if st.get("done"):  # the card reports the threads it was trained with
            return _finish(model, heldout, cfg, step, prev_s, losses, best, st.get("threads"))

    def snapshot(done: bool) -> None:
        if cfg.state is not None:
            _save_state(cfg.state, {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                                    "step": step, "wall_s": elapsed, "losses": losses, "best": best, "done": done,
                                    "threads": torch.get_num_threads()})

    start = time.perf_counter()
    last_save = start
    elapsed = prev_s
    progress = step / cfg.steps if cfg.steps is not None else elapsed / cfg.budget_s
    while progress < 1.0:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, cfg.peak_lr)
        with torch.enable_grad():  # grad mode is global, and a ModelWorker in this process turns it off
            loss = loss_fn(sampler(gen, cfg.batch_size) if sampler else random_windows(stream, gen, cfg.batch_size))
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        elapsed = prev_s + time.perf_counter() - start
        progress = step / cfg.steps if cfg.steps is not None else elapsed / cfg.budget_s
        if step % EVAL_EVERY == 0 or progress >= 1.0:
            ce = probe_fn(probe)
            if ce < best[0]:
                best = (ce, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            print(f"[{name}] step {step} {elapsed:.0f}s ({elapsed / step:.2f} s/step) "
                  f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f} probe {ce:.4f} (best {best[0]:.4f} "
                  f"at {best[1]})", flush=True)
        if time.perf_counter() - last_save >= CHECKPOINT_EVERY_S:
            snapshot(False)
            last_save = time.perf_counter()
    snapshot(True)
    return _finish(model, heldout, cfg, step, elapsed, losses, best)


def _finish(model, heldout, cfg: LoopConfig, step, wall_s, losses, best, threads: int | None = None) -> RunStats:
    if best[2] is not None:
        model.load_state_dict(best[2])
    tail = losses[-20:]
    return RunStats(step, step * cfg.batch_size * SEQ_LEN, wall_s, sum(tail) / len(tail),
                    heldout_ce(model, eval_windows(heldout, NUM_EVAL_WINDOWS)), best_step=best[1],
                    batch_size=cfg.batch_size, threads=threads or torch.get_num_threads(),
                    precision="bf16 autocast" if cfg.bf16 else "fp32")


def train_target(config, stream, heldout, cfg: LoopConfig):
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)

    def ce(w):
        return F.cross_entropy(logits_of(model, w[:, :-1], cfg.bf16).flatten(0, 1), w[:, 1:].flatten())

    return model, run_loop("target", model, ce, stream, heldout, cfg)


def distill_draft(config, target, stream, heldout, cfg: LoopConfig, sampler=None, onpolicy_heldout=None):
    """KL-distil a draft; `sampler` draws its batches, `onpolicy_heldout` (held-out greedy
    continuations, onpolicy.py) replaces corpus windows as the probe and is measured too."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
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
            t_logp = F.log_softmax(logits_of(target, ids, cfg.bf16), -1).flatten(0, 1)
        d_logp = F.log_softmax(logits_of(draft, ids, cfg.bf16), -1).flatten(0, 1)
        return F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")

    # the draft is kept for agreeing with the target, not for its own perplexity
    def probe(w):
        return 1.0 - greedy_agreement(draft, target, w if onpolicy_heldout is None else onpolicy_heldout[:NUM_PROBE_WINDOWS])

    stats = run_loop("draft", draft, kl, stream, heldout, cfg, probe, sampler)
    stats.agreement = greedy_agreement(draft, target, eval_windows(heldout, NUM_EVAL_WINDOWS))
    if onpolicy_heldout is not None:
        stats.onpolicy_agreement = greedy_agreement(draft, target, onpolicy_heldout)
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


def write_workload(corpus: Corpus, tok, path: Path, seed: int) -> None:
    prompts = function_prompts(corpus.heldout, lambda s: len(tok.encode(s).ids), NUM_WORKLOAD_PROMPTS, seed)
    lines = [json.dumps({"prompt": p, "max_tokens": WORKLOAD_MAX_TOKENS}) for p in prompts]
    path.write_text("\n".join(lines) + "\n")


def main(out_dir: str | Path, target_minutes: float = 60.0, draft_minutes: float = 15.0, seed: int = 0,
         target_steps: int | None = None, draft_steps: int | None = None, num_threads: int = 2,
         state_dir: str | Path | None = None, tokenizer: str | Path | None = None,
         bf16: bool | None = None, batch_size: int = BATCH_SIZE, target_from: str | Path | None = None,
         onpolicy_windows: int = ONPOLICY_WINDOWS) -> tuple[RunStats, RunStats]:
    """Train tokenizer, target and draft into `out_dir`; returns (target_stats, draft_stats).

    `state_dir`: checkpoints (and the tokenizer) live there, and a rerun with the same
    arguments continues where the last one stopped. `tokenizer`: a tokenizer.json to reuse
    instead of training one. `bf16`: autocast (default: where the CPU has native bf16). Two
    threads are fastest on an idle 2-core machine (benchmarks/train_throughput.py); with
    OMP_WAIT_POLICY=PASSIVE they also degrade gracefully when another job takes a core.
    `target_from`: load the target from this directory instead of training it (the draft
    stage alone). `onpolicy_windows`: how many of the target's greedy continuations the draft
    is distilled on (onpolicy.py; 0: corpus windows only).
    """
    if min(target_minutes, draft_minutes) <= 0 or num_threads < 1 or batch_size < 1:
        raise ValueError("target_minutes, draft_minutes, num_threads and batch_size must be positive")
    torch.set_num_threads(num_threads)
    bf16 = bf16_supported() if bf16 is None else bf16
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = Path(state_dir) if state_dir is not None else None
    if state is not None:
        state.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus()
    tok_path = out / "tokenizer.json"
    saved_tok = state / "tokenizer.json" if state is not None else None
    if tokenizer is not None or (saved_tok is not None and saved_tok.exists()):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer if tokenizer is not None else saved_tok))
    else:
        tok = train_tokenizer(f.text for f in corpus.train)
    bos, eos = special_ids(tok)
    tok.save(str(tok_path))
    if saved_tok is not None:
        tok.save(str(saved_tok))
    write_workload(corpus, tok, out / "workload.jsonl", seed)
    train, heldout = token_stream(tok, corpus.train), token_stream(tok, corpus.heldout)
    print(f"corpus: {len(corpus.train)} train files ({train.numel()} tokens), "
          f"{len(corpus.heldout)} held-out files ({heldout.numel()} tokens); bf16 autocast {bf16}, "
          f"{num_threads} thread(s), batch {batch_size}", flush=True)
    vocab = tok.get_vocab_size()

    def loop(name: str, lr: float, s: int, minutes: float, steps: int | None) -> LoopConfig:
        return LoopConfig(peak_lr=lr, seed=s, steps=steps, budget_s=None if steps is not None else minutes * 60,
                          batch_size=batch_size, bf16=bf16, state=state / f"{name}.pt" if state is not None else None)

    if target_from is not None:
        from transformers import LlamaForCausalLM

        target = LlamaForCausalLM.from_pretrained(target_from)
        t_stats = None
    else:
        target, t_stats = train_target(llama_config(vocab, bos, eos, 6), train, heldout,
                                       loop("target", 3e-3, seed, target_minutes, target_steps))
        save_model(target, tok_path, out / "target")
        print(f"target: {t_stats}", flush=True)
    sampler = None
    if onpolicy_windows > 0:
        from specsched.runtime.training.onpolicy import greedy_windows, mixed_sampler

        pool = greedy_windows(target, train, onpolicy_windows, SEQ_LEN + 1, ONPOLICY_PROMPT, seed + 2, eos_id=eos)
        sampler = mixed_sampler(train, pool, ONPOLICY_FRAC)
        onpolicy_heldout = greedy_windows(target, heldout, NUM_EVAL_WINDOWS, SEQ_LEN + 1, ONPOLICY_PROMPT,
                                          seed + 3, eos_id=eos)
    draft, d_stats = distill_draft(llama_config(vocab, bos, eos, 1), target, train, heldout,
                                   loop("draft", 2e-3, seed + 1, draft_minutes, draft_steps), sampler,
                                   onpolicy_heldout if onpolicy_windows > 0 else None)
    save_model(draft, tok_path, out / "draft")
    from specsched.runtime.training.mtp_eval import draft_acceptance

    if target_from is not None and Path(target_from).resolve() != (out / "target").resolve():
        shutil.copytree(target_from, out / "target", dirs_exist_ok=True)
    acceptance = draft_acceptance(str(out / "target"), str(out / "draft"), corpus, lambda x: tok.encode(x).ids, seed)
    first = (f"--target-from {target_from} --tokenizer {Path(target_from) / 'tokenizer.json'}" if t_stats is None
             else f"--target-steps {t_stats.steps}")
    flags = (f"--seed {seed} --threads {num_threads} --batch-size {batch_size} {first}"
             f" --draft-steps {d_stats.steps} --onpolicy-windows {onpolicy_windows}" + ("" if bf16 else " --no-bf16"))
    from specsched.runtime.training.cards import write_card

    if t_stats is not None:
        write_card(out / "target" / "README.md", "target", corpus, t_stats, flags,
                   "6 layers, hidden 256, 8 query / 4 key-value heads, SwiGLU 688, tied embeddings")
    data = ("" if onpolicy_windows <= 0 else
            f"; {ONPOLICY_FRAC:.0%} of each batch from {onpolicy_windows} windows of {ONPOLICY_PROMPT} train-corpus"
            " tokens and the target's greedy continuation (on-policy data), the rest corpus windows")
    write_card(out / "draft" / "README.md", "draft", corpus, d_stats, flags,
               "1 layer, same width, heads and tokenizer as the target; embeddings initialised from"
               " the target, then distilled with pure KL to the target's logits" + data, acceptance)
    print(f"draft: {d_stats}", flush=True)
    tok_path.unlink()
    return t_stats, d_stats


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runtime/bundled", help="output directory")
    p.add_argument("--target-minutes", type=float, default=60.0)
    p.add_argument("--draft-minutes", type=float, default=15.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-steps", type=int, default=None, help="fixed step count (overrides minutes)")
    p.add_argument("--draft-steps", type=int, default=None, help="fixed step count (overrides minutes)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="windows per step")
    p.add_argument("--state", default=None, help="checkpoint dir: a rerun continues from it")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer.json instead of training one")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: where the CPU has native bf16)")
    p.add_argument("--target-from", default=None, help="load the target from this directory instead of training it")
    p.add_argument("--onpolicy-windows", type=int, default=ONPOLICY_WINDOWS,
                   help="target greedy continuations to distil the draft on (0: corpus only)")
    a = p.parse_args()
    main(a.out, a.target_minutes, a.draft_minutes, a.seed, a.target_steps, a.draft_steps, a.threads,
         a.state, a.tokenizer, a.bf16, a.batch_size, a.target_from, a.onpolicy_windows)
