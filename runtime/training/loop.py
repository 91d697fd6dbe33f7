"""The training loop of the bundled models: AdamW with warmup and cosine, held-out probes that
keep the best weights, and checkpoints that make a stopped run continue where it was.

Why a module of its own: the target, the draft (runtime/training/bundled.py) and the MTP head
(runtime/training/mtp.py) share the schedule and the measurements (held-out cross-entropy,
greedy agreement); bundled.py keeps what is particular to the family (model shapes, the
corpus streams, the cards' inputs).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SEQ_LEN = 256
BATCH_SIZE = 16
WARMUP_STEPS = 100
EVAL_EVERY = 200  # steps between held-out probes (the best probe's weights are what is saved)
NUM_PROBE_WINDOWS = 32
NUM_EVAL_WINDOWS = 64  # held-out windows for the final numbers
CHECKPOINT_EVERY_S = 180.0


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
