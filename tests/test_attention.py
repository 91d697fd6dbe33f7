"""Attention backends against a naive dense reference, and the paged KV cache."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from specsched.runtime.attention import AttentionBackend, StepAttention, get_backend
from specsched.runtime.kv_cache import PagedKVCache
from specsched.scheduler.plan import build_plan

HQ, HKV, D, PS = 4, 2, 8, 4


def reference(q, k_all, v_all, allowed):
    """q [n, Hq, D], k_all/v_all [L, Hkv, D], allowed [n, L] bool -> [n, Hq, D]."""
    rep = q.shape[1] // k_all.shape[1]
    k = k_all.repeat_interleave(rep, 1)
    v = v_all.repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.as_tensor(allowed)[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def random_case(rng, specs, num_pages=64, tree=False):
    """specs: list of (qo_len, kv_len). Returns plan, per-sequence history K/V, new q/k/v and
    the allowed masks; history is already written into a fresh cache."""
    free = list(rng.permutation(num_pages))
    tables = [[int(free.pop()) for _ in range((kv + PS - 1) // PS + 1)] for _, kv in specs]
    masks = []
    for qo, kv in specs:
        causal = np.arange(kv)[None, :] <= (kv - qo + np.arange(qo))[:, None]
        if tree:
            m = causal.copy()
            m[:, kv - qo:] &= rng.random((qo, qo)) < 0.5
            m[np.arange(qo), kv - qo + np.arange(qo)] = True
            masks.append(m)
        else:
            masks.append(causal)
    plan = build_plan([q for q, _ in specs], [k for _, k in specs], tables, PS,
                      custom_masks=masks if tree else None)
    cache = PagedKVCache(2, num_pages, PS, HKV, D)
    hist = []
    for (qo, kv), table in zip(specs, tables):
        k_all, v_all = torch.randn(kv, HKV, D), torch.randn(kv, HKV, D)
        slots = [table[pos // PS] * PS + pos % PS for pos in range(kv - qo)]
        for layer in range(cache.num_layers):
            cache.write_slots(layer, slots, k_all[: kv - qo], v_all[: kv - qo])
        hist.append((k_all, v_all))
    n = plan.num_tokens
    q = torch.randn(n, HQ, D)
    k_new = torch.cat([k[kv - qo:] for (k, _), (qo, kv) in zip(hist, specs)])
    v_new = torch.cat([v[kv - qo:] for (_, v), (qo, kv) in zip(hist, specs)])
    return plan, cache, hist, q, k_new, v_new, masks


CASES = {
    "decode_1": [(1, 9)],
    "prefill_1": [(7, 7)],
    "chunk_1": [(3, 10)],
    "decode_batch_equal": [(1, 8), (1, 8)],
    "decode_batch": [(1, 3), (1, 17), (1, 6)],
    "mixed_batch": [(5, 5), (1, 12), (4, 9), (2, 2)],
}


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_backend_matches_dense_reference(case, tree):
    rng = np.random.default_rng(sorted(CASES).index(case))
    specs = CASES[case]
    plan, cache, hist, q, k_new, v_new, masks = random_case(rng, specs, tree=tree)
    step = get_backend("torch").prepare(plan, "cpu")
    assert isinstance(step, StepAttention)
    for layer_idx, layer in enumerate(cache.layers):  # one prepared step serves every layer
        out = step.attend(layer_idx, q, k_new, v_new, layer)
        assert out.shape == (plan.num_tokens, HQ, D)
        start = 0
        for (qo, kv), (k_all, v_all), m in zip(specs, hist, masks):
            ref = reference(q[start:start + qo], k_all, v_all, m)
            torch.testing.assert_close(out[start:start + qo], ref, atol=1e-5, rtol=1e-5)
            start += qo
    # this step's K/V landed at the plan's slots
    k_read, v_read = cache.read_slots(1, plan.slot_mapping)
    torch.testing.assert_close(k_read, k_new)
    torch.testing.assert_close(v_read, v_new)


def test_a_mixed_step_attends_its_decode_rows_apart_with_the_same_result():
    """Decode rows among prefill chunks are attended apart from them (not padded to the
    longest chunk's queries); the outputs are those of one padded attention over all rows."""
    from specsched.runtime.attention.torch_backend import SplitStepAttention, TorchStepAttention

    rng = np.random.default_rng(5)
    specs = [(1, 30), (6, 6), (1, 3), (1, 17), (3, 11)]
    plan, cache, _, q, k, v, _ = random_case(rng, specs)
    split = get_backend("torch").prepare(plan, "cpu")
    assert isinstance(split, SplitStepAttention)
    padded = TorchStepAttention(plan, torch.device("cpu"))
    torch.testing.assert_close(split.attend(0, q, k, v, cache.layers[0]), padded.attend(0, q, k, v, cache.layers[1]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("kv_first", [[9], [3, 17, 6], [8, 8]])
def test_a_run_of_one_token_steps_planned_once_matches_a_plan_per_step(kv_first, device):
    """`prepare_steps` (a draft launch's forwards of one token per row, each row's KV one
    longer per step) writes every step's K/V to that step's slots and attends each step over
    the row's keys so far only -- keys the run writes later (beyond a row's length at a step)
    must not leak in -- as a plan per step does, and as the dense reference says."""
    rng = np.random.default_rng(len(kv_first))
    steps, b = 3, len(kv_first)
    kv_last = [n + steps - 1 for n in kv_first]
    free = list(rng.permutation(64))
    tables = np.full((b, 8), -1, dtype=np.int64)
    for i, n in enumerate(kv_last):
        tables[i, : (n + PS - 1) // PS] = [int(free.pop()) for _ in range((n + PS - 1) // PS)]
    lens = (tables >= 0).sum(1)
    backend = get_backend("torch")
    run = backend.prepare_steps(build_plan([1] * b, kv_last, tables, PS, table_lens=lens), steps, device)
    caches = [PagedKVCache(1, 64, PS, HKV, D, device=device) for _ in range(2)]
    hist = [(torch.randn(n, HKV, D, device=device), torch.randn(n, HKV, D, device=device)) for n in kv_last]
    stale = torch.randn(caches[0].layers[0].shape, device=device) * 10  # what the pages (and the scratch page) held: never read
    for cache in caches:  # each row's history before the run (the run writes the rest)
        cache.layers[0].copy_(stale)
        for i, (k_all, v_all) in enumerate(hist):
            n = kv_first[i] - 1
            cache.write_slots(0, [tables[i, pos // PS] * PS + pos % PS for pos in range(n)], k_all[:n], v_all[:n])
    for j in range(steps):
        kv = [n + j for n in kv_first]
        plan = build_plan([1] * b, kv, tables, PS, table_lens=lens)
        np.testing.assert_array_equal(run.positions[j].cpu().numpy(), plan.positions)
        q = torch.randn(b, HQ, D, device=device)
        k = torch.stack([k_all[n - 1] for (k_all, _), n in zip(hist, kv)])
        v = torch.stack([v_all[n - 1] for (_, v_all), n in zip(hist, kv)])
        got = run.step(j).attend(0, q, k, v, caches[0].layers[0])
        want = backend.prepare(plan, device).attend(0, q, k, v, caches[1].layers[0])
        tol = 1e-6 if device == "cpu" else 1e-4  # CUDA's attention kernels differ by shape in the last bits
        torch.testing.assert_close(got, want, atol=tol, rtol=1e-5 if device == "cpu" else 1e-3)
        for i, n in enumerate(kv):
            ref = reference(q[i:i + 1], hist[i][0][:n], hist[i][1][:n], torch.ones((1, n), dtype=torch.bool, device=device))
            torch.testing.assert_close(got[i:i + 1], ref, atol=max(tol, 1e-5), rtol=1e-5 if device == "cpu" else 1e-3)
        torch.testing.assert_close(caches[0].data, caches[1].data)
    with pytest.raises(ValueError, match="one new token per row"):
        backend.prepare_steps(build_plan([2], [5], [[0, 1]], PS), 2, "cpu")
    with pytest.raises(ValueError, match="4 steps do not fit rows of 3 KV tokens"):
        backend.prepare_steps(build_plan([1], [3], [[0]], PS), 4, "cpu")


def test_eager_index_and_mask_match_lazy():
    rng = np.random.default_rng(3)
    plan, cache, _, q, k, v, _ = random_case(rng, CASES["mixed_batch"])
    lazy = get_backend("torch").prepare(plan, "cpu").attend(0, q, k, v, cache.layers[0])
    eager_backend = get_backend("torch", num_kv_heads=HKV, dtype=torch.float32)
    eager = eager_backend.prepare(plan, "cpu").attend(0, q, k, v, cache.layers[0])
    torch.testing.assert_close(lazy, eager)


def test_get_backend():
    assert isinstance(get_backend("torch"), AttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")
    with pytest.raises(ValueError, match="needs num_qo_heads, num_kv_heads and head_dim"):
        get_backend("flashinfer")


def test_plan_validation_errors():
    plan = build_plan([2], [4], [[0]], PS)
    bad = dataclasses.replace(plan, slot_mapping=plan.slot_mapping[:1])
    with pytest.raises(ValueError, match="1 slots for 2 tokens"):
        get_backend("torch").prepare(bad, "cpu")


@pytest.mark.parametrize("layout,page", [("NHD", (4, 2)), ("HND", (2, 4))])
def test_kv_cache_layout_bytes_and_copy_slots(layout, page):
    cache = PagedKVCache(3, 5, 4, 2, 8, dtype=torch.float32, layout=layout)
    assert cache.layers[0].shape == (5 + 1, 2, *page, 8)  # a page: [K/V, offset, head, D] or [K/V, head, offset, D]
    assert cache.layers[2].data_ptr() == cache.data[2].data_ptr()
    assert cache.bytes_per_token == 2 * 3 * 2 * 8 * 4
    assert cache.bytes_per_page == 4 * cache.bytes_per_token
    assert cache.total_bytes == (5 + 1) * cache.bytes_per_page  # the pool's pages and the scratch page
    assert cache.scratch_page == 5
    torch.manual_seed(0)
    cache.data.normal_()
    before = cache.data.clone()
    src, dst = [3, 4, 17], [4, 9, 0]  # overlapping: slot 4 is both read and written
    cache.copy_slots(src, dst)
    for layer in range(3):
        k_src, v_src = (t.clone() for t in _as_cache(before, layout).read_slots(layer, src))
        k_dst, v_dst = cache.read_slots(layer, dst)
        torch.testing.assert_close(k_dst, k_src)
        torch.testing.assert_close(v_dst, v_src)
    untouched = [s for s in range(20) if s not in dst]
    for layer in range(3):
        torch.testing.assert_close(cache.read_slots(layer, untouched)[0],
                                   _as_cache(before, layout).read_slots(layer, untouched)[0])
    # a slot's K and V are where the layout puts them: slot 6 = page 1, offset 2
    k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    cache.write_slots(1, [6], k, v)
    page1 = cache.layers[1][1]
    at = (slice(None), 2) if layout == "NHD" else (slice(None), slice(None), 2)
    torch.testing.assert_close(page1[at], torch.cat((k, v)))
    with pytest.raises(ValueError, match="2 sources but 1 destinations"):
        cache.copy_slots([0, 1], [2])
    with pytest.raises(ValueError, match="out of range"):
        cache.copy_slots([20], [0])
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        PagedKVCache(1, 0, 4, 1, 8)
    with pytest.raises(ValueError, match="layout 'NDH' is not one of NHD, HND"):
        PagedKVCache(1, 4, 4, 1, 8, layout="NDH")


def _as_cache(data: torch.Tensor, layout: str) -> PagedKVCache:
    c = PagedKVCache(data.shape[0], data.shape[1] - 1, 4, 2, data.shape[-1], layout=layout)
    c.data.copy_(data)
    return c


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("case", ["decode_batch", "mixed_batch", "prefill_1"])
@pytest.mark.parametrize("head_dim", [D, 64])
def test_flashinfer_matches_torch_backend(case, tree, head_dim):
    """head_dim 64 is a size FlashInfer's kernels cover (the test data zero-padded to it); the
    model's own D = 8 is padded by the backend itself into a cache `kv_head_dim` wide."""
    pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    rng = np.random.default_rng(7)
    specs = CASES[case]
    plan, cache, _, q, k, v, _ = random_case(rng, specs, tree=tree)
    dtype = torch.bfloat16
    layer = cache.layers[0].to(dev, dtype)  # HND pages, the torch backend's
    pad = (0, head_dim - D)
    q, k, v = (torch.nn.functional.pad(t, pad).to(dev, dtype) for t in (q, k, v))
    ref_layer = torch.nn.functional.pad(layer, pad)
    fi = get_backend("flashinfer", num_qo_heads=HQ, num_kv_heads=HKV, head_dim=head_dim, dtype=dtype)
    assert (fi.kv_layout, get_backend("torch").kv_layout) == ("NHD", "HND")
    # the same pages in FlashInfer's NHD layout ([P, 2, ps, Hkv, D])
    layer = torch.nn.functional.pad(layer.transpose(2, 3).contiguous(), (0, fi.kv_head_dim(head_dim) - D))
    out = fi.prepare(plan, dev).attend(0, q, k, v, layer)
    ref = get_backend("torch").prepare(plan, dev).attend(0, q, k, v, ref_layer)
    torch.testing.assert_close(layer[..., :head_dim].transpose(2, 3), ref_layer)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_flashinfer_packed_mask_reads_back_as_the_kernel_reads_it():
    """Each sequence's bit (q, k) is read at byte start_i + (q * kv_i + k) // 8, bit (q * kv_i + k) % 8,
    start_i the number of mask entries before the sequence (the offset `plan` gives the kernel)."""
    from specsched.runtime.attention.flashinfer_backend import pack_mask

    rng = np.random.default_rng(3)
    qo, kv = np.array([3, 1, 5, 2]), np.array([7, 4, 13, 9])
    mask = rng.random(int((qo * kv).sum())) < 0.5
    packed = pack_mask(mask, qo, kv)
    start = 0
    for q_i, k_i in zip(qo, kv):
        off = np.arange(q_i * k_i)
        read = (packed[start + off // 8] >> (off % 8)) & 1
        np.testing.assert_array_equal(read.astype(bool), mask[start:start + q_i * k_i])
        start += q_i * k_i


def test_flashinfer_head_sizes():
    """Head sizes FlashInfer lacks are padded to the next one it covers; larger ones are refused."""
    from specsched.runtime.attention.flashinfer_backend import SUPPORTED_HEAD_DIMS, padded_head_dim

    assert [padded_head_dim(d) for d in (8, 32, 64, 80, 128, 192, 256)] == [64, 64, 64, 128, 128, 256, 256]
    assert all(padded_head_dim(d) == d for d in SUPPORTED_HEAD_DIMS)
    with pytest.raises(ValueError, match="up to 256, got 320"):
        padded_head_dim(320)
    assert get_backend("torch").kv_head_dim(32) == 32
