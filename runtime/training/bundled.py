"""Train the bundled tiny model family: tokenizer, target (6 layers x 256 wide by default), 1-layer distilled draft.

Why: the engine, tracer and benchmarks need a real target/draft pair that runs anywhere with no
download. The corpus is the interpreter's own standard library (see corpus.py), the models are
plain Llama (transformers' LlamaForCausalLM, saved in Hugging Face layout), and the draft is
distilled from the target with pure KL so that its greedy agreement, not its perplexity, is
what improves.

Budgets are wall-clock minutes (the cosine schedule follows elapsed time), so a plain rerun is
approximately, not bit-, reproducible: a busy machine takes fewer steps. `--target-steps` and
`--draft-steps` switch to step budgets (schedule by step), which are deterministic for fixed
seeds, library versions and thread count.
`--target-shape LAYERSxHIDDEN` (default 6x256) sets the target's depth and width; the draft is one
layer of the same width. On a CPU a forward costs about the same per layer whatever its width
(benchmarks/forward_cost.py --layers), so the target's depth sets what a one-layer proposer
costs against it, and with it how far speculation can pay. `--target-grow-from DIR` starts that
target from a trained shallower one of the same width (`deepen`: the same function at step 0), so
a deeper target costs a fraction of training one from scratch; `--draft-from` continues a draft.
Needs the `dev` extra: `python -m specsched.runtime.training.bundled --out runtime/bundled`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from specsched.runtime.training.corpus import Corpus, SourceFile, function_prompts, load_corpus
from specsched.runtime.training.grow import GROW_LR, checkpoint_layers, deepen, round_to_bf16
from specsched.runtime.training.loop import (BATCH_SIZE, NUM_EVAL_WINDOWS, NUM_PROBE_WINDOWS, SEQ_LEN, LoopConfig,
                                             RunStats, bf16_supported, eval_windows, greedy_agreement, heldout_ce, logits_of,
                                             run_loop)
from specsched.runtime.training.tokenizer_train import special_ids, train_tokenizer

NUM_WORKLOAD_PROMPTS = 64
WORKLOAD_MAX_TOKENS = 64
ONPOLICY_WINDOWS = 4096  # the target's greedy continuations the draft is distilled on (onpolicy.py)
ONPOLICY_PROMPT = 128  # corpus tokens before each continuation
ONPOLICY_FRAC = 0.75  # share of each draft batch drawn from them


DEFAULT_SHAPE = "6x256"  # the target's LAYERSxHIDDEN (`--target-shape`)
HEAD_DIM = 32


def parse_shape(text: str) -> tuple[int, int]:
    """'LAYERSxHIDDEN' -> (layers, hidden); ValueError naming the problem. The hidden size is a
    multiple of 64: heads of HEAD_DIM, two query heads a key-value head."""
    try:
        layers, hidden = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"target shape {text!r} is not LAYERSxHIDDEN, e.g. {DEFAULT_SHAPE}") from None
    if layers < 1 or hidden < 64 or hidden % 64:
        raise ValueError(f"target shape {text!r}: needs at least 1 layer and a hidden size that is a "
                         f"positive multiple of 64, got {layers} layers x {hidden}")
    return layers, hidden


def shape_fields(hidden: int) -> dict[str, int]:
    """A width's heads and MLP, in the bundled proportions (256: 8 query / 4 key-value heads of
    32, SwiGLU 688)."""
    heads = hidden // HEAD_DIM
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads // 2,
            "head_dim": HEAD_DIM, "intermediate_size": hidden * 43 // 16}


def describe_shape(layers: int, hidden: int) -> str:
    f = shape_fields(hidden)
    return (f"{layers} layers, hidden {hidden}, {f['num_attention_heads']} query / {f['num_key_value_heads']} "
            f"key-value heads, SwiGLU {f['intermediate_size']}, tied embeddings")


def llama_config(vocab_size: int, bos_id: int, eos_id: int, num_layers: int, hidden_size: int = 256):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, num_hidden_layers=num_layers, **shape_fields(hidden_size),
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


def train_target(config, stream, heldout, cfg: LoopConfig, grow_from: str | Path | None = None):
    """Train a target of `config` on CE: a fresh one, or the one in `grow_from` deepened to
    its depth (`deepen`; a run resumed from `cfg.state` loads its weights over the grown ones)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config) if grow_from is None else \
        deepen(LlamaForCausalLM.from_pretrained(grow_from, dtype=torch.float32), config)

    def ce(w):
        return F.cross_entropy(logits_of(model, w[:, :-1], cfg.bf16).flatten(0, 1), w[:, 1:].flatten())

    return model, run_loop("target", model, ce, stream, heldout, cfg)


