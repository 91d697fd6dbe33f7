"""How often other models pick the target's greedy token, and how sure the target is of it.

Why: a proposer's greedy agreement with the target bounds its acceptance, and how high it can
go is set by the target as much as by the proposer: where the target's top-1 probability is
low, the target's argmax is a near-tie that a model of another size breaks its own way. Put
next to a proposer a reference model of nearly the target's loss (a checkpoint the target was
grown or continued from) and the reference's agreement is the ceiling a far cheaper proposer
can hope for.

    python benchmarks/agreement.py --models runtime/bundled/draft ../family6/runtime/bundled/target

Teacher-forced, fp32, on held-out corpus windows and on the target's greedy continuations of
held-out prompts (the model cards' two figures, same windows and seeds); the same tokenizer
for every model. Needs the `dev` extra (transformers).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=REPO / "runtime" / "bundled" / "target")
    ap.add_argument("--models", type=Path, nargs="+", required=True, help="checkpoints (HF layout) to compare")
    ap.add_argument("--windows", type=int, default=64, help="windows of 256 tokens of each kind")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from specsched.runtime.training.bundled import ONPOLICY_PROMPT, token_stream
    from specsched.runtime.training.corpus import load_corpus
    from specsched.runtime.training.loop import SEQ_LEN, eval_windows, logits_of
    from specsched.runtime.training.onpolicy import greedy_windows
    from specsched.runtime.training.tokenizer_train import special_ids

    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    _, eos = special_ids(tok)
    heldout = token_stream(tok, load_corpus().heldout)

    def load(path: Path):
        return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    target = load(args.target)
    kinds = {
        "held-out corpus": eval_windows(heldout, args.windows),
        # seed 3: the cards' on-policy figure (bundled.py, seed 0 + 3)
        "target's continuations": greedy_windows(target, heldout, args.windows, SEQ_LEN + 1, ONPOLICY_PROMPT, 3,
                                                 eos_id=eos, log=lambda *_: None),
    }
    models = {os.path.relpath(p): load(p) for p in args.models}
    print(f"target {os.path.relpath(args.target)}: {target.config.num_hidden_layers} layers; {args.windows} windows x {SEQ_LEN} "
          "positions of each kind")

    def argmax_and_top1(model, windows):
        with torch.no_grad():
            probs = [F.softmax(logits_of(model, windows[i : i + 16, :-1]), -1) for i in range(0, len(windows), 16)]
        return torch.cat([p.argmax(-1).flatten() for p in probs]), torch.cat([p.amax(-1).flatten() for p in probs])

    for kind, windows in kinds.items():
        picks, top1 = argmax_and_top1(target, windows)
        sure = top1 >= 0.5
        share = ", ".join(f">= {t}: {(top1 >= t).float().mean():.1%}" for t in (0.3, 0.5, 0.7, 0.9))
        print(f"\n{kind}: the target's top-1 probability, mean {top1.mean():.3f}; positions with it {share}")
        print(f"  {'model':<52} agreement  (top-1 >= 0.5 / < 0.5)")
        for name, model in models.items():
            same = argmax_and_top1(model, windows)[0] == picks
            label = f"{model.config.num_hidden_layers}-layer {name}"
            print(f"  {label:<52} {same.float().mean():>8.1%}  ({same[sure].float().mean():.1%} / "
                  f"{same[~sure].float().mean():.1%})")


if __name__ == "__main__":
    main()
