"""Measure a proposer through the real inference path: Pipeline + ModelWorker, in-process.

Why: MTP-head validation (and the losslessness tests) must go through the code that serves
requests -- the scheduler's pipeline planning KV and attention, the worker's forward /
draft / verify / fill ops, the paged head -- not a training-time proxy. A worker process is
not needed for that: `InlineDevice` executes each launch at once, in launch order, in this
process, which is a valid device (every stream is in order and dependencies are satisfied
trivially). `run_requests` drives a batch of prompts to completion under any schedule;
`write_tiny_family` writes a random tiny model family (target, draft, MTP head, tokenizer)
for tests and demos to serve.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import torch

from scheduler.batch_builder import BatchBuilder, SchedulerConfig
from scheduler.block_manager import BlockManager
from scheduler.pipeline import Pipeline, PipelineConfig
from scheduler.plan import build_plan
from scheduler.protocols import DeviceError
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class _DoneEvent:
    def __init__(self, op: str, stream: str, result: Any, error: str | None, start_ns: int, end_ns: int):
        self.op, self.stream = op, stream
        self.start_ns, self.end_ns = start_ns, end_ns
        self._result, self._error = result, error

    def query(self) -> bool:
        return True

    def synchronize(self, timeout_s: float | None = None) -> Any:
        if self._error is not None:
            raise DeviceError(self.op, self._error)
        return self._result

    async def wait(self) -> Any:
        return self.synchronize()


class _InlineStream:
    def __init__(self, device: "InlineDevice", name: str):
        self.device, self.name = device, name

    def launch(self, op: str, batch: dict) -> _DoneEvent:
        t0 = time.monotonic_ns()
        try:
            result, error = self.device.worker.execute(op, batch), None
        except Exception as exc:  # noqa: BLE001 - reported at the waiter, like a real device
            if self.device.raise_errors:
                raise
            result, error = None, f"{type(exc).__name__}: {exc}"
        return _DoneEvent(op, self.name, result, error, t0, time.monotonic_ns())

    def wait_event(self, event) -> None:
        pass


class InlineDevice:
    """Runs a Worker's ops synchronously at launch (tests, offline evaluation)."""

    kind = "inline"

    def __init__(self, worker, name: str = "inline", raise_errors: bool = False):
        self.worker, self.name, self.raise_errors = worker, name, raise_errors

    def stream(self, name: str) -> _InlineStream:
        return _InlineStream(self, name)

    def close(self) -> None:
        pass


class _Clock:
    def now_ns(self) -> int:
        return time.monotonic_ns()

    async def sleep_ns(self, duration_ns: int) -> None:
        await anyio.sleep(duration_ns / 1e9)


class _Sink:
    def __init__(self) -> None:
        self.finished: dict[str, Request] = {}
        self.done = anyio.Event()
        self.expected = 0

    def on_tokens(self, req: Request, token_ids: list[int]) -> tuple[int, str | None]:
        return len(token_ids), None

    def on_finish(self, req: Request) -> None:
        self.finished[req.request_id] = req
        if len(self.finished) == self.expected:
            self.done.set()


def run_requests(worker, prompts: list[list[int]], params: SamplingParams, *,
                 schedule: str | None = None, num_pages: int = 512, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048) -> list[Request]:
    """Serve `prompts` (token ids) to completion through a Pipeline on an InlineDevice running
    `worker` (a ModelWorker whose proposer defines the spec); returns the finished requests
    in prompt order. `num_pages` must not exceed the worker's KV pages."""
    spec = worker.spec
    schedule = schedule or {"mtp": "mtp", "draft": "overlap"}.get(spec.kind, "sync")
    blocks = BlockManager(num_pages, worker.page_size, ("target",) + ((spec.kv_model,) if spec.kv_model else ()))
    builder = BatchBuilder(SchedulerConfig(max_num_seqs, max_num_batched_tokens, spec.num_candidates,
                                           spec.kv_model), blocks)
    sink = _Sink()
    eos = tuple(worker.target.config.eos_token_ids) if not params.ignore_eos else ()
    pipe = Pipeline(PipelineConfig(schedule, spec), builder, InlineDevice(worker), _Clock(), sink,
                    eos_token_ids=eos)
    sink.expected = len(prompts)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipe.run)
            for i, p in enumerate(prompts):
                pipe.add_request(Request(f"r{i}", list(p), params, arrival_ns=time.monotonic_ns()))
            if prompts:
                await sink.done.wait()
            pipe.stop()

    anyio.run(main)
    return [sink.finished[f"r{i}"] for i in range(len(prompts))]


def save_llama(model, out_dir) -> None:
    """Write a LlamaModel as a Hugging Face checkpoint (config.json + model.safetensors)."""
    import json

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = model.config
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           **c.model_dump(exclude={"rope_scaling", "torch_dtype"}), "torch_dtype": "float32"}
    if c.rope_scaling is not None:
        cfg["rope_scaling"] = c.rope_scaling.model_dump()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.float().contiguous() for k, v in model.hf_state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