def initial_draft(config, target, init_layers: bool = True):
    """The draft before distillation: the target's embeddings and final norm and, with
    `init_layers`, its decoder layers copied from the target's first ones (the rest random).
    Distilled for 400 steps (corpus windows, bf16, same seed and schedule), a one-layer draft
    started from the target's first layer agreed with it greedily on 43.3% of held-out
    positions, against 41.0% from a random layer."""
    from transformers import LlamaForCausalLM

    draft = LlamaForCausalLM(config)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
        if init_layers:
            for d_layer, t_layer in zip(draft.model.layers, target.model.layers):
                d_layer.load_state_dict(t_layer.state_dict())
    if draft.lm_head.weight.data_ptr() != draft.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("draft lm_head is not tied to its embeddings")
    return draft


def distill_draft(config, target, stream, heldout, cfg: LoopConfig, sampler=None, onpolicy_heldout=None,
                  init_layers: bool = True, init_from: str | Path | None = None):
    """KL-distil a draft (`initial_draft`, or the draft in `init_from` continued, deepened to
    `config`'s depth by `deepen` where it is shallower); `sampler`
    draws its batches, `onpolicy_heldout` (held-out greedy continuations, onpolicy.py) replaces
    corpus windows as the probe and is measured too."""
    torch.manual_seed(cfg.seed)
    if init_from is None:
        draft = initial_draft(config, target, init_layers)
    else:
        from transformers import LlamaForCausalLM

        draft = LlamaForCausalLM.from_pretrained(init_from, dtype=torch.float32)
        if draft.config.num_hidden_layers != config.num_hidden_layers:
            draft = deepen(draft, config)
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


