"""FlashInfer attention on the bundled target (CUDA only, skipped without a GPU and FlashInfer).

FlashInfer runs 16-bit models only, so its logits are judged against the float32 model with
the torch backend, next to the same bfloat16 model with the torch backend: FlashInfer's error
must be no larger than bfloat16's own (plus a small margin), on every kind of step the engine
runs -- a ragged prefill over scattered pages, a decode step, verify chunks and a tree verify
next to a causal row. The bundled head size (32) is one FlashInfer's kernels lack, so this
also covers the backend's zero padding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specsched.runtime import bundled
from specsched.runtime.attention import get_backend
from specsched.runtime.checkpoint import load_model
from specsched.scheduler.plan import build_plan

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PAGE = 4
PROMPTS = [[5, 17, 300, 41, 9, 77, 1024, 3, 12, 600, 8], [2, 99, 14], [700, 701, 9, 4000, 31, 31, 31, 5, 6]]


def _steps():
    """(qo_lens per row, custom masks per row or None) of each step after the prefill."""
    tree_parents = [-1, 0, 0, 1, 2]  # a root and two branches of two
    return [("decode", [1, 1, 1], None), ("verify", [5, 3, 5], None), ("tree", [1, len(tree_parents), 1], tree_parents)]


def _run(dtype: torch.dtype, attention: str, **options) -> list[tuple[str, torch.Tensor]]:
    model = load_model(bundled.target_dir(), dtype=dtype, device="cuda")
    backend = (model.attention_backend(attention) if not options else
               get_backend(attention, num_qo_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                           head_dim=model.config.head_dim, dtype=dtype, **options))
    kv = model.make_kv_cache(64, PAGE, backend=backend)
    perm = np.random.default_rng(0).permutation(64)  # one permutation: no page is shared by two rows
    pages = [list(perm[i * 16:(i + 1) * 16]) for i in range(len(PROMPTS))]
    lens = [len(p) for p in PROMPTS]
    out = []

    def step(name, ids, qo, masks=None, positions=None):
        kv_lens = [n + q for n, q in zip(lens, qo)]
        plan = build_plan(qo, kv_lens, pages, PAGE, positions=positions, custom_masks=masks)
        with torch.inference_mode():
            res = model(torch.tensor(ids, device="cuda"), backend.prepare(plan, "cuda"), kv,
                        torch.from_numpy(plan.positions).cuda())
        out.append((name, res.logits.float()))
        return kv_lens

    lens = [0, 0, 0]
    lens = step("prefill", [t for p in PROMPTS for t in p], [len(p) for p in PROMPTS])
    tok = np.random.default_rng(1)
    for name, qo, parents in _steps():
        ids = tok.integers(2, 4000, size=sum(qo)).tolist()
        masks, positions = None, None
        if parents is not None:
            depth, anc = [], []
            for j, p in enumerate(parents):
                depth.append(0 if p < 0 else depth[p] + 1)
                anc.append(([] if p < 0 else anc[p]) + [j])
            masks, positions = [], []
            for i, q in enumerate(qo):
                n = lens[i]
                if q == len(parents):
                    m = np.zeros((q, n + q), dtype=bool)
                    m[:, :n] = True
                    for j in range(q):
                        m[j, [n + a for a in anc[j]]] = True
                    masks.append(m)
                    positions.append(np.array([n + d for d in depth]))
                else:
                    masks.append(None)
                    positions.append(None)
        lens = step(name, ids, qo, masks, positions)  # the tree step is the last: no compaction follows
    return out


@pytest.mark.parametrize("prefill_backend", ["auto", "fa2"])
def test_flashinfer_logits_track_float32_as_closely_as_bfloat16_does(prefill_backend):
    pytest.importorskip("flashinfer")
    ref = _run(torch.float32, "torch")
    bf16 = _run(torch.bfloat16, "torch")
    fi = _run(torch.bfloat16, "flashinfer", prefill_backend=prefill_backend)
    for (name, r), (_, b), (_, f) in zip(ref, bf16, fi):
        err_bf16 = (b - r).abs().max().item()
        err_fi = (f - r).abs().max().item()
        between = (f - b).abs().max().item()
        rel = ((f - b).norm() / b.norm()).item()
        print(f"{name}: max |logit - float32|: torch bf16 {err_bf16:.4f}, flashinfer bf16 {err_fi:.4f}; "
              f"flashinfer vs torch bf16 {between:.4f} (logit scale {r.abs().max().item():.2f}; "
              f"relative L2 {rel:.2e}, mean |diff| {(f - b).abs().mean().item():.2e})")
        assert err_fi <= 1.5 * err_bf16 + 1e-3, name
        # greedy tokens agree wherever float32's top two are further apart than both errors
        top2 = r.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (err_bf16 + err_fi)
        assert torch.equal(f.argmax(-1)[clear], r.argmax(-1)[clear]), name
