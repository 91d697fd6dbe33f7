"""Cost of one model forward versus the number of new tokens, at batch 1.

Why: speculative decoding pays off only if verifying k+1 tokens costs little more than
decoding 1, and if the draft is much cheaper than the target. This script measures both on
this machine, side by side in one run: the target forward for 1, 4 and 8 new tokens over a
cached context (median over interleaved repeats, relative to 1 token), the host-side
`prepare` (attention planning) time, and the draft/target cost ratio. The models run as a CPU
worker runs them: packed linears, the C kernels (runtime/cpu_kernels.c) where they build, each
layer one C call where it can (`cpu_kernels.FusedLayer`); the same forwards op by op, in the same
rounds, give that call's speedup ("a layer a call").

    python benchmarks/forward_cost.py                 # bundled target/draft
    python benchmarks/forward_cost.py --random        # random models of the bundled shapes
    python benchmarks/forward_cost.py --random --hf   # also time transformers at 1 token
    python benchmarks/forward_cost.py --random --layers 6 12 18   # targets of several depths

Why several depths: on a CPU a forward of these small models costs about the same per layer
whatever the layer's width (a few dozen small ops each), so a one-layer proposer's price
relative to the target is set by the target's depth, and with it how far speculation can pay
(the analytic bound AL / (T_verify(1 + D) + cost of the proposer's forwards), in units of
one target token).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specsched.runtime import cpu_kernels
from specsched.runtime.attention import resolve_backend
from specsched.runtime.checkpoint import load_model
from specsched.runtime.layers import pack_linears, use_cpu_kernels
from specsched.runtime.config import ModelConfig
from specsched.runtime.model import LlamaModel
from specsched.scheduler.plan import build_plan

REPO = Path(__file__).resolve().parents[1]
TARGET_SHAPE = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True,
    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
)


def random_model(num_layers: int, seed: int) -> LlamaModel:
    config = ModelConfig.from_hf({**TARGET_SHAPE, "num_hidden_layers": num_layers, "model_type": "llama"})
    return LlamaModel.random(config, seed=seed)


class Runner:
    """One model with `context` cached tokens; `forward(n)` runs n new tokens on top."""

    def __init__(self, model: LlamaModel, context: int, page_size: int) -> None:
        self.model, self.context, self.page_size = model, context, page_size
        num_pages = (context + 64) // page_size + 1
        self.pages = list(range(num_pages))
        # as a CPU worker runs it: packed linears, the C kernels where they build
        pack_linears(model)
        if cpu_kernels.status() is None:
            use_cpu_kernels(model)
        self.whole = [layer.fused for layer in model.layers]  # a layer a C call, where it runs so
        name, _ = resolve_backend("auto", torch.device("cpu"), model.dtype, model.config.head_dim)
        self.backend = model.attention_backend(name)
        self.kv = model.make_kv_cache(num_pages, page_size, backend=self.backend)
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, model.config.vocab_size, (context + 64,), generator=gen)
        with torch.inference_mode():
            self._run(0, context)

    def _run(self, start: int, n: int) -> tuple[float, float]:
        plan = build_plan([n], [start + n], [self.pages], self.page_size)
        t0 = time.perf_counter()
        step = self.backend.prepare(plan, "cpu")
        positions = torch.from_numpy(plan.positions)
        t1 = time.perf_counter()
        self.model(self.ids[start:start + n], step, self.kv, positions)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def forward(self, n: int, whole: bool = True) -> tuple[float, float]:
        """(prepare_s, forward_s) for n new tokens after the cached context; `whole=False`: every
        layer op by op (its C ops one call each), not in one C call."""
        for layer, fused in zip(self.model.layers, self.whole):
            layer.fused = fused if whole else None
        with torch.inference_mode():
            return self._run(self.context, n)


class HFRunner:
    """transformers' LlamaForCausalLM with the same weights and context, for comparison."""

    def __init__(self, model: LlamaModel, context: int) -> None:
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

        c = model.config
        self.hf = LlamaForCausalLM(LlamaConfig(**{k: getattr(c, k) for k in TARGET_SHAPE})).eval()
        self.hf.load_state_dict(model.hf_state_dict(), strict=False)
        self.context = context
        self.ids = torch.randint(0, c.vocab_size, (1, context + 64))
        self.cache = DynamicCache()
        with torch.inference_mode():
            self.hf(self.ids[:, :context], past_key_values=self.cache, use_cache=True)

    def forward(self, n: int) -> tuple[float, float]:
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.hf(self.ids[:, self.context:self.context + n], past_key_values=self.cache,
                    use_cache=True)
            t1 = time.perf_counter()
            self.cache.crop(-n)
        return 0.0, t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=REPO / "runtime" / "bundled" / "target")
    ap.add_argument("--draft", type=Path, default=REPO / "runtime" / "bundled" / "draft")
    ap.add_argument("--random", action="store_true",
                    help="random target (6 layers) and draft (1 layer) of the bundled shapes")
    ap.add_argument("--layers", type=int, nargs="+", default=[6],
                    help="with --random: the random target's depths, each measured in the same rounds")
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the step")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--hf", action="store_true", help="also time transformers (dev extra)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if min(args.layers) < 1:
        ap.error("--layers must be >= 1")
    if args.layers != [6] and not args.random:
        ap.error("--layers needs --random (the bundled target has its own depth)")
    if args.random:
        targets = {("target" if n == 6 and len(args.layers) == 1 else f"target-{n}L"): random_model(n, seed=0)
                   for n in args.layers}
        draft = random_model(1, seed=1)
    else:
        if not args.target.is_dir():
            raise SystemExit(f"no model at {args.target}; pass --target DIR or --random")
        targets = {"target": load_model(args.target)}
        draft = load_model(args.draft) if args.draft.is_dir() else None

    runners = {name: Runner(model, args.context, args.page_size) for name, model in targets.items()}
    if draft is not None:
        runners["draft"] = Runner(draft, args.context, args.page_size)
    cases = [(name, n) for name in targets for n in (1, 4, 8)] + ([("draft", 1)] if draft else [])
    target = next(iter(targets.values()))
    if args.hf:
        import warnings

        warnings.filterwarnings("ignore")
        runners["transformers"] = HFRunner(target, args.context)
        cases.append(("transformers", 1))
    for name, n in cases * 10:  # warm-up
        runners[name].forward(n)
    prep: dict = {c: [] for c in cases}
    fwd: dict = {c: [] for c in cases}
    ops: dict = {c: [] for c in cases if c[0] != "transformers"}
    for _ in range(args.repeats):
        for name, n in cases:
            p, f = runners[name].forward(n)
            prep[(name, n)].append(p)
            fwd[(name, n)].append(f)
            if (name, n) in ops:
                ops[(name, n)].append(runners[name].forward(n, whole=False)[1])

    med = {c: statistics.median(fwd[c]) for c in cases}
    first = next(iter(targets))
    base = med[(first, 1)]
    print(f"batch 1, {args.context} cached tokens, page size {args.page_size}, "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"{'model':12} {'tokens':>6} {'forward ms':>11} {'vs ' + first + ' 1':>15} {'prepare ms':>11} "
          f"{'op by op ms':>12} {'a layer a call':>15}")
    for name, n in cases:
        ratio = med[(name, n)] / base
        if name == "transformers":
            print(f"{name:12} {n:>6} {med[(name, n)] * 1e3:>11.3f} {ratio:>14.2f}x {'-':>11} {'-':>12} {'-':>15}")
            continue
        by_op = statistics.median(ops[(name, n)])
        print(f"{name:12} {n:>6} {med[(name, n)] * 1e3:>11.3f} {ratio:>14.2f}x "
              f"{statistics.median(prep[(name, n)]) * 1e3:>11.3f} {by_op * 1e3:>12.3f} {by_op / med[(name, n)]:>14.2f}x")
    for name in targets:
        one = med[(name, 1)]
        line = f"{name}: 4 / 8 tokens cost {med[(name, 4)] / one:.2f}x / {med[(name, 8)] / one:.2f}x of one"
        if draft is not None:
            line += f"; draft/target cost ratio (1 token) {med[('draft', 1)] / one:.3f}"
        print(line)
    if args.hf:
        print(f"this runtime / transformers (1 token): {base / med[('transformers', 1)]:.3f}")


if __name__ == "__main__":
    main()