def save_model(model, tokenizer_path: Path, out: Path, bf16: bool = False) -> None:
    """HF layout plus the tokenizer; `bf16` stores the weights as bf16 (half the bytes; the
    runtime loads them into its own dtype)."""
    out.mkdir(parents=True, exist_ok=True)
    if bf16:
        model.to(torch.bfloat16).save_pretrained(out)
        model.float()
    else:
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
         onpolicy_windows: int = ONPOLICY_WINDOWS, draft_init_layers: bool = True,
         target_shape: str = DEFAULT_SHAPE, grow_from: str | Path | None = None, target_bf16: bool = False,
         draft_from: str | Path | None = None, draft_layers: int = 1) -> tuple[RunStats, RunStats]:
    """Train tokenizer, target and draft into `out_dir`; returns (target_stats, draft_stats).

    `state_dir`: checkpoints (and the tokenizer) live there, and a rerun with the same
    arguments continues where the last one stopped. `tokenizer`: a tokenizer.json to reuse
    instead of training one. `bf16`: autocast (default: where the CPU has native bf16). Two
    threads are fastest on an idle 2-core machine (benchmarks/train_throughput.py); with
    OMP_WAIT_POLICY=PASSIVE they also degrade gracefully when another job takes a core.
    `target_from`: load the target from this directory instead of training it (the draft
    stage alone). `onpolicy_windows`: how many of the target's greedy continuations the draft
    is distilled on (onpolicy.py; 0: corpus windows only). `draft_init_layers`: the draft's
    layers start as the target's first ones (otherwise random). `target_shape`: the trained
    target's LAYERSxHIDDEN (`parse_shape`); the draft takes the target's width. `grow_from`: a
    trained target to `deepen` to that shape and continue training (at GROW_LR) instead of
    training one from scratch. `target_bf16`: store the target's weights as bf16 (rounded before
    the draft is distilled against it). `draft_from`: continue distilling this draft (at half
    the learning rate) instead of starting from the target's first layer; `draft_layers`: the
    draft's depth (a shallower `draft_from` is deepened to it, see `deepen`).
    """
    if min(target_minutes, draft_minutes) <= 0 or min(num_threads, batch_size, draft_layers) < 1:
        raise ValueError("target_minutes, draft_minutes, num_threads, batch_size and draft_layers must be positive")
    layers, hidden = parse_shape(target_shape)
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

        target = LlamaForCausalLM.from_pretrained(target_from, dtype=torch.float32)
        t_stats = None
        layers, hidden = target.config.num_hidden_layers, target.config.hidden_size
    else:
        target, t_stats = train_target(llama_config(vocab, bos, eos, layers, hidden), train, heldout,
                                       loop("target", 3e-3 if grow_from is None else GROW_LR, seed, target_minutes,
                                            target_steps), grow_from)
        if target_bf16:
            round_to_bf16(target)
            t_stats.heldout_ce = heldout_ce(target, eval_windows(heldout, NUM_EVAL_WINDOWS))
        save_model(target, tok_path, out / "target", bf16=target_bf16)
        print(f"target: {t_stats}", flush=True)
    sampler = None
    if onpolicy_windows > 0:
        from specsched.runtime.training.onpolicy import cached_windows, greedy_windows, mixed_sampler

        def windows():
            return (greedy_windows(target, train, onpolicy_windows, SEQ_LEN + 1, ONPOLICY_PROMPT, seed + 2, eos_id=eos),
                    greedy_windows(target, heldout, NUM_EVAL_WINDOWS, SEQ_LEN + 1, ONPOLICY_PROMPT, seed + 3,
                                   eos_id=eos))

        pool, onpolicy_heldout = (windows() if state is None else
                                  cached_windows(state / "onpolicy.pt", target, (onpolicy_windows, seed), windows))
        sampler = mixed_sampler(train, pool, ONPOLICY_FRAC)
    draft, d_stats = distill_draft(llama_config(vocab, bos, eos, draft_layers, hidden), target, train, heldout,
                                   loop("draft", 2e-3 if draft_from is None else 1e-3, seed + 1, draft_minutes,
                                        draft_steps), sampler,
                                   onpolicy_heldout if onpolicy_windows > 0 else None, draft_init_layers, draft_from)
    save_model(draft, tok_path, out / "draft")
    from specsched.runtime.training.mtp_eval import draft_acceptance

    if target_from is not None and Path(target_from).resolve() != (out / "target").resolve():
        shutil.copytree(target_from, out / "target", dirs_exist_ok=True)
    acceptance = draft_acceptance(str(out / "target"), str(out / "draft"), corpus, lambda x: tok.encode(x).ids, seed)
    first = (f"--target-from {target_from} --tokenizer {Path(target_from) / 'tokenizer.json'}" if t_stats is None
             else f"--target-steps {t_stats.steps}")
    flags = (f"--seed {seed} --threads {num_threads} --batch-size {batch_size} {first}"
             f" --draft-steps {d_stats.steps} --onpolicy-windows {onpolicy_windows}"
             + (" --bf16" if bf16 else " --no-bf16") + ("" if draft_init_layers else " --no-draft-init-layers")
             + (f" --target-shape {layers}x{hidden}" if t_stats is not None and (layers, hidden) != parse_shape(DEFAULT_SHAPE)
                else "")
             + (f" --target-grow-from {grow_from}" if t_stats is not None and grow_from is not None else "")
             + (" --target-bf16" if t_stats is not None and target_bf16 else "")
             + (f" --draft-from {draft_from}" if draft_from is not None else "")
             + (f" --draft-layers {draft_layers}" if draft_layers != 1 else ""))
    from specsched.runtime.training.cards import write_card

    if t_stats is not None:
        grown = ("" if grow_from is None else
                 f"; grown from a {checkpoint_layers(grow_from)}-layer checkpoint (`{grow_from}`) by"
                 " `deepen` (each followed by a copy of itself whose residual outputs start at zero: the same"
                 " function at step 0), then trained on")
        write_card(out / "target" / "README.md", "target", corpus, t_stats, flags,
                   describe_shape(layers, hidden) + grown + ("; weights stored as bf16" if target_bf16 else ""))
    data = ("" if onpolicy_windows <= 0 else
            f"; {ONPOLICY_FRAC:.0%} of each batch from {onpolicy_windows} windows of {ONPOLICY_PROMPT} train-corpus"
            " tokens and the target's greedy continuation (on-policy data), the rest corpus windows")
    write_card(out / "draft" / "README.md", "draft", corpus, d_stats, flags,
               f"{draft_layers} layer{'s' if draft_layers > 1 else ''}, same width, heads and tokenizer as the target; "
               + ("embeddings and final norm" + (", and the layers from the target's first ones," if draft_init_layers
                                                 else "") + " initialised from the target" if draft_from is None
                  else f"started from the draft in `{draft_from}`"
                  + ("" if checkpoint_layers(draft_from) == draft_layers else
                     f" deepened from {checkpoint_layers(draft_from)} to {draft_layers} layers by `deepen`"))
               + ", then distilled with pure KL to the target's logits" + data,
               acceptance)
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
    p.add_argument("--draft-init-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="start the draft's layers from the target's first ones (default) or random")
    p.add_argument("--target-shape", default=DEFAULT_SHAPE, help="the target's LAYERSxHIDDEN (the draft: 1 layer, same width)")
    p.add_argument("--target-grow-from", default=None,
                   help="a trained target of the same width to deepen to --target-shape and continue training")
    p.add_argument("--target-bf16", action="store_true", help="store the target's weights as bf16")
    p.add_argument("--draft-from", default=None, help="continue distilling this draft instead of a new one")
    p.add_argument("--draft-layers", type=int, default=1,
                   help="the draft's depth (a shallower --draft-from is deepened to it)")
    a = p.parse_args()
    try:
        parse_shape(a.target_shape)
    except ValueError as exc:
        p.error(str(exc))
    main(a.out, a.target_minutes, a.draft_minutes, a.seed, a.target_steps, a.draft_steps, a.threads,
         a.state, a.tokenizer, a.bf16, a.batch_size, a.target_from, a.onpolicy_windows, a.draft_init_layers,
         a.target_shape, a.target_grow_from, a.target_bf16, a.draft_from, a.draft_layers)