TINY_TOKENIZER_SOURCES = ("json/decoder.py", "json/encoder.py", "textwrap.py")  # stdlib files


class TinyFamily(NamedTuple):
    """Directories written by `write_tiny_family` (None: not written)."""

    target: str
    head: str | None
    draft: str | None = None


def write_tiny_tokenizer(out_dir, vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE (`<|bos|>`=0, `<|eos|>`=1) trained in a second on a few stdlib
    sources, saved as `out_dir`/tokenizer.json."""
    import sysconfig

    from runtime.training.tokenizer_train import train_tokenizer

    root = Path(sysconfig.get_paths()["stdlib"])
    tok = train_tokenizer([(root / p).read_text() for p in TINY_TOKENIZER_SOURCES], vocab_size)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    return tok


def write_tiny_family(out_dir, *, seed: int = 0, vocab_size: int = 32, train_steps: int = 150,
                      norms: bool = True, head: bool = True, draft_layers: int = 0,
                      tokenizer_vocab: int | None = None, std: float = 0.25, **config) -> TinyFamily:
    """A random tiny Llama target under `out_dir`/target, and with it
    - `head`: an MTP head in `out_dir`/head, briefly trained on the target's own greedy
      continuations (so drafts are often accepted);
    - `draft_layers` > 0: a draft in `out_dir`/draft, a separate checkpoint made of the target's
      first `draft_layers` layers with its embedding, norm and LM head (so it often agrees);
    - `tokenizer_vocab`: a byte-level BPE tokenizer (`write_tiny_tokenizer`) in the target and
      draft dirs; the vocabulary is then the tokenizer's, with its bos/eos ids.
    `config` overrides the target's ModelConfig fields (default: 2 layers of width 32, MLP width
    2x, 4 heads, 2 KV heads, tied embeddings); weights are N(0, `std`). For tests and demos; a
    few seconds on one CPU thread (the models are dispatch-bound, so more threads only contend)."""
    from runtime.config import ModelConfig

    out = Path(out_dir)
    special: dict = {"eos_token_id": None}
    tok = None
    if tokenizer_vocab is not None:
        from runtime.training.tokenizer_train import special_ids

        tok = write_tiny_tokenizer(out / "target", tokenizer_vocab)
        vocab_size = tok.get_vocab_size()
        special = dict(zip(("bos_token_id", "eos_token_id"), special_ids(tok)))
    fields = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512)
    fields |= special | config
    fields.setdefault("intermediate_size", 2 * fields["hidden_size"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    cfg = ModelConfig(**fields)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _tiny_family(out, cfg, seed, std, train_steps if head else None, norms, draft_layers, tok)
    finally:
        torch.set_num_threads(threads)


def _tiny_family(out: Path, cfg, seed: int, std: float, train_steps: int | None, norms: bool,
                 draft_layers: int, tok: Tokenizer | None) -> TinyFamily:
    from runtime.model import LlamaModel

    target = LlamaModel.random(cfg, seed=seed, std=std)
    save_llama(target, out / "target")
    fam = TinyFamily(str(out / "target"), None)
    if draft_layers:
        draft = LlamaModel(cfg.model_copy(update={"num_hidden_layers": draft_layers}))
        draft.load_hf(target.hf_state_dict())  # the first `draft_layers` layers
        save_llama(draft, out / "draft")
        if tok is not None:
            tok.save(str(out / "draft" / "tokenizer.json"))
        fam = fam._replace(draft=str(out / "draft"))
    if train_steps is not None:
        fam = fam._replace(head=_train_tiny_head(target, out / "head", seed, train_steps, norms))
    return fam


def _train_tiny_head(target, out: Path, seed: int, train_steps: int, norms: bool) -> str:
    from runtime.mtp_head import save_head
    from runtime.training.mtp import TrainConfig, precompute_hidden, train_head

    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, target.config.vocab_size, (64, 4), generator=gen)
    with torch.inference_mode():
        for _ in range(44):
            logits, _ = target.forward_full(seqs)
            seqs = torch.cat([seqs, logits[:, -1].argmax(-1, keepdim=True)], 1)
    hidden = precompute_hidden(target, seqs)
    tcfg = TrainConfig(seq_len=seqs.shape[1] - 2, batch_size=16, lr=1e-2, steps=train_steps, seed=seed)
    head, _ = train_head(target, seqs, hidden, norms=norms, cfg=tcfg, log=lambda *_: None)
    save_head(head, out, target)
    return str(out)


@dataclass(frozen=True)
class AcceptanceSummary:
    num_requests: int
    num_output_tokens: int
    num_drafts: int  # verify steps with >= 1 draft
    mean_acceptance_length: float  # 1 + accepted / drafts
    acceptance_per_position: tuple[float, ...]  # [D] accepted / drafted at draft position k


def summarize(requests: list[Request]) -> AcceptanceSummary:
    drafts = sum(r.num_drafts for r in requests)
    accepted = sum(r.num_accepted_tokens for r in requests)
    width = max((len(r.drafted_per_pos) for r in requests), default=0)
    per_pos = []
    for k in range(width):
        d = sum(r.drafted_per_pos[k] for r in requests if k < len(r.drafted_per_pos))
        a = sum(r.accepted_per_pos[k] for r in requests if k < len(r.accepted_per_pos))
        per_pos.append(a / d if d else 0.0)
    return AcceptanceSummary(len(requests), sum(r.num_output_tokens for r in requests), drafts,
                             1.0 + accepted / drafts if drafts else 1.0, tuple(per_pos))


@torch.inference_mode()
def paged_agreement(target, head, windows: torch.Tensor, page_size: int = 16) -> float:
    """First-token agreement through the paged path: for each window [N, S] the target runs a
    paged prefill (hidden states H), the head a paged pass over (H_i, t_{i+1}); the fraction
    of positions where the head's argmax at i equals the target's argmax at i+1."""
    same = total = 0
    backend = target.attention_backend("torch")
    for w in windows:
        s = int(w.shape[0])
        pages = list(range((s + page_size - 1) // page_size))
        kv_t = target.make_kv_cache(len(pages), page_size)
        kv_h = head.make_kv_cache(len(pages), page_size)
        plan = build_plan([s], [s], [pages], page_size)
        step = backend.prepare(plan, target.device)
        pos = torch.as_tensor(plan.positions, device=target.device)
        ids = w.to(target.device)
        out = target(ids, step, kv_t, pos, return_hidden=True)
        hplan = build_plan([s - 1], [s - 1], [pages], page_size)
        hstep = backend.prepare(hplan, target.device)
        hout = head(ids[1:], out.hidden[:-1], hstep, kv_h, pos[:-1])
        guess = hout.logits.argmax(-1)[:-1]  # head at i guesses t_{i+2}
        want = out.logits.argmax(-1)[1:-1]  # target's greedy token after position i+1
        same += int((guess == want).sum())
        total += int(want.numel())
    return same / max(total, 1)


def validate_head(target_dir: str, head_dir: str, heldout_windows: torch.Tensor, prompts: list[list[int]],
                  *, max_tokens: int = 64, draft_lens: tuple[int, ...] = (1, 2, 3),
                  eagle: tuple[int, int, int] | None = (3, 2, 8), log=print) -> dict:
    """Acceptance of the head in `head_dir` through the inference implementation: paged
    first-token agreement on held-out windows, then greedy Pipeline runs on `prompts` with
    the MTP proposer at each D (and an EAGLE tree (depth, top_k, max_nodes)), each checked
    token for token against plain greedy decoding."""
    from runtime.worker import ModelWorker
    from scheduler.proposer import default_tree

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    num_pages = 4 * len(prompts) * ((max(len(p) for p in prompts) + max_tokens + 32) // 16 + 2)
    kw = {"page_size": 16, "num_pages": num_pages}
    plain = ModelWorker(target_dir, {"kind": "none", "draft_len": 0}, **kw)
    t0 = time.perf_counter()
    reference = [r.output_token_ids for r in run_requests(plain, prompts, params, num_pages=num_pages)]
    plain_s = time.perf_counter() - t0
    report: dict = {"num_prompts": len(prompts), "max_tokens": max_tokens}
    runs = [("mtp", d, {"kind": "mtp", "draft_len": d}) for d in draft_lens]
    if eagle is not None:
        depth, top_k, max_nodes = eagle
        parents = list(default_tree(depth, top_k, max_nodes))
        runs.append((f"eagle(depth={depth},top_k={top_k},nodes={len(parents)})", depth,
                     {"kind": "eagle", "draft_len": depth, "tree_parents": parents}))
    for name, d, prop in runs:
        worker = ModelWorker(target_dir, prop, proposer_dir=head_dir, **kw)
        if not report.get("paged_agreement"):
            report["paged_agreement"] = paged_agreement(worker.target, worker.proposer.head, heldout_windows)
            log(f"[validate] paged first-token agreement {report['paged_agreement']:.3f} "
                f"on {heldout_windows.numel():,} held-out tokens")
        t0 = time.perf_counter()
        reqs = run_requests(worker, prompts, params, num_pages=num_pages)
        s = summarize(reqs)
        same = [r.output_token_ids for r in reqs] == reference
        key = f"mtp D={d}" if name == "mtp" else name
        report[key] = {"mean_acceptance_length": round(s.mean_acceptance_length, 3),
                       "acceptance_per_position": [round(x, 3) for x in s.acceptance_per_position[:d]],
                       "identical_to_greedy": same,
                       "wall_ratio_vs_plain": round((time.perf_counter() - t0) / plain_s, 2)}
        log(f"[validate] {key}: AL {s.mean_acceptance_length:.3f} per-position "
            f"{report[key]['acceptance_per_position']} identical={same}")
    return report
