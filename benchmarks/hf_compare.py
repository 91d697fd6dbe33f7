"""specsched against Hugging Face transformers on the same weights, greedy, outputs checked.

HF: `generate` plain, `generate(assistant_model=draft)` (assisted generation) and
`generate(prompt_lookup_num_tokens=K)`, one request after another (HF's assisted generation is
batch-1 only). specsched: plain, draft (overlap schedule) and n-gram, at batch 1 (one request
at a time) and with 8 concurrent requests. Every output is compared token by token with HF's
plain greedy output. Prints tokens/s and ratios measured side by side in this one run.

    python benchmarks/hf_compare.py [--num-requests 8] [--max-tokens 64] [--draft-len 4]
"""
from __future__ import annotations

import argparse
import time

import anyio
import torch


def hf_runs(prompts_ids, max_tokens, k, threads):
    from transformers import LlamaForCausalLM

    from specsched.runtime import bundled

    torch.set_num_threads(threads)
    target = LlamaForCausalLM.from_pretrained(str(bundled.target_dir()), torch_dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(str(bundled.draft_dir()), torch_dtype=torch.float32).eval()
    common = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    variants = {
        "plain": {},
        "assisted": {"assistant_model": draft, "num_assistant_tokens": k,
                     "num_assistant_tokens_schedule": "constant"},
        "prompt_lookup": {"prompt_lookup_num_tokens": k},
    }
    results = {}
    with torch.inference_mode():
        for name, extra in variants.items():
            ids = torch.tensor([prompts_ids[0]])
            target.generate(ids, **(common | extra | {"max_new_tokens": 4, "min_new_tokens": 4}))  # warm-up
            outs, t0 = [], time.perf_counter()
            for p in prompts_ids:
                out = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      **(common | extra))
                outs.append(out[0, len(p):].tolist())
            results[name] = (time.perf_counter() - t0, outs)
    return results


def specsched_runs(prompts_ids, max_tokens, k):
    from specsched.runtime.bench import run_workload
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.workload import WorkItem
    from specsched.scheduler.sampling_params import SamplingParams

    items = [WorkItem(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts_ids]
    variants = {"plain": dict(proposer="none", schedule="sync"), "draft": dict(proposer="draft", draft_len=k, schedule="overlap"),
                "ngram": dict(proposer="ngram", draft_len=k)}
    results = {}
    for name, kw in variants.items():
        for conc in (1, 8):
            cfg = EngineConfig.make(**kw)
            metrics, _, outs = anyio.run(lambda: run_workload(cfg, items, concurrency=conc, warmup=1, agreement=False))
            results[(name, conc)] = (metrics["duration_s"], [o.token_ids for o in outs], metrics)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--hf-threads", type=int, default=1, help="torch threads for HF (specsched's worker uses 1)")
    args = ap.parse_args()

    from specsched.runtime import bundled
    from specsched.runtime.tokenizer import Tokenizer
    from specsched.runtime.workload import load_workload

    tok = Tokenizer(bundled.target_dir())
    items = load_workload(bundled.workload_path(), limit=args.num_requests)
    prompts = [tok.encode(it.prompt) for it in items]
    n_tokens = len(prompts) * args.max_tokens

    hf = hf_runs(prompts, args.max_tokens, args.draft_len, args.hf_threads)
    ours = specsched_runs(prompts, args.max_tokens, args.draft_len)
    ref = hf["plain"][1]

    print(f"{len(prompts)} requests x {args.max_tokens} tokens, greedy, K=D={args.draft_len}, "
          f"HF torch threads={args.hf_threads}")
    print(f"{'system':<34} {'tok/s':>8} {'vs HF plain':>12} {'identical':>10}")
    hf_plain_tps = n_tokens / hf["plain"][0]
    for name, (secs, outs) in hf.items():
        print(f"{'HF ' + name:<34} {n_tokens / secs:>8.1f} {n_tokens / secs / hf_plain_tps:>11.2f}x {str(outs == ref):>10}")
    for (name, conc), (secs, outs, m) in ours.items():
        label = f"specsched {name} ({'batch 1' if conc == 1 else f'{conc} concurrent'})"
        tps = n_tokens / secs
        print(f"{label:<34} {tps:>8.1f} {tps / hf_plain_tps:>11.2f}x {str(outs == ref):>10}")
    print("\nratios at the same setting:")
    for ours_name, hf_name in (("plain", "plain"), ("draft", "assisted"), ("ngram", "prompt_lookup")):
        for conc in (1, 8):
            secs = ours[(ours_name, conc)][0]
            print(f"  specsched {ours_name} ({conc}) / HF {hf_name}: {hf[hf_name][0] / secs:.2f}x")


if __name__ == "__main__":
    main()
