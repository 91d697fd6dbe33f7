"""The target's and the draft's model cards (README.md next to their weights), and how every
card (the MTP head's too, training/mtp.py) is written over an earlier one (`save_card`).

Why a module of its own: the training loop (bundled.py) says how the models are trained; this
says what a card reports of a run -- data, steps, probes, held-out figures, acceptance along
the decode path and the exact command that reproduces it.
"""
from __future__ import annotations

import platform
import re
from pathlib import Path

from specsched.runtime.training.bundled import ONPOLICY_PROMPT
from specsched.runtime.training.loop import EVAL_EVERY, NUM_EVAL_WINDOWS, NUM_PROBE_WINDOWS, SEQ_LEN, WARMUP_STEPS, RunStats
from specsched.runtime.training.corpus import Corpus


def write_card(path: Path, role: str, corpus: Corpus, stats: RunStats, steps_flags: str, extra: str,
               acceptance: dict | None = None) -> None:
    lines = [
        f"# specsched bundled {role}", "",
        f"Llama-family decoder ({extra}), trained offline by `runtime/training/bundled.py`.", "",
        f"- corpus: CPython {platform.python_version()} standard-library `.py` sources, test folders"
        f" excluded; {len(corpus.train)} train files ({corpus.num_bytes('train') / 1e6:.1f} MB),"
        f" {len(corpus.heldout)} held-out files ({corpus.num_bytes('heldout') / 1e6:.2f} MB), split by path hash",
        "- tokenizer: byte-level BPE, 4096 tokens, `<|bos|>`=0, `<|eos|>`=1 (`<|bos|> file <|eos|>` per file)",
        f"- steps: {stats.steps} x {stats.batch_size} x {SEQ_LEN} tokens = {stats.tokens_seen:,} tokens seen;"
        f" AdamW, {WARMUP_STEPS} warm-up steps then cosine to 10% of the peak learning rate",
        f"- saved weights: step {stats.best_step}, the best of the held-out probes ({NUM_PROBE_WINDOWS} windows"
        f" every {EVAL_EVERY} steps; " + ("greedy agreement" if role == "draft" else "cross-entropy") + ")",
        f"- wall time: {stats.wall_s / 60:.1f} min on {stats.threads} CPU thread(s), {stats.precision}",
        f"- train loss (last 20 steps): {stats.train_loss:.3f}"
        + (" (KL to target, nats/token)" if role == "draft" else " (CE, nats/token)"),
        f"- held-out CE: {stats.heldout_ce:.3f} nats/token on {NUM_EVAL_WINDOWS} x {SEQ_LEN} held-out tokens (fp32)",
    ]
    if stats.agreement is not None:
        lines.append(f"- greedy agreement with the target (teacher-forced, held-out, fp32): {stats.agreement:.1%}")
    if stats.onpolicy_agreement is not None:
        lines.append(f"- the same on {NUM_EVAL_WINDOWS} held-out windows of {ONPOLICY_PROMPT} corpus tokens and the"
                     f" target's greedy continuation: {stats.onpolicy_agreement:.1%}")
    if acceptance:
        from specsched.runtime.training.mtp_eval import acceptance_table

        lines += acceptance_table(acceptance)
    lines += [
        "", "Reproduce (needs the `dev` extra for transformers; `OMP_WAIT_POLICY=PASSIVE` keeps two",
        "threads from spinning when the machine is shared):", "",
        f"    OMP_WAIT_POLICY=PASSIVE python -m specsched.runtime.training.bundled --out runtime/bundled {steps_flags}",
        "",
        "The step flags fix the step counts, data order and learning-rate schedule; `--state DIR` makes",
        "a stopped run resumable from its last checkpoint. Without step flags the budgets are",
        "wall-clock minutes (schedule by elapsed time), approximately, not bit-, reproducible. A",
        "different Python version changes the corpus.", "",
    ]
    save_card(path, lines)


_SECTION = re.compile(r"^## ", re.MULTILINE)


def _sections(text: str) -> dict[str, str]:
    """A card's `## ` sections by heading line, each up to the next (the text before the first
    is left out)."""
    starts = [m.start() for m in _SECTION.finditer(text)] + [len(text)]
    return {text[a:b].split("\n", 1)[0].strip(): text[a:b].rstrip("\n") for a, b in zip(starts, starts[1:])}


def save_card(path: Path, lines: list[str]) -> None:
    """Write a generated card (`lines`) at `path`, keeping the sections written by hand: any
    `## ` section of the card already there whose heading the generated one lacks (an ablation
    measured in another run, say) stays, in its order, before the generated `## Reproduce`
    section (at the end where there is none). A rerun of a card's command then updates its
    figures without dropping what was added to it."""
    text = "\n".join(lines)
    old = path.read_text() if path.exists() else ""
    new_heads = _sections(text)
    kept = [body for head, body in _sections(old).items() if head not in new_heads]
    if kept:
        notes = "\n\n".join(kept)
        at = text.find("\n## Reproduce")
        text = text.rstrip("\n") + "\n\n" + notes + "\n" if at < 0 else text[: at + 1] + notes + "\n\n" + text[at + 1:]
    path.write_text(text)
