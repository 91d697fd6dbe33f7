"""The model cards (README.md next to the weights): the target's and the draft's, an MTP / EAGLE-3
head's (`write_head_card`, from training/mtp.py's report), and how every card is written over an
earlier one (`save_card`).

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


def loss_terms(parts: dict[str, float]) -> str:
    """A training log's loss terms, `name value` each."""
    return " ".join(f"{k} {v:.3f}" for k, v in parts.items())


def _cell(v: dict | None, key: str) -> str:
    return "-" if v is None or key not in v else f"{v[key]['mean_acceptance_length']:.2f}"


def write_head_card(path: Path, report: dict, shipped: str) -> None:
    """An MTP (or EAGLE-3) head's model card: data, training, and acceptance through the inference path."""
    from specsched.runtime.training.mtp import TrainConfig  # the defaults its command leaves out

    cfg, variants = report["config"], report["variants"]
    main = variants[shipped]
    t, v = main["train"], main.get("validation") or {}
    steps_flag = f"--steps {t['steps']}"
    flags = f"{steps_flag} --seed {cfg['seed']} --threads {report['num_threads']} --windows {report['corpus']['train_windows']}"
    flags += " --bf16" if cfg.get("bf16") else " --no-bf16"
    if report["corpus"].get("onpolicy_windows"):
        flags += f" --onpolicy-frac {report['corpus']['onpolicy_windows'] / report['corpus']['train_windows']:g}"
    flags += " --no-norms" if shipped == "no_norms" else ""
    flags += " --layout eagle3" if report.get("layout") == "eagle3" else ""
    aux = report.get("aux_layers") or []
    flags += f" --aux-layers {','.join(map(str, aux))}" if aux else ""
    flags += f" --init-from {report['init_from']}" if report.get("init_from") else ""
    flags += f" --lr {cfg['lr']:g}" if cfg["lr"] != TrainConfig.lr else ""
    if len(variants) > 1:
        flags += " --ablation"
    eagle_key = next((k for k in v if k.startswith("eagle")), None)
    lines = [
        "# specsched bundled MTP head", "",
        "DeepSeek-V3-style multi-token-prediction head for the bundled target: RMSNorm'd next-token",
        "embedding and RMSNorm'd target hidden state (before the final norm), concatenated and",
        "projected 2H -> H, one decoder layer shaped like the target's, a final RMSNorm, then the",
        "target's own embedding / lm_head (shared, frozen, not stored here). Trained by",
        "`runtime/training/mtp.py`; used by `--spec mtp` (linear drafts) and `--spec eagle` (top-k tree).",
        *([f"The target hidden state joins the outputs of its layers {aux} (EAGLE-3's features), mapped",
           f"{len(aux) + 1}H -> H by `fc` before hnorm."] if aux else []),
        *([f"Training continued from the head in `{report['init_from']}`."] if report.get("init_from") else []),
        "",
        f"- target: `{Path(report['target']).name}`, fingerprint `{report['target_fingerprint']}`"
        " (loading refuses a head trained for another target)",
        f"- corpus: the interpreter's standard library (as for the target): {report['corpus']['train_files']}"
        f" train / {report['corpus']['heldout_files']} held-out files; {report['corpus']['train_windows']} random"
        f" train windows of {report['corpus']['window_tokens']} tokens"
        + (f", {report['corpus']['onpolicy_windows']} of them continued by the target's greedy tokens after their"
           f" first {report['corpus']['onpolicy_prompt']} (on-policy data)" if report['corpus'].get('onpolicy_windows')
           else ""),
        f"- target hidden states precomputed with the runtime's `LlamaModel.forward_full` in"
        f" {report['precompute_s']:.0f} s",
        f"- training: {t['steps']} AdamW steps x {cfg['batch_size']} windows x {cfg['seq_len']} head positions"
        f" ({t['tokens_seen']:,} positions), lr {cfg['lr']} warmup + cosine, {t['train_s'] / 60:.1f} min on"
        f" {report['num_threads']} CPU threads, " + ("bf16 autocast" if cfg.get("bf16") else "fp32"),
        f"- loss = KL(target || head) + {cfg['ce_weight']} CE + {cfg['hidden_weight']} relative hidden MSE;"
        f" first 10 steps: {loss_terms(t['first_loss'])}; last 20 steps: {loss_terms(t['final_loss'])}",
        "",
        "## Acceptance, measured through the inference implementation", "",
        "Paged target prefill + paged head on held-out text (first-token agreement with the target's",
        "greedy token), then greedy generation through the engine's pipeline and worker on"
        f" {v.get('num_prompts', '?')} held-out",
        f"function prompts x {v.get('max_tokens', '?')} tokens (outputs checked identical to plain greedy):",
        "mean acceptance length AL = 1 + accepted / drafts.", "",
        "| head | first-token agreement | AL D=1 | AL D=2 | AL D=3 | AL eagle tree |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in variants.items():
        val = entry.get("validation")
        label = ("with enorm/hnorm (shipped)" if name == shipped else "with enorm/hnorm") if name == "norms" \
            else ("without enorm/hnorm (EAGLE layout" + (", shipped)" if name == shipped else ", not shipped)"))
        agree = f"{val['paged_agreement']:.1%}" if val else "-"
        lines.append(f"| {label} | {agree} | {_cell(val, 'mtp D=1')} | {_cell(val, 'mtp D=2')} |"
                     f" {_cell(val, 'mtp D=3')} | {_cell(val, eagle_key) if eagle_key else '-'} |")
    if v:
        lines += ["", f"Per-position acceptance at D=3 (shipped head): {v['mtp D=3']['acceptance_per_position']}."]
        if eagle_key:
            lines.append(f"Eagle tree: `{eagle_key}` (default_tree), verified greedily in one target forward.")
    if len(variants) > 1:
        lines += ["", "Both variants trained on the same precomputed data for the same number of steps, same seed."]
    lines += [
        "", "## Reproduce", "",
        "    specsched train-mtp --target runtime/bundled/target --out runtime/bundled/mtp", "",
        "trains for a wall-clock budget (6 min by default; a busy machine takes fewer steps). This",
        "run exactly (step schedule, same seed, data order and thread count; `--ablation` also",
        "retrains the variant without the norms for the table above):", "",
        f"    specsched train-mtp --target runtime/bundled/target --out runtime/bundled/mtp {flags}", "",
    ]
    save_card(path, lines)
